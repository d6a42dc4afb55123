"""A progress display for the training loop, on the main process only.

`Accelerator.progress(iterable)` hands back something to iterate exactly like `iterable`. On the main
process it also shows how far the loop is: a tqdm bar when stderr is a terminal and tqdm is installed
(the `progress` extra), else one plain line every `interval` seconds, which is what a log file or a
batch job's output wants instead of a bar redrawn in place. Both show step/total, the rate and the time
left, and the values the loop last passed to `accelerator.log` (loss, learning rate) as a postfix. On
every other process it is the iterable itself: no output, no cost.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

DEFAULT_INTERVAL_SECONDS = 30.0
"""Seconds between two plain lines when stderr is not a terminal."""


def progress(
    iterable: Iterable | None,
    total: int | None,
    desc: str | None,
    is_main_process: bool,
    last_values: Callable[[], dict[str, Any]],
    interval: float | None = None,
    stream: TextIO | None = None,
) -> Iterable:
    """`iterable` (or range(total) when it is None) with a progress display on the main process.

    last_values: returns the values last logged, shown beside the count (read once per step).
    interval: seconds between plain lines (not a terminal); None: DEFAULT_INTERVAL_SECONDS.
    """
    if iterable is None:
        if total is None:
            raise ValueError("progress() needs an iterable or a total=N (the number of steps to count).")
        iterable = range(total)
    if interval is not None and interval < 0:
        raise ValueError(f"interval={interval!r}: seconds between progress lines, 0 or more.")
    if not is_main_process:
        return iterable
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    stream = sys.stderr if stream is None else stream
    bar = _tqdm_bar(total, desc, stream)
    if bar is not None:
        return _with_bar(iterable, bar, last_values)
    every = DEFAULT_INTERVAL_SECONDS if interval is None else interval
    return _with_lines(iterable, total, desc, last_values, every, stream)


def _tqdm_bar(total: int | None, desc: str | None, stream: TextIO) -> Any:
    """A tqdm bar writing to `stream` when it is a terminal and tqdm is installed, else None."""
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, file=stream, dynamic_ncols=True)


def _with_bar(iterable: Iterable, bar: Any, last_values: Callable[[], dict[str, Any]]) -> Iterator:
    shown: dict[str, Any] | None = None
    try:
        for item in iterable:
            yield item
            values = last_values()
            if values is not shown:  # a new accelerator.log() call since the last step
                bar.set_postfix({key: _short(value) for key, value in values.items()}, refresh=False)
                shown = values
            bar.update(1)
    finally:
        bar.close()


def _with_lines(
    iterable: Iterable,
    total: int | None,
    desc: str | None,
    last_values: Callable[[], dict[str, Any]],
    every: float,
    stream: TextIO,
) -> Iterator:
    start = last_line = time.monotonic()
    done = 0
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if now - last_line >= every or done == total:
            last_line = now
            print(_line(desc, done, total, now - start, last_values()), file=stream, flush=True)


def _line(desc: str | None, done: int, total: int | None, elapsed: float, values: dict[str, Any]) -> str:
    """e.g. "train: 120/300 (40%) | 2.51 it/s | 0:00:48 elapsed, 0:01:12 left | loss 1.93, lr 0.0003"."""
    rate = done / elapsed if elapsed > 0 else 0.0
    count = f"{done}/{total} ({done / total:.0%})" if total else f"{done}"
    parts = [f"{desc}: {count}" if desc else count, f"{rate:.2f} it/s", f"{_clock(elapsed)} elapsed"]
    if total and rate > 0:
        parts[-1] += f", {_clock((total - done) / rate)} left"
    if values:
        parts.append(", ".join(f"{key} {_short(value)}" for key, value in values.items()))
    return " | ".join(parts)


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def _short(value: Any) -> Any:
    """A logged value as the display shows it: numbers (and 0-d tensors) to 4 significant digits."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    return f"{value:.4g}" if isinstance(value, float) else value
