"""Which samples each process reads: the arithmetic of sharding, with no communication at all.

Every process iterates the same underlying batch sampler (same seed, same epoch, see
`randomness.py`) and keeps its own share, so the shards are consistent by construction. One round is
one step of all processes together. Without split_batches a round is `num_processes` consecutive
batches and batch i goes to process i % n; with split_batches a round is one batch cut into n
contiguous slices. Only the final round can be incomplete: with even_batches it is topped up with
samples from the start of the epoch, so that every process gets the same number of full batches
(otherwise the processes would disagree on the number of steps and DDP would hang), and the
duplicated samples always come after the real ones when the round is read in process order. That
is what lets gather_for_metrics drop them: `remainder` says how many rows of that round are real.

`iter_rounds` holds the arithmetic once; BatchSamplerShard, IterableDatasetShard and the
DataLoaderDispatcher all use it, so they agree on who gets what.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import BatchSampler, IterableDataset, Sampler


@dataclass
class Round:
    """One step of all processes: each process's piece (None: it gets nothing this step).

    real_samples: how many samples of the round, read in process order, are real data before the
    duplicates that top it up; -1 when nothing was duplicated.
    """

    pieces: list[Sequence[Any] | None]
    real_samples: int = -1


def check_split(batch_size: int | None, num_processes: int) -> None:
    """split_batches cuts each batch into num_processes equal slices: the batch size must allow that."""
    if batch_size is None:
        raise ValueError(
            "split_batches=True needs to know the batch size to cut each batch into equal slices, but the "
            "batch sampler has no batch_size attribute. Give it one, or use split_batches=False."
        )
    if batch_size % num_processes != 0:
        multiple = math.ceil(batch_size / num_processes) * num_processes
        raise ValueError(
            f"split_batches=True cuts each batch into one slice per process, but batch_size={batch_size} is "
            f"not a multiple of num_processes={num_processes}. Use a batch size divisible by {num_processes} "
            f"(e.g. {multiple}), or split_batches=False to give every process whole batches of {batch_size}."
        )


def _cycled(samples: Sequence[Any], count: int) -> list[Any]:
    return list(itertools.islice(itertools.cycle(samples), count))


def iter_rounds(
    batches: Iterable[Sequence[Any]],
    batch_size: int | None,
    num_processes: int,
    split_batches: bool = False,
    even_batches: bool = True,
    drop_last: bool = False,
) -> Iterator[Round]:
    """Group `batches` into rounds and cut each round into one piece per process.

    batch_size None means batches of unknown size (a custom batch sampler): every batch counts as
    full, and with even_batches a short final round is topped up with whole batches from the start.
    An incomplete final round is dropped when drop_last is set. A single process never gets
    duplicates: it has nobody to keep in step with.
    """
    batches_per_round = 1 if split_batches else num_processes
    even_batches = even_batches and num_processes > 1  # one process has nobody to be even with
    first_round: list[Sequence[Any]] | None = None
    pending: list[Sequence[Any]] = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == batches_per_round:
            full = _is_full(pending, batch_size, num_processes, split_batches)
            if drop_last and not full:
                return
            first_round = first_round or pending
            if full and not split_batches:  # the common case, once per step: hand the batches out as they are
                yield Round(pending)
            else:
                yield _assemble(pending, first_round, batch_size, num_processes, split_batches, even_batches)
            pending = []
    if pending and not drop_last:
        yield _assemble(
            pending, first_round or pending, batch_size, num_processes, split_batches, even_batches
        )


def _is_full(
    pending: list[Sequence[Any]], batch_size: int | None, num_processes: int, split_batches: bool
) -> bool:
    if batch_size is None:
        return True
    return sum(len(batch) for batch in pending) == (
        batch_size if split_batches else batch_size * num_processes
    )


def _assemble(
    pending: list[Sequence[Any]],
    first_round: list[Sequence[Any]],
    batch_size: int | None,
    num_processes: int,
    split_batches: bool,
    even_batches: bool,
) -> Round:
    n = num_processes
    real = sum(len(batch) for batch in pending)
    if batch_size is None:  # whole batches of unknown size; only possible without split_batches
        if len(pending) == n:
            return Round(list(pending))
        if not even_batches:
            return Round([*pending, *[None] * (n - len(pending))])
        return Round([*pending, *_cycled(first_round, n - len(pending))], real)
    per_process = batch_size // n if split_batches else batch_size
    if _is_full(pending, batch_size, n, split_batches):  # hand out the batches (or slices) as they are
        if split_batches:
            return Round([pending[0][p * per_process : (p + 1) * per_process] for p in range(n)])
        return Round(list(pending))
    samples = [sample for batch in pending for sample in batch]
    real_samples = -1
    if even_batches:
        start = [sample for batch in first_round for sample in batch]
        samples += _cycled(start, per_process * n - real)
        real_samples = real
    pieces = [samples[p * per_process : (p + 1) * per_process] for p in range(n)]
    return Round([piece or None for piece in pieces], real_samples)


def rounds_for_process(
    num_batches: int,
    last_batch_size: int | None,
    batch_size: int | None,
    num_processes: int,
    process_index: int,
    split_batches: bool,
    even_batches: bool,
    drop_last: bool,
) -> int:
    """How many batches process `process_index` gets from `num_batches` batches (see iter_rounds).

    last_batch_size (None: unknown, assumed full) matters only with split_batches and not
    even_batches, where a short last batch may leave the last processes without a slice.
    """
    if split_batches:
        if drop_last or even_batches or num_batches == 0 or last_batch_size is None:
            return num_batches
        gets_a_slice = last_batch_size > process_index * (batch_size // num_processes)
        return num_batches - 1 + int(gets_a_slice)
    rounds, leftover = divmod(num_batches, num_processes)
    if leftover == 0 or drop_last:
        return rounds
    if even_batches:
        return rounds + 1
    return rounds + int(process_index < leftover)


@dataclass(frozen=True)
class ShortLastRound:
    """A loader's final, incomplete round as it falls on the processes when nothing tops it up
    (even_batches=False): what prepare() needs to refuse a layout whose collectives could not match.

    samples and round_size (samples in a full round) are None where the loader does not say (a custom
    batch sampler, ready-made batches); last_round (samples in the final round) is then None too.
    batches[p] is how many batches process p gets in an epoch.
    """

    num_batches: int
    samples: int | None
    batch_size: int | None
    round_size: int | None
    last_round: int | None
    batches: tuple[int, ...]

    @property
    def unequal_counts(self) -> bool:
        """Some processes get a batch fewer than others: they would miss the others' last step."""
        return len(set(self.batches)) > 1


