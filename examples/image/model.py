"""A small CNN for 8x8 digits: two 3x3 convolutions, one 2x2 max-pool, one linear classifier."""

from __future__ import annotations

import torch
import torch.nn as nn


class DigitsCNN(nn.Module):
    """conv-relu-conv-relu-pool-linear: (N, 1, 8, 8) images to (N, 10) logits.

    Padding keeps the 8x8 grid through both convolutions, the pool halves it to 4x4, so the classifier
    sees channels x 4 x 4 features.
    """

    def __init__(self, channels: int = 32, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(2 * channels * 4 * 4, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))
