"""Data parallelism with torch's DistributedDataParallel: bucketed all-reduce overlapped with backward."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(
    model: torch.nn.Module, device: torch.device, ddp_kwargs: dict[str, Any]
) -> DistributedDataParallel:
    """Wrap `model` (already on `device`) in DDP; parameters are broadcast from process 0 here."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)


def skip_gradient_sync(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A context in which backward accumulates local gradients without the all-reduce."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside any wrapper unison (or torch.compile) put around it."""
    while True:
        if isinstance(model, DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model
