"""The suite's own time budgets (tests/slowness.py, tests/launching.py): scaled by how busy the machine
is, each launch's its own, and a launch that hangs ends with where each rank is and nothing left running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import slowness
from launching import LaunchTimedOut, launch, process_running


def test_the_factor_can_be_set_and_a_wrong_value_is_refused(monkeypatch):
    monkeypatch.setenv("UNISON_TEST_SLOWNESS", "2.5")
    assert slowness.measure() == slowness.Slowness(2.5, "UNISON_TEST_SLOWNESS=2.5")
    for wrong in ("fast", "0.5", "nan"):
        monkeypatch.setenv("UNISON_TEST_SLOWNESS", wrong)
        with pytest.raises(ValueError, match=rf"UNISON_TEST_SLOWNESS='{wrong}'.*a number >= 1"):
            slowness.measure()
    monkeypatch.setenv("UNISON_TEST_SLOWNESS", "")  # empty: measured
    measured = slowness.measure()
    assert 1 <= measured.factor <= slowness.CAP and measured.source.startswith("measured: "), measured


BURNER = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"  # ends itself, whatever happens


@pytest.mark.serial
def test_the_factor_is_one_on_an_idle_machine_and_rises_when_the_cores_are_busy():
    """The workload, on one thread, against 3 busy-looping processes per core, plus one for each process
    the load average says already runs: the processes it shares the cores with more than double, so it
    takes at least twice as long (measured on the idle 2-core machine: 0.32 s, then 1.12 s; beside 8
    other busy processes, with 6 burners instead of 14, 0.99 s then 1.68 s). On a machine that was idle
    for the last minute the factor is below 1.5."""
    load = os.getloadavg()[0]
    quiet = slowness.measure_seconds()
    if load < 0.5:
        assert quiet / slowness.NOMINAL_SECONDS < 1.5, f"{quiet:.2f} s on an idle machine"
    count = min(3 * min(os.cpu_count() or 1, 4) + round(load), 40)
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(count)]
    try:
        time.sleep(1)
        busy = slowness.measure_seconds()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert busy > 2 * quiet, f"{busy:.2f} s beside {len(burners)} busy processes, {quiet:.2f} s without"
    assert max(1, busy / slowness.NOMINAL_SECONDS) > 1.5


def test_every_test_gets_its_limit_times_the_factor_and_each_launch_adds_its_budget():
    """pytest-timeout's 300 s (pyproject.toml) times the factor, and the deadline moves with each launch."""
    if slowness.test_deadline() is None:
        pytest.skip("no pytest-timeout timer runs (-p no:timeout, or --timeout 0)")
    remaining = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's signal method
    limit = 300 * slowness.factor()
    assert limit - 60 < remaining <= limit, (remaining, limit)
    assert abs(slowness.test_deadline() - time.monotonic() - remaining) < 1
    slowness.extend_test_timer(100)
    extended = signal.getitimer(signal.ITIMER_REAL)[0]
    assert extended == pytest.approx(remaining + 100 + slowness.TIMER_GRACE_SECONDS, abs=2)


HANG = """\
import os, time
from unison import PartialState

state = PartialState(cpu=True)
print(f"rank {state.process_index} pid {os.getpid()}", flush=True)
if state.process_index == 1:
    time.sleep(3600)  # the hang
state.wait_for_everyone()
"""


def test_a_launch_that_hangs_fails_within_its_budget_showing_each_ranks_stack_and_leaves_nothing(tmp_path):
    """Rank 1 sleeps, rank 0 waits for it in a barrier (the watchdog's stall timeout, 900 s before the
    first step, is far away): at its budget (20 s idle, times the factor) the launch is ended, every rank
    first dumping its Python stacks, and the error shows them with all the output; no process of the
    launch is left."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        launch(script, 2, timeout=20)
    elapsed = time.monotonic() - started
    error = caught.value
    assert isinstance(error, LaunchTimedOut)
    budget = 20 * slowness.factor()
    assert error.timeout == budget and budget <= elapsed < budget + 45, (elapsed, budget)
    message = str(error)
    assert f"timed out after {budget:.0f} s (its budget: 20 s on an idle machine x slowness" in message
    pids = [int(pid) for pid in re.findall(r"rank \d pid (\d+)", message)]
    assert len(pids) == 2, message
    assert re.search(r'hang\.py", line 7 in <module>', message), message  # rank 1's time.sleep
    assert re.search(r'hang\.py", line 8 in <module>', message), message  # rank 0's barrier
    assert set(pids) < set(error.ended), (pids, error.ended)
    assert not [pid for pid in error.ended if process_running(pid)], error.ended
