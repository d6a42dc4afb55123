"""`unison plot`: draw the curves the `jsonl` tracker logged, one subplot per metric, runs overlaid."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..observing import plotting


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "plot",
        help="draw logged metrics (metrics.jsonl of the jsonl tracker) to a PNG, several runs overlaid",
        description="Draw the metrics of one or more runs logged with log_with='jsonl' to a PNG: one "
        "subplot per metric, the step on x, one curve per run. Needs matplotlib: "
        "pip install 'unison[plot]'.",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="a metrics.jsonl, a run folder holding one, or a project folder whose subfolders do",
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=None,
        metavar="NAME",
        help="a logged value to plot; repeat for several (default: every numeric one but step and time)",
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="PNG",
        help="where to write the image (default: plot.png in the first RUN folder, or beside its file)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        runs = plotting.load_runs(args.runs)
        metrics = plotting.choose_metrics(runs, args.metric)
        output = args.output or _default_output(args.runs[0])
        written = plotting.draw(runs, metrics, output)
    except (OSError, ValueError, ModuleNotFoundError) as error:  # missing file, unknown metric, no matplotlib
        sys.stderr.write(f"unison plot: error: {error}\n")
        return 1
    if len(runs) > len(args.runs):  # a folder held several runs: say which were found
        print("runs found: " + ", ".join(str(run.path) for run in runs))
    print(f"wrote {written}: {', '.join(metrics)} of {', '.join(run.name for run in runs)}")
    return 0


def _default_output(first: str) -> Path:
    """RUN_DIR/plot.png for a folder; the folder of a metrics.jsonl given as a file."""
    path = Path(first)
    return (path if path.is_dir() else path.parent) / "plot.png"
