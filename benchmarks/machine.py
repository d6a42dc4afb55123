"""What every benchmark records about the machine it ran on, so quoted figures name their machine."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform

import torch


def describe_machine() -> dict:
    """CPU model, cores, memory, torch threads, Python, torch, platform and today's date."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    memory_kb = None
    with contextlib.suppress(OSError, StopIteration):
        memory_kb = int(
            next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1]
        )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": None if memory_kb is None else round(memory_kb / 1e6, 1),
        "threads_per_process": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "date": datetime.date.today().isoformat(),
    }
