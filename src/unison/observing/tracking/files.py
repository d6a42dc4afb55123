"""Built-in trackers that need nothing but the standard library: one JSON object per line, or CSV rows.

Both append to `logging_dir/project_name/` and flush after every call, so a crash loses at most the
line being written, and both can be read by any tool (`pandas.read_json(path, lines=True)`).
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path
from typing import Any

from .base import GeneralTracker, on_host


class _FileTracker(GeneralTracker):
    requires_logging_directory = True
    file_name: str

    def __init__(self, run_name: str, logging_dir: str | os.PathLike):
        self.run_name = run_name
        self.directory = Path(logging_dir) / run_name
        self.path = self.directory / self.file_name
        self._file = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", newline="")  # noqa: SIM115 - closed by finish()

    @property
    def tracker(self) -> Any:
        return self._file

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, text: str) -> None:
        if self._file is None:
            raise RuntimeError(
                f"{type(self).__name__} is not started: call accelerator.init_trackers() first."
            )
        self._file.write(text)
        self._file.flush()


class JSONLinesTracker(_FileTracker):
    """`metrics.jsonl`: {"step": ..., "time": unix seconds, **values} per log call; the configuration
    as one {"config": {...}} line."""

    name = "jsonl"
    file_name = "metrics.jsonl"

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._write(json.dumps({"config": values}, default=str) + "\n")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._write(json.dumps({"step": step, "time": time.time(), **on_host(values)}, default=str) + "\n")


class CSVTracker(_FileTracker):
    """`metrics.csv`: one row per value (step, time, name, value), so the columns stay fixed however
    the logged names vary; the configuration goes to `config.json` beside it."""

    name = "csv"
    file_name = "metrics.csv"
    COLUMNS = ("step", "time", "name", "value")

    def start(self) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        super().start()
        if new:
            self._write(",".join(self.COLUMNS) + "\n")

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        (self.directory / "config.json").write_text(json.dumps(values, indent=1, default=str))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        now, text = time.time(), io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(
            ("" if step is None else step, now, name, value) for name, value in on_host(values).items()
        )
        self._write(text.getvalue())
