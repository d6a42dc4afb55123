"""Device memory between and within trainings: giving it back (Accelerate's `release_memory`, used by
`Accelerator.free_memory`) and finding a batch size that fits (`find_executable_batch_size`)."""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from .state import PartialState

logger = logging.getLogger("unison")


def release_memory(*objects: Any) -> list[None]:
    """Drop these references, collect garbage and empty the CUDA cache; returns a None per object,
    for `model, optimizer = release_memory(model, optimizer)` to drop the caller's references too."""
    released: list[None] = [None] * len(objects)
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return released


_OUT_OF_MEMORY_MESSAGES = (
    " out of memory.",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # what cuDNN says when a workspace does not fit
    "DefaultCPUAllocator: can't allocate memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` says a device (or the host) ran out of memory: the errors a smaller batch fixes."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY_MESSAGES)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable[..., Any]:
    """Decorator: call `function(batch_size, *args, **kwargs)`, and after an out-of-memory error call it
    again with a smaller batch size (x0.9, or what `reduce_batch_size_fn()` returns), as Accelerate does.

    Every process runs the same batch size: after each attempt the processes tell each other whether
    theirs ran out of memory, and if one did, all retry with the smallest of their next sizes (in
    Accelerate each process retries on its own, so they can end up training at different sizes). That
    agreement happens between attempts: an out-of-memory error on one process while the others wait
    inside a collective (a gradient all-reduce) ends the run through the group's timeout instead, as any
    failure of one process inside a collective does. Out-of-memory errors usually strike every process
    at the same step, since they run the same shapes.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )

    @functools.wraps(function)
    def retrying(*args: Any, **kwargs: Any) -> Any:
        batch_size = starting_batch_size
        while True:
            if batch_size < 1:
                raise RuntimeError(
                    f"find_executable_batch_size: no batch size from {starting_batch_size} down to 1 fits in "
                    "memory. Reduce the model or sequence length, or use a layout that shards more (ZeRO-3)."
                )
            release_memory()
            try:
                result, out_of_memory = function(batch_size, *args, **kwargs), False
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                result, out_of_memory = None, True
            smaller = reduce_batch_size_fn() if reduce_batch_size_fn else int(batch_size * 0.9)
            anyone, agreed = _agree(out_of_memory, smaller)
            if not anyone:
                return result
            logger.warning(
                "find_executable_batch_size: out of memory at batch size %d on %s; retrying with %d.",
                batch_size,
                "this process" if out_of_memory else "another process",
                agreed,
            )
            batch_size = agreed

    return retrying


def _agree(out_of_memory: bool, next_size: int) -> tuple[bool, int]:
    """(whether any process ran out of memory, the smallest next batch size), the same on every process."""
    state = PartialState()
    if state.num_processes == 1:
        return out_of_memory, next_size
    # -next_size under max: one all-reduce gives both the flag and the smallest size
    votes = torch.tensor([int(out_of_memory), -next_size], dtype=torch.int64, device=state.device)
    torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX)
    return bool(votes[0].item()), int(-votes[1].item())
