"""The background checkpoint writer's CPU priority: only idle CPU while training runs, full when it waits.

On 2 processes training on 2 cores, a write at normal priority took its CPU (most of it the kernel's copy
into the page cache) from training: 0.72-0.86 of the normal step rate while it ran. Under Linux's
SCHED_IDLE the writer takes only CPU that training leaves idle: 0.91-0.93 (benchmarks/checkpoint_async.py).
But an idle-priority thread starves while anything else keeps every core busy: beside two busy loops a
336 MB write took 226 s instead of 1.7 s. So the priority is lowered only where it can be raised again,
and it is raised as soon as anyone waits for the write (the next save, load_state, end_training, the
exit), so that a wait never lasts longer than a synchronous save would. Raising it back needs
CAP_SYS_NICE or an RLIMIT_NICE that allows nice 0 (root outside a container; not Docker's default root,
not a plain user): elsewhere the writer keeps normal priority and costs training its CPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

_TASKS = Path("/proc/self/task")
_reversible: bool | None = None


def lowering_is_reversible() -> bool:
    """Whether a thread of this process can go to SCHED_IDLE and back (tried once, on a throwaway thread)."""
    global _reversible
    if _reversible is None:
        outcome: list[bool] = []

        def probe() -> None:
            thread = threading.get_native_id()
            try:
                os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError):  # not Linux, or refused
                outcome.append(False)
                return
            try:
                os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
                outcome.append(True)
            except OSError:
                outcome.append(False)

        prober = threading.Thread(target=probe, name="unison-priority-probe")
        prober.start()
        prober.join()
        _reversible = outcome == [True]
    return _reversible


class IdlePriority:
    """One background write's priority: `lower_this_thread()` (the writer, as it starts) puts it, and the
    threads it starts (they inherit it), under SCHED_IDLE; `restore()` (whoever waits for the write)
    returns every thread lowered since to normal priority, and keeps a writer that has not started yet
    from lowering itself. A new write needs a new instance."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle_before: set[int] = set()
        self._lowered = False
        self._waited_for = False

    def lower_this_thread(self) -> None:
        """Nothing where the lowering could not be undone, or once somebody waits for the write."""
        if not lowering_is_reversible():
            return
        with self._lock:
            if self._waited_for:
                return
            self._idle_before = _idle_threads()  # the user's own idle threads, if any, stay as they are
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
            self._lowered = True

    def restore(self) -> None:
        """Normal priority for every thread that went idle since `lower_this_thread` (the writer and the
        checksum threads it started)."""
        with self._lock:
            self._waited_for = True
            if not self._lowered:
                return
            self._lowered = False
            for _ in range(3):  # again, for a thread the writer started while the previous pass ran
                lowered = _idle_threads() - self._idle_before
                for thread in lowered:
                    with contextlib.suppress(OSError):  # a thread that ended meanwhile
                        os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
                if not lowered:
                    return


def _idle_threads() -> set[int]:
    """The native ids of this process's threads under SCHED_IDLE."""
    idle = set()
    for task in _TASKS.iterdir():
        with contextlib.suppress(OSError, ValueError):
            if os.sched_getscheduler(int(task.name)) == os.SCHED_IDLE:
                idle.add(int(task.name))
    return idle
