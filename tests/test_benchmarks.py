"""The benchmarks that compare unison with raw torch still run, and both sides still do the same work.

Smoke runs only (one round, one step): their figures mean nothing here, but the losses do. Each
comparison starts both sides from the same weights on the same batch, so a raw twin that drifts
from unison's layout (another split, another plan, another optimizer) shows as a loss difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launching import REPO_ROOT
from slowness import budget

BENCHMARKS = REPO_ROOT / "benchmarks"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(300)
def test_strategies_versus_raw_torch_computes_the_same_losses(tmp_path):
    out = tmp_path / "raw.json"
    command = [sys.executable, str(BENCHMARKS / "strategies.py"), "--nproc", "2", "--parts", "raw"]
    command += ["--rounds", "2", "--steps-per-round", "1", "--out", str(out)]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=budget(300)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["layout"]: row for row in json.loads(out.read_text())["versus_raw"]}
    assert set(rows) == {
        "ddp",
        "zero2",
        "zero3",
        "tp_size=2",
        "pp_size=2,pp_microbatches=4",
    }
    for layout, row in rows.items():
        assert row["max_loss_difference"] <= 1e-4, (layout, row["max_loss_difference"])
        assert row["last_loss"] < row["first_loss"], (layout, row)  # both trained, 4 steps each


def _smoke_run(script: str) -> str:
    """`script --smoke` on the CPU (the configuration that checks a GPU benchmark runs); its stdout."""
    command = [sys.executable, str(BENCHMARKS / script), "--smoke"]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=budget(120)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.timeout(120)
def test_gpu_benchmark_smoke_run_on_cpu():
    out = _smoke_run("gpu_gpt.py")
    assert "unison / raw" in out, out
    assert "largest loss difference 0.00e+00" in out, out  # fp32: the same arithmetic


@pytest.mark.timeout(120)
def test_gpu_watchdog_benchmark_smoke_run_on_cpu():
    out = _smoke_run("gpu_watchdog.py")
    assert "on / off" in out, out
    assert "watchdog thread alive at the end of 4 of 4 rounds" in out, out
