"""Giving device memory back between two trainings in one script (Accelerate's `release_memory` and
`Accelerator.free_memory`)."""

from __future__ import annotations

import gc
from typing import Any

import torch


def release_memory(*objects: Any) -> list[None]:
    """Drop these references, collect garbage and empty the CUDA cache; returns a None per object,
    for `model, optimizer = release_memory(model, optimizer)` to drop the caller's references too."""
    released: list[None] = [None] * len(objects)
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return released