def short_last_round(loader: Any, num_processes: int, split_batches: bool) -> ShortLastRound | None:
    """The final round of `loader` sharded over `num_processes` without top-up, if it is incomplete.

    None when every round is full, when drop_last drops the incomplete one, for one process, or when
    the loader cannot say ahead (a stream or a batch sampler without a length). It reads only the
    loader's lengths and batch size, so it gives the same answer on every process, before anything
    runs; the counts are `rounds_for_process`' (the arithmetic of iter_rounds).
    """
    counted = None if num_processes == 1 else _batches_of(loader)  # one process is even with itself
    if counted is None:
        return None
    num_batches, samples, batch_size, drop_last = counted
    if drop_last or num_batches == 0:
        return None
    n = num_processes
    round_size = last_round = last_batch = None
    if samples is not None and batch_size is not None:
        round_size = batch_size if split_batches else batch_size * n
        last_round = samples - (samples - 1) // round_size * round_size
        last_batch = samples - (num_batches - 1) * batch_size
    batches = tuple(
        rounds_for_process(num_batches, last_batch, batch_size, n, p, split_batches, False, False)
        for p in range(n)
    )
    if len(set(batches)) == 1 and last_round == round_size:  # equal counts, no short batch (or unknown)
        return None
    return ShortLastRound(num_batches, samples, batch_size, round_size, last_round, batches)


