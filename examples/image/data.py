"""scikit-learn's bundled 8x8 digits as tensors, split once into a fixed train and test set.

The 1,797 images ship inside scikit-learn (no download), so every process, and every run, builds the
same two sets from the same seed. The 360 test images do not divide evenly into the default evaluation
batches of 64 on two processes (360 = 2 x 2 x 64 + 104): the last round is topped up with repeated
images, and only gather_for_metrics' trimming makes the accuracy count each test image once.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

TEST_SIZE = 360
"""Images held out for the test set; the other 1,437 train."""


def load_digits_split(seed: int = 0, test_size: int = TEST_SIZE) -> tuple[TensorDataset, TensorDataset]:
    """(train, test): images as float (N, 1, 8, 8) in [0, 1], labels as int64 in 0-9.

    seed: the permutation that splits the images; the same seed gives the same split everywhere.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "examples/image reads scikit-learn's bundled digits data set, but scikit-learn is not "
            "installed. Install the examples extra: pip install 'unison[examples]' "
            "(from a checkout: pip install -e '.[examples]')."
        ) from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0-16
    labels = torch.tensor(digits.target, dtype=torch.long)
    if not 0 < test_size < len(labels):
        raise ValueError(
            f"test_size={test_size}: the test set takes some but not all of the {len(labels)} images; "
            f"give a number from 1 to {len(labels) - 1}."
        )
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, test = order[test_size:], order[:test_size]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])
