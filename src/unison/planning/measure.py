"""`unison plan --measure`: time the planner's best few layouts on this machine and pick by measurement.

The cost model ranks; a measurement decides, as DeepSpeed's autotuner does. Each candidate runs in a
fresh job of `unison launch --nproc-per-node N` (one process per planned device, so the plan must be
for this one node), through unison.commands.measure_step: the real model from TARGET, prepared in that layout,
a few optimizer steps of the planned shape on random token ids. A candidate that fails (out of memory,
a layout the model cannot take) is reported with its error and left out of the choice.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..parallel.config import ParallelismConfig
from .cost_model import StepCost
from .planner import Plan

MIXED_PRECISION = {"fp32": "no", "bf16-mixed": "bf16", "bf16": "bf16"}
"""The Accelerator's mixed_precision for each planned precision (a bf16-cast model is timed as autocast)."""


@dataclass(frozen=True)
class Measurement:
    """A candidate's predicted and measured step (seconds); `error` says why it has no measurement."""

    config: ParallelismConfig
    predicted: StepCost
    measured: float | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.config.describe(),
            "config": dataclasses.asdict(self.config),
            "predicted_step_seconds": self.predicted.step,
            "measured_step_seconds": self.measured,
            "error": self.error,
        }


def measure(
    target: str, plan: Plan, candidates: int = 3, steps: int = 3, cpu: bool = False, timeout: float = 600
) -> list[Measurement]:
    """Launch the chosen layout and the next `candidates - 1` runners-up in turn; return each one's step."""
    if plan.cost is None:
        raise ValueError("--measure times the priced layouts: give --global-batch-size and --seq-len.")
    if plan.hardware.nodes != 1:
        raise ValueError(
            f"--measure runs the candidates on this machine, one node: plan for --nodes 1 (got "
            f"{plan.hardware.nodes}), e.g. --devices {plan.hardware.devices_per_node}."
        )
    if candidates < 1 or steps < 1:
        raise ValueError(f"--measure {candidates} --measure-steps {steps}: both must be 1 or more.")
    ranked = [(plan.config, plan.cost)] + [(c.config, c.cost) for c in plan.runners_up if c.cost is not None]
    results = []
    for config, cost in ranked[:candidates]:  # each config as prepare() runs it (recomputation included)
        seconds, error = _time_one(target, config, cost, plan, steps, cpu, timeout)
        results.append(Measurement(config, cost, seconds, error))
    return results


def _time_one(
    target: str, config: ParallelismConfig, cost: StepCost, plan: Plan, steps: int, cpu: bool, timeout: float
) -> tuple[float | None, str | None]:
    with tempfile.TemporaryDirectory(prefix="unison-measure-") as folder:
        out = Path(folder) / "step.json"
        command = [
            sys.executable, "-m", "unison", "launch", "--nproc-per-node", str(plan.hardware.devices),
            *(["--cpu"] if cpu else []), "-m", "unison.commands.measure_step", target,
            "--layout", json.dumps(_fields(config)),
            "--micro-batch-size", str(cost.micro_batch_size), "--micro-steps", str(cost.micro_steps),
            "--seq-len", str(plan.workload.seq_len),
            "--mixed-precision", MIXED_PRECISION[plan.workload.precision],
            "--steps", str(steps), "--out", str(out),
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"did not finish within {timeout:g} s"
        if done.returncode != 0 or not out.exists():
            lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            return None, f"exit {done.returncode}: " + (lines[-1] if lines else "no output")
        return json.loads(out.read_text())["step_seconds"], None


def _fields(config: ParallelismConfig) -> dict[str, Any]:
    """The config's fields as JSON: a custom tp_plan (module objects) cannot travel and is left out."""
    fields = dataclasses.asdict(config)
    fields.pop("tp_plan", None)
    return fields


def fastest(results: list[Measurement]) -> Measurement | None:
    """The candidate measured fastest (the pick), or None when none could be measured."""
    timed = [r for r in results if r.measured is not None]
    return min(timed, key=lambda r: r.measured) if timed else None


def format_measurements(results: list[Measurement]) -> list[str]:
    """The table `unison plan --measure` prints, and the choice by measurement."""
    width = max(len(r.config.describe()) for r in results) + 2
    lines = [f"  {'layout':<{width}}{'predicted s':>13}{'measured s':>12}{'measured/predicted':>20}"]
    for r in results:
        if r.measured is None:
            lines.append(f"  {r.config.describe():<{width}}{r.predicted.step:>13.3g}  failed: {r.error}")
        else:
            ratio = r.measured / r.predicted.step
            lines.append(
                f"  {r.config.describe():<{width}}{r.predicted.step:>13.3g}{r.measured:>12.3g}{ratio:>20.2f}"
            )
    best = fastest(results)
    if best is not None:
        lines.append(f"fastest measured: {best.config.describe()} ({best.measured:.3g} s per step)")
    else:
        lines.append("no candidate could be measured: see the errors above")
    return lines