def _batches_of(loader: Any) -> tuple[int, int | None, int | None, bool] | None:
    """(batches, samples, batch size, drop_last) of a DataLoader as its shard will deal them; samples
    and batch size None where unknown; None when the loader has no length."""
    with contextlib.suppress(TypeError):
        if isinstance(loader.dataset, IterableDataset):  # a stream with a length, cut by the loader
            samples, batch_size = len(loader.dataset), loader.batch_size
            if batch_size is None:
                return samples, None, None, False
            return -(-samples // batch_size), samples, batch_size, loader.drop_last
        batch_sampler = loader.batch_sampler
        if batch_sampler is None and isinstance(loader.sampler, BatchSampler):
            batch_sampler = loader.sampler  # batch_size=None over a batch sampler: dataset[list of indices]
        if batch_sampler is None:  # batch_size=None: each index fetches a ready-made batch
            return len(loader.sampler), None, None, False
        batch_size = getattr(batch_sampler, "batch_size", None)
        drop_last = bool(getattr(batch_sampler, "drop_last", False))
        if type(batch_sampler) is not BatchSampler or batch_size is None:  # a custom one: sizes unknown
            return len(batch_sampler), None, None, drop_last
        return len(batch_sampler), len(batch_sampler.sampler), batch_size, drop_last
    return None


def check_process_index(num_processes: int, process_index: int) -> None:
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(
            f"process_index={process_index} with num_processes={num_processes} is impossible: the index "
            "must be in [0, num_processes) and num_processes >= 1."
        )


class BatchSamplerShard(Sampler[list[int]]):
    """This process's share of the batches of `batch_sampler` (see the module docstring).

    Without split_batches, batch i goes to process i % num_processes; with split_batches each batch
    is cut into num_processes slices (the batch size must be a multiple of num_processes: a
    ValueError in the constructor otherwise, so every rank fails before any work). even_batches tops
    the final round up with samples from the start so every process gets the same number of full
    batches; the batch sampler's drop_last drops an incomplete final round instead.
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ):
        check_process_index(num_processes, process_index)
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches:
            check_split(self.batch_size, num_processes)
        self.remainder = -1  # set while iterating the final round, see Round.real_samples

    @property
    def process_batch_size(self) -> int | None:
        """Samples per batch this process gets."""
        if self.batch_size is None or not self.split_batches:
            return self.batch_size
        return self.batch_size // self.num_processes

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes (the global batch)."""
        if self.batch_size is None or self.split_batches:
            return self.batch_size
        return self.batch_size * self.num_processes

    @property
    def total_length(self) -> int:
        """Batches of the underlying batch sampler (all processes together)."""
        return len(self.batch_sampler)

    def _last_batch_size(self) -> int | None:
        try:
            samples = len(self.batch_sampler.sampler)
        except (AttributeError, TypeError):
            return None
        return samples - (self.total_length - 1) * self.batch_size

    def __len__(self) -> int:
        return rounds_for_process(
            self.total_length,
            self._last_batch_size() if self.split_batches and not self.even_batches else None,
            self.batch_size,
            self.num_processes,
            self.process_index,
            self.split_batches,
            self.even_batches,
            self.drop_last,
        )

    def __iter__(self) -> Iterator[list[int]]:
        self.remainder = -1
        if type(self.batch_sampler) is BatchSampler and not self.split_batches and self.num_processes > 1:
            return self._deal_from_index_stream()
        return self._deal(self._rounds(self.batch_sampler))

    def _rounds(self, batches: Iterable[Sequence[Any]]) -> Iterator[Round]:
        return iter_rounds(
            batches,
            self.batch_size,
            self.num_processes,
            self.split_batches,
            self.even_batches,
            self.drop_last,
        )

    def _deal(self, rounds: Iterable[Round]) -> Iterator[list[int]]:
        for round_ in rounds:
            if round_.real_samples >= 0:
                self.remainder = round_.real_samples
            piece = round_.pieces[self.process_index]
            if piece is not None:
                yield piece if isinstance(piece, list) else list(piece)

    def _deal_from_index_stream(self) -> Iterator[list[int]]:
        """iter_rounds' rounds for a plain torch BatchSampler, without building other processes' batches.

        A full round is n * batch_size consecutive indices of the sampler, so this process's batch is one
        slice of them: this runs once per batch and is most of the sampler's cost. The final, incomplete
        round (if any) is cut into batches as BatchSampler would and dealt by iter_rounds' own rules.
        """
        size, n, p = self.batch_size, self.num_processes, self.process_index
        indices = iter(self.batch_sampler.sampler)
        first_round: list[int] | None = None
        while True:
            chunk = list(itertools.islice(indices, n * size))
            if len(chunk) < n * size:
                break
            first_round = first_round or chunk
            yield chunk[p * size : (p + 1) * size]
        if not chunk or self.drop_last:  # drop_last drops an incomplete final round
            return
        batches = [chunk[i : i + size] for i in range(0, len(chunk), size)]
        first = [first_round[i : i + size] for i in range(0, n * size, size)] if first_round else batches
        yield from self._deal([_assemble(batches, first, size, n, False, self.even_batches)])


class SamplerShard(Sampler[int]):
    """Shards a plain index sampler, for loaders without automatic batching (batch_size=None).

    Each index fetches one ready-made batch, so the indices are dealt out like batches of one:
    index i goes to process i % num_processes, and even_batches tops up the final round with
    indices from the start.
    """

    def __init__(
        self,
        sampler: Iterable[int],
        num_processes: int = 1,
        process_index: int = 0,
        even_batches: bool = True,
    ):
        self.batch_sampler = BatchSamplerShard(
            BatchSampler(sampler, 1, drop_last=False), num_processes, process_index, even_batches=even_batches
        )

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[int]:
        for batch in self.batch_sampler:
            yield batch[0]


class SkipBatchSampler(Sampler[Any]):
    """Skips `skip_batches` items of the next pass over `batch_sampler` (after its first `start`
    ones), then forgets it.

    The skipped batches are only index lists: nothing is loaded. Used to resume in the middle of an
    epoch (skip_first_batches, load_state_dict); the epochs after that one are complete again.
    """

    def __init__(self, batch_sampler: Iterable[Any], skip_batches: int = 0, start: int = 0):
        if skip_batches < 0:
            raise ValueError(
                f"skip_batches={skip_batches} is negative: pass the number of batches to skip, >= 0."
            )
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.start = start

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return max(self.total_length - self.skip_batches, 0)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip_batches = self.skip_batches, 0
        batches = iter(self.batch_sampler)
        yield from itertools.islice(batches, self.start)
        yield from itertools.islice(batches, skip, None)


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


class IterableDatasetShard(IterableDataset):
    """This process's share of an iterable dataset: every process reads the whole stream.

    The stream is read in rounds of batch_size * num_processes samples (batch_size with
    split_batches) and this process yields its contiguous slice of each. The last incomplete round is
    topped up with samples from the start of the stream, unless drop_last. `batch_size` is the
    batch size of the loader before sharding.
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ):
        check_process_index(num_processes, process_index)
        if split_batches:
            check_split(batch_size, num_processes)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.remainder = -1  # set while iterating the final round (in the process that iterates)

    @property
    def total_batch_size(self) -> int:
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    @property
    def process_batch_size(self) -> int:
        return self.total_batch_size // self.num_processes

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def remainder_from_length(self) -> int:
        """The final round's real samples computed from len(dataset) (-1: none duplicated or unknown).

        For loaders with worker processes, where the shard iterates in a copy of this object.
        """
        try:
            real = len(self.dataset) % self.total_batch_size
        except TypeError:
            return -1
        return -1 if real == 0 or self.drop_last or self.num_processes == 1 else real

    def __len__(self) -> int:
        rounds, leftover = divmod(len(self.dataset), self.total_batch_size)
        if self.drop_last or not leftover:
            return rounds * self.process_batch_size
        if self.num_processes == 1:  # nothing topped up, see iter_rounds
            return rounds * self.process_batch_size + leftover
        return (rounds + 1) * self.process_batch_size

    def __iter__(self) -> Iterator[Any]:
        self.remainder = -1
        per_process = self.process_batch_size
        rounds = iter_rounds(
            _chunks(self.dataset, per_process), per_process, self.num_processes, drop_last=self.drop_last
        )
        for round_ in rounds:
            if round_.real_samples >= 0:
                self.remainder = round_.real_samples
            yield from round_.pieces[self.process_index]
