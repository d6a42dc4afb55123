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


def wrap_data_parallel(model: torch.nn.Module) -> torch.nn.DataParallel:
    """Legacy single-process torch.nn.DataParallel over every visible GPU (opt-in, see check below).

    Each forward scatters the batch from GPU 0, replicates the module to every GPU, gathers the outputs
    back on GPU 0, and backward reduces the gradients there: five exchanges per step where DDP has one.
    """
    check_data_parallel_devices(torch.cuda.device_count())
    return torch.nn.DataParallel(model)


def check_data_parallel_devices(visible_gpus: int) -> None:
    """nn.DataParallel only makes sense over two or more GPUs of one process: refuse anything else."""
    if visible_gpus < 2:
        raise ValueError(
            f"parallelism='dataparallel' (torch.nn.DataParallel) needs at least 2 visible GPUs, but this "
            f"process sees {visible_gpus}: it splits each batch over the GPUs of one process. Use 'ddp' "
            "(one process per device, faster), or run where CUDA_VISIBLE_DEVICES lists 2 or more GPUs."
        )


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
