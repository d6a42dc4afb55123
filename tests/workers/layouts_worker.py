"""Launched worker: tests/test_combination_matrix.py's one launch per world size.

It runs the strategies' layouts (strategy_worker: four optimizer set-ups per layout, memory per rank)
and then the matrix's cells (matrix_worker: precision x the loop's conditions), in the same processes:
each process pays torch's start once (about 5 CPU-seconds, most of a small launch) for both.

argv: `STRATEGIES_REPORT MATRIX_REPORT CHECKPOINTS --strategies LAYOUT... --matrix LAYOUT...`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matrix_worker
import strategy_worker


def main() -> None:
    strategies_report, matrix_report, checkpoints = (Path(arg) for arg in sys.argv[1:4])
    rest = sys.argv[4:]
    split = rest.index("--matrix")
    assert rest[0] == "--strategies", rest
    # the strategies first: each of their runs builds an fp32 Accelerator on the state as it finds it,
    # while each matrix cell resets the state for its own precision
    strategy_worker.run_layouts(strategies_report, rest[1:split])
    matrix_worker.train_mode(matrix_report, checkpoints, rest[split + 1 :])


if __name__ == "__main__":
    main()
