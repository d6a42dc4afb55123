"""The global batch per optimizer step is training state: a resume keeps it, on any number of processes.

Samples per optimizer step = samples per micro-step (all processes together: the training loader's
`samples_per_step`, i.e. batch size x processes, or the batch size alone with split_batches) x the
gradient accumulation. An elastic restart runs the same script on fewer (or more) processes; the script
passes the accumulation it always passes, so keeping that accumulation would halve (or double) the
samples behind every optimizer step, and the learning rate, the scheduler and the step counter would no
longer mean what they meant. So the saved global batch wins: load_state sets the accumulation that keeps
it, says so in one line on the main process, and refuses, before anything is applied, a run whose
micro-step no whole accumulation fits.

Which loader is the training loader: the one being iterated when save_state ran (the usual place, inside
the training loop), recorded in the counters; otherwise every prepared loader, which must then agree.
Without a prepared loader the batch is the script's business (it may already size its accumulation by
the number of processes, as nanoGPT does, and under tensor or pipeline parallelism the processes are not
all data-parallel): the script's accumulation stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..state import GradientState
from .errors import CheckpointError

TRAINING_LOADER = "training_loader"  # counters key: index of the loader iterated at save time, or None


def training_loader_index(dataloaders: Sequence[Any]) -> int | None:
    """The index of the prepared loader being iterated now (a save inside the training loop), or None."""
    active = GradientState().active_dataloader
    return next((i for i, loader in enumerate(dataloaders) if loader is active), None)


@dataclass(frozen=True)
class GlobalBatch:
    """The resumed run's accumulation and, when it differs from the one the script asked for, the line
    that says so."""

    accumulation: int
    message: str | None = None


def _samples_per_micro_step(
    counters: dict[str, Any], saved_loaders: Sequence[dict | None], live_loaders: Sequence[Any]
) -> list[tuple[int, int, int | None]]:
    """(saved, live) samples per micro-step (over the data-parallel processes) and the live per-process
    batch size of the training loader, or of every loader when the save did not happen inside a loop over
    one; [] without prepared loaders."""
    pairs = [
        (int(saved["total_batch_size"]), int(live.samples_per_step), getattr(live, "batch_size", None))
        if saved is not None and saved.get("total_batch_size") and hasattr(live, "samples_per_step")
        else None
        for saved, live in zip(saved_loaders, live_loaders)
    ]
    index = counters.get(TRAINING_LOADER)
    if index is not None and index < len(pairs) and pairs[index] is not None:
        return [pairs[index]]
    return [pair for pair in pairs if pair is not None]


def resumed_global_batch(
    counters: dict[str, Any],
    saved_loaders: Sequence[dict | None],
    live_loaders: Sequence[Any],
    accumulation: int,
    num_processes: int,
    split_batches: bool,
    directory: Path,
) -> GlobalBatch:
    """The accumulation that keeps the saved samples per optimizer step on this run (`accumulation`: what
    the script asked for; `saved_loaders`: each prepared loader's saved state, in order).

    Pure, and computed alike on every process from the files each read: a CheckpointError is raised on
    every process, before anything is applied. A checkpoint from before these counters, and a run without
    prepared loaders, keep the script's accumulation.
    """
    saved_k, saved_world = counters.get("gradient_accumulation_steps"), counters.get("world_size")
    pairs = _samples_per_micro_step(counters, saved_loaders, live_loaders)
    if saved_k is None or saved_world is None or not pairs:
        return GlobalBatch(accumulation)
    saved_per_micro_step, per_micro_step, process_batch = pairs[0]
    needed = {Fraction(saved_k * saved, live) for saved, live, _ in pairs}
    total = saved_k * saved_per_micro_step
    saved_as = f"saved with world size {saved_world} x gradient_accumulation_steps {saved_k}"
    if len(needed) > 1:
        raise CheckpointError(
            f"{directory} was {saved_as}, but this run's prepared data loaders changed their batch sizes "
            "differently, and the save did not happen inside a loop over one of them, so which one's "
            "batch makes the global batch per optimizer step is unknown. Prepare the loaders with their "
            "saved batch sizes, or save inside the training loop (for batch in train_dl: ...)."
        )
    resumed = needed.pop()
    if resumed.denominator != 1:
        raise CheckpointError(
            f"{directory} was {saved_as}: {total} samples per optimizer step ({saved_per_micro_step} samples "
            f"per micro-step). This run on {num_processes} processes takes {per_micro_step} samples per "
            f"micro-step, and no whole gradient_accumulation_steps makes {total} of them. The global batch "
            "per optimizer step is part of the training state (the learning rate and the scheduler were "
            f"tuned for it). {_fix(total, per_micro_step, process_batch, num_processes, split_batches)}"
        )
    if resumed == accumulation:
        return GlobalBatch(accumulation)
    message = (
        f"checkpoint {directory} {saved_as}, resumed with world size {num_processes}: "
        f"gradient_accumulation_steps {accumulation} -> {resumed} keeps its {total} samples per optimizer "
        "step (set accelerator.gradient_accumulation_steps after load_state to change the global batch)"
    )
    return GlobalBatch(int(resumed), message)


def _fix(
    total: int, per_micro_step: int, process_batch: int | None, num_processes: int, split_batches: bool
) -> str:
    """How to resume with the saved global batch: the numbers of data-parallel processes that fit it at
    this per-process batch size, or another batch size."""
    if split_batches or not process_batch or per_micro_step % process_batch:
        return f"Resume with a loader batch size whose micro-step divides {total}."
    fitting = [str(n) for n in range(1, total // process_batch + 1) if total % (process_batch * n) == 0]
    if not fitting:  # the per-process batch itself does not divide the global batch
        return f"Resume with a per-process batch size that makes the micro-step a divisor of {total}."
    kind = "processes" if per_micro_step // process_batch == num_processes else "data-parallel processes"
    return (
        f"Resume on {' or '.join(fitting)} {kind} ({process_batch} samples each per micro-step), or with "
        f"a per-process batch size that makes the micro-step a divisor of {total}."
    )
