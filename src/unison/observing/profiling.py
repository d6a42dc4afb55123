"""`Accelerator.profile()`: torch.profiler over a block of the script, one Chrome trace per process.

Each process profiles its own work (its kernels, its side of the collectives), so each writes its own
trace, named by its process index as Accelerate names it (`profile_<i>.json`), into a directory the
processes may share; chrome://tracing or https://ui.perfetto.dev open it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from ..kwargs_handlers import ProfileKwargs
from ..state import PartialState

TRACE_NAME = "profile_{process_index}.json"
"""Accelerate's PROFILE_PATTERN_NAME: scripts and tools that look for its traces find them."""


@contextlib.contextmanager
def profile(handler: ProfileKwargs) -> Iterator[torch.profiler.profile]:
    """Profile the block with `handler`'s options; with its output_trace_dir, each process then writes its
    trace there and waits for the others (so that every trace exists when any process goes on)."""
    with handler.build() as profiler:
        yield profiler
    if handler.output_trace_dir is None:
        return
    state = PartialState()
    directory = Path(handler.output_trace_dir)
    directory.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(directory / TRACE_NAME.format(process_index=state.process_index)))
    state.wait_for_everyone()
