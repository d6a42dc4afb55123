"""Fixtures shared by the in-process (single-process) tests, and the suite's time budgets scaled to how
busy the machine is (tests/slowness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import slowness
import torch

from unison import AcceleratorState, GradientState, PartialState, env_vars

# In-process tests use tiny tensors: one thread avoids oversubscribing the 2-core CI machine (measured:
# a reference run took 1-5 s with 2 threads under load, 15-30 ms with one).
torch.set_num_threads(1)

# Tests that import a worker module in-process need its helpers (e.g. tiny_gpt), which a launched worker
# finds beside itself.
sys.path.insert(0, str(Path(__file__).parent / "workers"))

_STATES = (PartialState, AcceleratorState, GradientState)
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    *env_vars.ALL,
)


@pytest.fixture
def fresh_state(monkeypatch):
    """A plain `python script.py` process: no launcher variables, no state left by other tests.

    The shared states are per process and refuse conflicting settings, so a test that builds its own
    Accelerator starts from none and leaves the states as it found them.
    """
    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    saved = [dict(state._shared_state) for state in _STATES]
    for state in _STATES:
        state._reset_state()
    yield
    for state, shared in zip(_STATES, saved):
        state._reset_state()
        state._shared_state.update(shared)


# --- order: the longest files first -----------------------------------------------------------------

LONGEST_FIRST = (
    "test_combination_matrix.py",
    "test_plugins.py",
    "test_launch.py",
    "test_resume_every_step.py",
    "test_expert_parallel.py",
    "test_state.py",
)
"""The files that took longest (seconds of wall, docs/test-suite.md), started first: pytest-xdist hands
whole files to its workers in collection order, and a long file started last holds one worker busy
while the other has nothing left to run."""


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the other files, and the tests within a file, keep their order


# --- time budgets (tests/slowness.py) ---------------------------------------------------------------


def pytest_configure(config):
    """The slowness factor, once a session: measured here (or read from UNISON_TEST_SLOWNESS) in the
    process pytest starts, before pytest-xdist starts its workers; a worker takes the controller's."""
    given = getattr(config, "workerinput", {}).get("unison_slowness")
    slowness.set_current(slowness.Slowness(*given) if given else slowness.measure())


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, in the controller: hand each worker the factor measured before it started."""
    node.workerinput["unison_slowness"] = tuple(slowness.current())


def pytest_report_header(config):
    factor, source = slowness.current()
    override = (
        ""
        if source.startswith(slowness.ENVIRONMENT_VARIABLE)
        else f"; {slowness.ENVIRONMENT_VARIABLE} sets it"
    )
    lines = [f"unison: time budgets x {factor} ({source}{override})"]
    if factor >= slowness.BUSY:
        lines.append(
            "unison: a busy machine: each test's and each launch's time limit is scaled by that factor; the "
            "seconds that tests marked serial assert (what the library promises) are not"
        )
    return lines


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's limit of every test (its ini `timeout`, or the test's `timeout` mark) times the
    factor; each launch the test makes then moves the deadline by its own budget
    (slowness.extend_test_timer)."""
    import pytest_timeout

    scaled = settings._replace(timeout=slowness.budget(settings.timeout))
    pytest_timeout.pytest_timeout_set_timer(item, scaled)
    slowness.armed(item, scaled, scaled.timeout)
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item):
    slowness.disarmed()  # and on to pytest-timeout's own, which cancels the timer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that asserts seconds (marked serial) and fails on a busy machine says how busy it was."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("serial") and slowness.factor() >= slowness.BUSY:
        factor, source = slowness.current()
        report.sections.append(
            (
                "slowness",
                f"This test asserts how many seconds something takes, measured on an idle machine; this "
                f"one ran {factor} times slower ({source}) when the session started. Run it again on an "
                "idle machine (scripts/test.sh runs these alone, after the parallel part).",
            )
        )
