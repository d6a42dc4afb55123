"""Training on uneven inputs: torch's Join over DDP models, behind Accelerate's `join_uneven_inputs`.

With even_batches=False a prepared loader tops up nothing, so when the data does not divide evenly
some processes get one batch fewer. A process that has run out would leave the others waiting in
DDP's gradient all-reduce; inside `torch.distributed.algorithms.join.Join` it instead shadows their
collectives until every process has run out: DDP's join hook all-reduces zeros in place of its
gradients (and takes part in the buffers' broadcast), and at the end the parameters of the last
process to join are broadcast to all. Each step's gradient is then the sum of the gradients of the
processes that still had a batch, divided by the number of processes (DDP's default,
divide_by_initial_world_size), as torch documents for Join.

Join knows only its joinables' own collectives. So it needs DDP (parallelism='ddp'): FSDP2's
all-gathers and reduce-scatters (ZeRO-2/3, HSDP, data parallelism beside tensor or pipeline
parallelism) have no join hook, and ZeRO-1's optimizer step broadcasts shards every window. And it
cannot shadow what the loop adds: a window closed by the loader's end while the others keep
accumulating, or any collective the script calls (gather, reduce, backward(num_items=...)).

So prepare() asks here about every even_batches=False loader (`check_loader_rounds_even`): one whose
last round leaves a process a batch fewer is refused under the layouts Join cannot shadow, and under
DDP it carries a warning, said if a pass begins outside join_uneven_inputs (which marks the
Accelerator's loaders as joined while it lasts).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

from torch.distributed.algorithms.join import Join, Joinable
from torch.utils.data import DataLoader

from ..data import BatchSamplerShard, DataLoaderDispatcher
from ..data.loader import PreparedDataLoader, find_in_chain
from ..data.sharding import short_last_round
from .apply import data_parallel_engine
from .config import ParallelismConfig

logger = logging.getLogger("unison")


@contextlib.contextmanager
def join_uneven_inputs(
    layout: ParallelismConfig,
    loaders: Sequence[DataLoader],
    joinables: Sequence[Joinable],
    even_batches: bool | None,
    *,
    default_even_batches: bool,
    accumulation_steps: int,
    sync_with_dataloader: bool,
) -> Iterator[None]:
    """Join over `joinables` while the prepared `loaders` run with `even_batches` (None: the
    Accelerator's `default_even_batches`). `accumulation_steps` and `sync_with_dataloader` are the
    Accelerator's, to refuse windows that would end at different steps on different processes.

    As in Accelerate, Join is enabled only when the batches are uneven (even_batches False), and the
    loaders' setting is restored at the end. One process, or layouts whose processes all read the same
    batches, have nothing to join. Uneven batches under a layout Join cannot shadow are refused with a
    ValueError before anything runs, rather than left to hang in the first collective.
    """
    even = default_even_batches if even_batches is None else even_batches
    if layout.dp_size == 1:  # every process reads the same batches (or there is one process)
        yield
        return
    if not even:
        _check_joinable(layout, joinables, accumulation_steps, sync_with_dataloader)
    with _loaders_even_batches(loaders, even_batches), _loaders_joined(loaders):
        with Join(list(joinables), enable=not even, throw_on_early_termination=False):
            yield


def joins_uneven_inputs(layout: ParallelismConfig) -> bool:
    """Whether a process that has run out of batches can be shadowed for the others: plain DDP only."""
    return data_parallel_engine(layout) == "ddp" and layout.zero_stage != 1


def _unshadowed(layout: ParallelismConfig) -> str:
    """The collectives torch's Join has no hook for under `layout` (one that is not plain DDP)."""
    if layout.zero_stage == 1 and data_parallel_engine(layout) == "ddp":
        return "ZeRO-1's sharded optimizer step"
    return "FSDP2's collectives"


def check_loader_rounds_even(
    loader: DataLoader, layout: ParallelismConfig, split_batches: bool
) -> str | None:
    """Refuse, at prepare(), an even_batches=False loader whose last round the layout cannot run;
    under DDP, return what to say if it is iterated outside join_uneven_inputs (None: nothing).

    Without top-up, a length that does not divide into full rounds leaves some data-parallel ranks a
    batch fewer (or, with split_batches, no slice of the last batch). Outside plain DDP their
    collectives would not match: the others wait until the timeout, or gloo aborts on a size mismatch,
    after the epoch's work. A pipeline's replicas also need last batches of one size (each runs its
    short batch in a schedule of its own, cut into micro-batches by its size). The verdict is the
    loader's arithmetic alone, the same on every process, so every process raises before any
    collective. DDP can run such a loader inside join_uneven_inputs (Accelerate allows it, and prepare()
    cannot see the loop), so there the loader warns at a pass begun outside Join instead: it would
    hang in the others' last backward until the timeout (300 s by default) with no error before.
    """
    if layout.dp_size == 1:
        return None
    short = short_last_round(loader, layout.dp_size, split_batches)
    pipeline = (layout.pp_size or 1) > 1
    if short is None or not (short.unequal_counts or pipeline):
        return None
    if short.samples is None:
        what = f"the loader's {short.num_batches} batches (of sizes it does not say) end on a short round"
        fix = f"a number of batches that is a multiple of {layout.dp_size}"
    else:
        what = (
            f"the loader's {_samples(short.samples)} in batches of {short.batch_size} end on a round of "
            f"{_samples(short.last_round)}, not {short.round_size}"
        )
        fix = f"a dataset length that is a multiple of {short.round_size}"
    fewer = [rank for rank, count in enumerate(short.batches) if count < max(short.batches)]
    if joins_uneven_inputs(layout):
        return (
            f"even_batches=False under {layout.describe()} (DDP): {what}, so data-parallel ranks {fewer} get "
            f"{min(short.batches)} batches and the others {max(short.batches)}, and this pass began outside "
            "accelerator.join_uneven_inputs([model]): the others' last backward (or any collective the loop "
            "calls) will wait for ranks that never come, until the timeout, with no error before. Iterate "
            "inside `with accelerator.join_uneven_inputs([model]):`, or keep even_batches=True, or give the "
            f"DataLoader drop_last=True, or {fix}."
        )
    if short.unequal_counts:
        consequence = (
            f"data-parallel ranks {fewer} get {min(short.batches)} batches and the others "
            f"{max(short.batches)}: the others' last step would wait in {_unshadowed(layout)} for ranks "
            "that never come"
        )
    else:
        consequence = (
            "the pipeline replicas' last batches differ in size and would run schedules of different "
            f"lengths, whose {_unshadowed(layout)} could not match"
        )
    raise ValueError(
        f"even_batches=False under {layout.describe()}: {what}, so {consequence}, until the timeout, after "
        "the epoch's work (torch's Join, behind join_uneven_inputs, shadows only DDP's all-reduce). Keep "
        "even_batches=True (the default: the last round is topped up from the epoch's start, and "
        f"gather_for_metrics drops the top-up), or give the DataLoader drop_last=True, or {fix}."
    )


def _samples(count: int) -> str:
    return f"{count} sample{'' if count == 1 else 's'}"


def _check_joinable(
    layout: ParallelismConfig,
    joinables: Sequence[Joinable],
    accumulation_steps: int,
    sync_with_dataloader: bool,
) -> None:
    if not joins_uneven_inputs(layout):
        raise ValueError(
            f"join_uneven_inputs with uneven batches (even_batches=False) under {layout.describe()}: "
            f"torch's Join shadows DDP's gradient all-reduce for a process that has run out of batches, "
            f"not {_unshadowed(layout)}, so the other processes would wait for ever. Use parallelism='ddp', "
            "or keep even_batches=True (the last round topped up; gather_for_metrics drops the top-up)."
        )
    if accumulation_steps > 1 and sync_with_dataloader:
        raise ValueError(
            f"join_uneven_inputs with uneven batches and gradient_accumulation_steps="
            f"{accumulation_steps}: a loader's last batch closes its window "
            "(sync_with_dataloader=True), so a process with fewer batches would all-reduce while the "
            "others still accumulate. Pass GradientAccumulationPlugin(num_steps=..., "
            "sync_with_dataloader=False) to count windows alike on every process, or keep even_batches=True."
        )
    if not joinables:
        raise ValueError("join_uneven_inputs needs the prepared DDP models to join, e.g. [model].")
    for joinable in joinables:
        if not isinstance(joinable, Joinable):
            raise TypeError(
                f"join_uneven_inputs got a {type(joinable).__qualname__}, which torch's Join cannot shadow "
                "(it is not a torch.distributed.algorithms.Joinable): pass the models prepare() returned, "
                "which are DistributedDataParallel under parallelism='ddp'."
            )


@contextlib.contextmanager
def _loaders_even_batches(loaders: Sequence[DataLoader], even_batches: bool | None) -> Iterator[None]:
    """Set even_batches on the prepared loaders for the duration (None: leave them), then restore it."""
    holders = []
    for loader in loaders if even_batches is not None else ():
        dispatched = isinstance(loader, DataLoaderDispatcher)
        holder = loader if dispatched else find_in_chain(loader, BatchSamplerShard)
        if holder is None:  # an iterable dataset read in shards: its last round is always topped up
            if not even_batches:
                logger.warning(
                    "join_uneven_inputs(even_batches=False) leaves a loader over an IterableDataset read in "
                    "shards even: every process reads the stream, and its last round is always topped up."
                )
            continue
        holders.append((holder, holder.even_batches))
        holder.even_batches = even_batches
    try:
        yield
    finally:
        for holder, value in holders:
            holder.even_batches = value


@contextlib.contextmanager
def _loaders_joined(loaders: Sequence[PreparedDataLoader]) -> Iterator[None]:
    """Mark the prepared loaders as iterated inside Join (they then say no unjoined_warning)."""
    before = [loader.joined for loader in loaders]
    for loader in loaders:
        loader.joined = True
    try:
        yield
    finally:
        for loader, joined in zip(loaders, before):
            loader.joined = joined
