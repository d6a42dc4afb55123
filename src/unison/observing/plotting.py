"""Curves of logged metrics: read the `jsonl` tracker's metrics.jsonl files and draw them, one subplot
per metric with the step on x, several runs overlaid (e.g. the same script under DDP and ZeRO-3).

Reading needs only the standard library; drawing needs matplotlib (the `plot` extra), imported only when
a figure is drawn and used through its object API on the Agg backend: no window, no global pyplot
state, so it works on a headless node and inside another program that uses matplotlib.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
"""The file the `jsonl` tracker writes in PROJECT_DIR/RUN_NAME/."""

NOT_METRICS = ("step", "time")
"""Keys of every logged line that are its coordinates, not values to plot."""


@dataclass
class Run:
    """One metrics.jsonl: metric name -> {step: value}. A step logged twice (a resumed run that re-ran
    steps after its checkpoint) keeps the value logged last."""

    name: str
    path: Path
    series: dict[str, dict[int, float]] = field(default_factory=dict)

    def curve(self, metric: str) -> tuple[list[int], list[float]]:
        """The steps at which `metric` was logged, in order, and its values there."""
        points = sorted(self.series.get(metric, {}).items())
        return [step for step, _ in points], [value for _, value in points]


def find_metrics(path: str | os.PathLike) -> list[Path]:
    """The metrics.jsonl files `path` names: the file itself, RUN_DIR/metrics.jsonl, or else every
    RUN_DIR/*/metrics.jsonl (a project folder whose runs are its subfolders), sorted by name."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: give a {METRICS_FILE} file, a run folder holding one, or a project "
            "folder whose subfolders hold one (the jsonl tracker writes PROJECT_DIR/RUN_NAME/"
            f"{METRICS_FILE})."
        )
    if (path / METRICS_FILE).is_file():
        return [path / METRICS_FILE]
    found = sorted(path.glob(f"*/{METRICS_FILE}"))
    if not found:
        raise FileNotFoundError(
            f"{path} holds no {METRICS_FILE}, neither directly nor in a subfolder: log with "
            "Accelerator(log_with='jsonl', project_dir=...) and call init_trackers(RUN_NAME) first, or "
            "give the file's path."
        )
    return found


def read_run(path: str | os.PathLike, name: str | None = None) -> Run:
    """The numeric values of one metrics.jsonl (configuration lines and text values are skipped).

    A line without a step is placed after the previous line's step, so `log(values)` without step=
    still draws in order. A last line cut short (a run killed while writing) is ignored."""
    path = Path(path)
    run = Run(name or path.parent.name, path)
    lines = path.read_text().splitlines(keepends=True)
    step = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            if number == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{number} is not a JSON line ({error}): {line[:80]!r}") from None
        if not isinstance(record, dict) or set(record) == {"config"}:
            continue
        logged = record.get("step")
        step = logged if isinstance(logged, int) and not isinstance(logged, bool) else step + 1
        for key, value in record.items():
            if key in NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                run.series.setdefault(key, {})[step] = float(value)
    return run


def load_runs(paths: list[str | os.PathLike]) -> list[Run]:
    """Every run the paths name (see find_metrics), each named by its folder; where two folders share a
    name (runs/ddp/gpt and runs/zero3/gpt), by the folder above it too."""
    if not paths:
        raise ValueError("no run given: name a metrics.jsonl file or a folder holding one.")
    files = [file for path in paths for file in find_metrics(path)]
    names = [file.parent.name for file in files]
    labels = [
        f"{file.parent.parent.name}/{name}" if names.count(name) > 1 else name
        for file, name in zip(files, names)
    ]
    return [read_run(file, label) for file, label in zip(files, labels)]


def available_metrics(runs: list[Run]) -> list[str]:
    """Every metric any of the runs logged, in the order they first appear."""
    return list(dict.fromkeys(metric for run in runs for metric in run.series))


def choose_metrics(runs: list[Run], wanted: list[str] | None) -> list[str]:
    """`wanted` if every name in it was logged by some run (None: all of them), else a ValueError that
    lists what was logged."""
    available = available_metrics(runs)
    if not available:
        raise ValueError(f"no numeric values in {', '.join(str(run.path) for run in runs)}: nothing to plot.")
    if not wanted:
        return available
    unknown = [metric for metric in wanted if metric not in available]
    if unknown:
        close = difflib.get_close_matches(unknown[0], available, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"metric {', '.join(map(repr, unknown))} was not logged by "
            f"{', '.join(run.name for run in runs)}{hint}; the metrics logged: {', '.join(available)}."
        )
    return list(dict.fromkeys(wanted))


def draw(runs: list[Run], metrics: list[str], output: str | os.PathLike) -> Path:
    """Write a PNG of `metrics` (one subplot each, step on x) with every run's curve, and return its path."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure(runs, metrics).savefig(output)
    return output


def figure(runs: list[Run], metrics: list[str]) -> Any:
    """The matplotlib Figure `draw` saves: one subplot per metric, run i's curves in colour Ci."""
    Figure, FigureCanvasAgg = _matplotlib()
    figure = Figure(figsize=(8, 2.4 * len(metrics) + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    for ax, metric in zip(axes, metrics):
        for index, run in enumerate(runs):
            steps, values = run.curve(metric)
            if steps:
                ax.plot(
                    steps,
                    values,
                    color=f"C{index % 10}",
                    label=run.name,
                    marker="." if len(steps) < 30 else None,
                )
        ax.set_ylabel(metric)
        _readable_range(ax)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].legend(handles=_legend_handles(runs), loc="best", fontsize="small")
    return figure


def _readable_range(ax: Any) -> None:
    """Tick labels as plain numbers, over a range of at least 0.1% of the values: runs that agree to 1e-7
    (the same loss under DDP and ZeRO-3) then look equal, instead of far apart on a ±1e-7 axis labelled
    with an offset."""
    ax.ticklabel_format(axis="y", useOffset=False)
    low, high = ax.get_ylim()
    least = 1e-3 * max(abs(low), abs(high))
    if high - low < least:
        middle = (low + high) / 2
        ax.set_ylim(middle - least / 2, middle + least / 2)


def _legend_handles(runs: list[Run]) -> list:
    """One legend entry per run, in the colour its curves have in every subplot (a run that did not
    log the first subplot's metric still appears)."""
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=f"C{index % 10}", label=run.name) for index, run in enumerate(runs)]


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ModuleNotFoundError(
            f"plotting needs matplotlib, which is not installed ({error}): `pip install 'unison[plot]'`."
        ) from None
    return Figure, FigureCanvasAgg
