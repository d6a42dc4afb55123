"""How many processes `unison launch --nproc-per-node auto` starts on a machine without GPUs.

Torch-free, so `unison launch --help` can quote the limit without importing torch; the launch options
(unison.launching.options) and the launcher's OMP_NUM_THREADS share (unison.launching.launcher) use it.
"""

from __future__ import annotations

import os

MAX_AUTO_CPU_PROCESSES = 4
"""`--nproc-per-node auto` without GPUs: one process per usable core, at most this many.

Data parallelism inside one CPU box pays only while each process has cores for its own math; the
gloo all-reduce through loopback grows with the number of processes and soon dominates a step (see
the engine notes: communication already dominates at two processes). A few processes, each with its
share of the cores as OpenMP threads, is the sensible default; ask for more by number.
"""


def usable_cpu_count() -> int:
    """CPU cores this process may run on (honours taskset / cgroup cpusets where the OS tells)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1
