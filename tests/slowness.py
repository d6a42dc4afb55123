"""How much slower this machine runs now than the idle machine the suite's time budgets were set on.

The suite's limits (pytest-timeout's 300 s a test, each launch's `timeout=`) were measured on an idle
2-core machine. On a busy one (a laptop building something, a shared CI runner: a load average of 10-20
on 2 cores) the same launches take several times as long and nothing is wrong; fixed limits then turn a
slow run into a red one (a clean clone's run under that load: 155 fixture errors, all pytest-timeout's).
So once per pytest session a fixed CPU workload (small matmuls and a Python loop, one thread:
NOMINAL_SECONDS on that idle machine) is timed, and every budget is multiplied by

    factor = min(CAP, max(1, measured seconds / NOMINAL_SECONDS))

`UNISON_TEST_SLOWNESS=F` sets the factor instead (a CI that knows its runners; 1 keeps the idle
budgets). tests/conftest.py measures it once in the pytest process that starts (the controller, under
pytest-xdist: before its workers start, so the suite's own launches, which the budgets already allow for,
are not counted) and hands it to the xdist workers; it scales pytest-timeout's limit of every test; and
`budget(seconds)` scales each launch's (tests/launching.py) and each other wait on a subprocess.

A launch's budget is its own, not the test's: `extend_test_timer` moves the running test's
pytest-timeout deadline later by each launch's budget, so a module fixture that launches ten runs is not
charged to the one test that happened to trigger it, and a launch that hangs meets its own timeout (with
its output and every rank's stacks: tests/launching.py) before pytest-timeout's.
"""

from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple

ENVIRONMENT_VARIABLE = "UNISON_TEST_SLOWNESS"
NOMINAL_SECONDS = 0.25
"""The workload's wall time on the idle 2-core build machine (measured 0.21-0.27 s, 2026-11-28: its CPU time,
which other work on the machine barely changes)."""
CAP = 20.0
"""Past this the machine is not slow but stuck: a budget 20 times the idle one is already 100 minutes
for a 300 s test."""
BUSY = 1.5
"""From this factor on the session's header says the machine is busy, and a failing serial test says how
busy (the seconds those tests assert are the library's promises: they are not scaled)."""
TIMER_GRACE_SECONDS = 30.0
"""Added to the test's deadline with each launch: what ending a timed-out launch and reading its last
output may take, so that the launch's own timeout, not pytest-timeout's, reports it."""


class Slowness(NamedTuple):
    factor: float
    source: str  # how it was found, for the report header and failure messages


def measure_seconds() -> float:
    """Wall seconds of the fixed workload, on one thread (NOMINAL_SECONDS on the idle build machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _workload(20)  # warm up: allocations, the first matmul's dispatch
        started = time.perf_counter()
        for _ in range(3):
            _workload(600)
        return time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)


def _workload(rounds: int) -> float:
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(96, 96, generator=generator)
    b = torch.randn(96, 96, generator=generator) / 10
    total = 0
    for i in range(rounds):
        a = torch.tanh(a @ b)
        for j in range(2000):
            total += i ^ j
    return total + float(a.sum())


def from_environment() -> Slowness | None:
    """UNISON_TEST_SLOWNESS's factor, or None where it is not set."""
    raw = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 1 <= value <= 1000:  # also refuses nan
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}={raw!r}: the test suite's slowness factor must be a number >= 1 (the "
            "budgets measured on an idle machine are multiplied by it). Set e.g. 3 on a machine three "
            f"times slower, or unset it to have it measured."
        )
    return Slowness(value, f"{ENVIRONMENT_VARIABLE}={raw}")


def measure() -> Slowness:
    """The environment's factor, or one measured now."""
    given = from_environment()
    if given is not None:
        return given
    seconds = measure_seconds()
    factor = round(min(CAP, max(1.0, seconds / NOMINAL_SECONDS)), 2)
    return Slowness(factor, f"measured: a workload of {NOMINAL_SECONDS} s idle took {seconds:.2f} s")


_current: Slowness | None = None


def current() -> Slowness:
    """This session's factor (measured on first use where conftest has not set it)."""
    global _current
    if _current is None:
        _current = measure()
    return _current


def set_current(slowness: Slowness) -> None:
    global _current
    _current = slowness


def factor() -> float:
    return current().factor


def budget(seconds: float) -> float:
    """`seconds` measured on the idle machine, on this one now."""
    return seconds * factor()


# The running test's pytest-timeout timer (tests/conftest.py arms it through these), so that a launch
# can move its deadline: (item, pytest-timeout's settings, deadline on time.monotonic()).
_timer: tuple | None = None


def armed(item, settings, seconds: float) -> None:
    global _timer
    _timer = (item, settings, time.monotonic() + seconds)


def disarmed() -> None:
    global _timer
    _timer = None


def test_deadline() -> float | None:
    """When the running test's pytest-timeout timer fires (time.monotonic()), or None if none runs."""
    return None if _timer is None else _timer[2]


def extend_test_timer(seconds: float) -> None:
    """Move the running test's pytest-timeout deadline `seconds` (+ TIMER_GRACE_SECONDS) later: the time
    of a launch starting now is the launch's budget, not the test's. Only from the main thread (the
    signal method's timer can be set nowhere else); elsewhere the deadline stays."""
    global _timer
    if _timer is None or threading.current_thread() is not threading.main_thread():
        return
    import pytest_timeout

    item, settings, deadline = _timer
    now = time.monotonic()
    deadline = max(deadline, now) + seconds + TIMER_GRACE_SECONDS
    pytest_timeout.pytest_timeout_cancel_timer(item)
    pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=deadline - now))
    _timer = (item, settings, deadline)
