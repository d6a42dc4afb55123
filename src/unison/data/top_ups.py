"""The rows a completed pass topped up, so gather_for_metrics can drop them after the loop too.

With even_batches a pass's final round is topped up with samples from the epoch's start, so that every
process gets a batch (see sharding). Called on each batch inside the loop, gather_for_metrics drops
them at the last batch (`remainder`). A script that instead keeps its per-batch results, concatenates
them after the loop and gathers once holds `rows` rows on every process, and the last `top_ups[p]` rows
of process p are those repeats. A prepared loader whose pass runs to its end notes both here
(`completed_pass`, kept in GradientState.completed_passes, the loader's earlier pass replaced);
gather_for_metrics called away from a loader's last batch asks `rows_to_keep` which gathered rows to
keep.

A length is all there is to go on, so the rule is conservative. A pass is noted only where every
process got the same number of batches of a known size (even_batches, or drop_last; not a batch
sampler without a batch_size, nor ready-made batches), so every process notes the same numbers and
decides alike. Data with exactly `rows` rows per process is taken for that pass's results; where the
length fits several noted passes that repeated different rows, or also fits a batch of a loop still
running, nothing is dropped (Accelerate's result) and the caller warns once, with the fix: call
gather_for_metrics per batch inside the loop. A pass whose repeats were dropped is forgotten as the
next pass of any prepared loader begins (the script has gathered its results and moved on), so
evaluating several loaders one after the other, gathering after each loop, stays unambiguous.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

KEPT_PASSES = 16  # the latest loaders' passes noted; older ones are forgotten


@dataclass
class CompletedPass:
    """rows: the rows each process received in the pass (the same on every process); top_ups[p]: how
    many of process p's, at its end, repeat the epoch's start; gathered: a gather dropped them."""

    rows: int
    top_ups: tuple[int, ...]
    gathered: bool = False


def completed_pass(batches: int, num_processes: int, batch_size: int, remainder: int) -> CompletedPass | None:
    """The pass of `batches` batches of `batch_size` rows on each of `num_processes` processes, whose
    final round held `remainder` real rows in process order (-1: none repeated). None for one process
    (nothing is ever topped up) or an empty pass."""
    if num_processes < 2 or batches < 1:
        return None
    if remainder < 0:
        return CompletedPass(batches * batch_size, (0,) * num_processes)
    real = [min(max(remainder - p * batch_size, 0), batch_size) for p in range(num_processes)]
    return CompletedPass(batches * batch_size, tuple(batch_size - r for r in real))


def note_pass(passes: dict[int, CompletedPass], loader: object, record: CompletedPass | None) -> None:
    """Replace `loader`'s noted pass by `record` (None, as a pass begins: forget it), keeping the latest
    KEPT_PASSES; the passes whose results were gathered are retired."""
    for key in [key for key, noted in passes.items() if noted.gathered or key == id(loader)]:
        del passes[key]
    if record is not None:
        passes[id(loader)] = record
        while len(passes) > KEPT_PASSES:
            passes.pop(next(iter(passes)))


@dataclass(frozen=True)
class Verdict:
    """keep: the slices of the gathered rows to keep (None: all of them); warning: why all were kept
    although a noted pass with repeats has this length (None: nothing to say)."""

    keep: tuple[slice, ...] | None = None
    warning: str | None = None


def rows_to_keep(
    passes: Iterable[CompletedPass],
    rows: int | None,
    gathered: int,
    running_batch_sizes: Iterable[int | None],
) -> Verdict:
    """Which of `gathered` rows (every process's `rows`, in process order) to keep; the pass whose
    repeats it drops is marked `gathered`.

    rows: the rows this process passed to gather_for_metrics (None: not one length for every leaf);
    running_batch_sizes: the batch size of each prepared loader being iterated now (None: unknown).
    """
    if not rows:
        return Verdict()
    matches = [p for p in passes if p.rows == rows and len(p.top_ups) * rows == gathered]
    fitting = {p.top_ups for p in matches}
    repeated = sorted(top_ups for top_ups in fitting if any(top_ups))
    if not repeated:
        return Verdict()
    fix = (
        "call gather_for_metrics on each batch inside the evaluation loop (it drops the repeats at the "
        "last batch) and concatenate what it returns"
    )
    if len(fitting) > 1:
        counts = ", ".join(str(list(top_ups)) for top_ups in sorted(fitting))
        return Verdict(
            warning=f"gather_for_metrics got {rows} rows per process, as many as the completed passes of "
            f"several prepared loaders held, which repeated different numbers of rows at each process's "
            f"end to even out their final batches ({counts}): it cannot tell which pass these results "
            f"come from, so it returns all {gathered} gathered rows, repeats included, as Accelerate "
            f"does. To get each sample once, {fix}."
        )
    sizes = list(running_batch_sizes)
    if any(size is None or size == rows for size in sizes):
        shown = "of unknown size" if rows not in sizes else f"of {rows} rows"
        (top_ups,) = repeated
        return Verdict(
            warning=f"gather_for_metrics got {rows} rows per process while a prepared loader with "
            f"batches {shown} is being iterated, and a completed pass of a prepared loader also held "
            f"{rows} rows per process, the last {list(top_ups)} of them (per process) repeats that "
            f"evened out its final batch: it cannot tell a batch of the running loop from that pass's "
            f"concatenated results, so it returns all {gathered} gathered rows, as Accelerate does. "
            f"To get each sample of that pass once, {fix}."
        )
    (top_ups,) = repeated
    for match in matches:
        match.gathered = True
    return Verdict(keep=tuple(slice(p * rows, (p + 1) * rows - t) for p, t in enumerate(top_ups)))
