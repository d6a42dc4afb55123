"""A process's peak resident memory over a block of code, on Linux (tests and benchmarks only).

Linux's VmHWM is the high-water mark of resident memory; writing "5" to /proc/self/clear_refs resets
it, so one process can measure several phases. Freed memory is handed back to the system first
(malloc_trim), or the block would reuse it unseen.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import torch
import torch.distributed as dist

_LIBC = ctypes.CDLL("libc.so.6")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Peak:
    """The most this process held resident above what it held at the start of the block."""

    def __enter__(self) -> Peak:
        gc.collect()
        _LIBC.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.bytes = _status("VmHWM") - self.start


def on_every_process(value: float) -> list[float]:
    """`value` of every process of the default group, in rank order (collective)."""
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([float(value)], dtype=torch.float64))
    return [v.item() for v in values]
