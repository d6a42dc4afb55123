"""What the progress display and the jsonl tracker cost per training step.

    python benchmarks/progress.py            # table, and benchmarks/results/progress.json

One process. Each variant iterates the same loop of STEPS empty steps, in interleaved rounds, and the
cost per step is its time minus the bare loop's: `accelerator.progress(...)` as plain lines (stderr is
not a terminal here) and as a tqdm bar (written to a terminal-like buffer), each with an
`accelerator.log({"loss", "lr"})` per step to the built-in jsonl tracker, and the tracker alone. The
issue's target is under 1% of the GPT demo's step (about 180 ms on the 2-core machine).
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time
from pathlib import Path

from unison import Accelerator, ProjectConfiguration
from unison.observing.progress import progress

STEPS, ROUNDS = 2000, 7
DEMO_STEP_MS = 180.0  # the GPT demo's step on the 2-core machine (README, command 1)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        accelerator = Accelerator(
            cpu=True, log_with="jsonl", project_config=ProjectConfiguration(project_dir=directory)
        )
        accelerator.init_trackers("progress-benchmark")
        values = lambda: accelerator._last_logged  # noqa: E731  (what accelerator.progress reads)

        def bare() -> None:
            for _ in range(STEPS):
                pass

        def tracker() -> None:
            for step in range(STEPS):
                accelerator.log({"loss": 1.0 / (step + 1), "lr": 3e-4}, step=step)

        def lines() -> None:
            quiet = io.StringIO()  # plain lines at the default interval: at most one in this loop
            for step in progress(range(STEPS), None, "train", True, values, stream=quiet):
                accelerator.log({"loss": 1.0 / (step + 1), "lr": 3e-4}, step=step)

        def bar() -> None:
            for step in progress(range(STEPS), None, "train", True, values, stream=Terminal()):
                accelerator.log({"loss": 1.0 / (step + 1), "lr": 3e-4}, step=step)

        variants = {
            "bare loop": bare,
            "jsonl tracker": tracker,
            "lines + tracker": lines,
            "bar + tracker": bar,
        }
        try:
            import tqdm  # noqa: F401  (the progress extra)
        except ImportError:
            del variants["bar + tracker"]
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, run in variants.items():
                start = time.perf_counter()
                run()
                samples[name].append((time.perf_counter() - start) / STEPS)
        accelerator.end_training()
    bare_s = statistics.median(samples["bare loop"])
    rows = []
    print(f"{'variant':<18} {'us per step':>12} {'% of demo step':>15}")
    for name, times in samples.items():
        cost_us = (statistics.median(times) - bare_s) * 1e6
        share = cost_us / (DEMO_STEP_MS * 1000) * 100
        rows.append({"variant": name, "us_per_step": cost_us, "percent_of_demo_step": share})
        print(f"{name:<18} {cost_us:12.1f} {share:14.3f}%")
    out = Path(__file__).parent / "results" / "progress.json"
    out.write_text(
        json.dumps({"steps": STEPS, "rounds": ROUNDS, "demo_step_ms": DEMO_STEP_MS, "rows": rows}, indent=1)
    )
    print(f"written to {out}")


if __name__ == "__main__":
    main()
