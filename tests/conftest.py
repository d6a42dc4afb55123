"""Fixtures shared by the in-process (single-process) tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
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
