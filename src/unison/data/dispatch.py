"""DataLoaderDispatcher: process 0 reads the data, every process gets its piece of each step.

For data that cannot be sharded by index (an IterableDataset, a stream) every process reading the
whole stream would multiply the I/O by the number of processes. Instead process 0 alone iterates
the data (with the loader's workers), groups the samples into rounds with the same arithmetic as
BatchSamplerShard (`iter_rounds`: batch i goes to process i % n, or with split_batches each batch is
cut into n slices; the final round topped up from the start with even_batches), collates each
process's piece with the loader's collate_fn and scatters it. Working on samples rather than on
collated batches means nothing is ever sliced or concatenated, so batches may hold any structure
(strings, per-piece padding, ...); the price is that collation runs in process 0's main process.
A scatter sends every process only its own piece, structure and data in one message.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from .. import ops
from ..state import PartialState
from .loader import LoaderProgress, PreparedDataLoader, carried_settings, reads_through
from .sharding import SkipBatchSampler, check_split, iter_rounds, rounds_for_process


def _as_read(batch: Any) -> Any:
    """collate_fn of process 0's reader: keep the samples, each piece is collated once assembled."""
    return batch


def _scatter_from_main(messages: list[Any] | None) -> Any:
    """Process 0's messages[i] arrives at process i."""
    state = PartialState()
    if state.num_processes == 1:
        return messages[0]
    received: list[Any] = [None]
    dist.scatter_object_list(received, messages if state.is_main_process else None, src=0)
    return received[0]


class DataLoaderDispatcher(PreparedDataLoader):
    """A DataLoader whose process 0 reads every batch and sends each process its piece.

    Built with the user's loader settings (batch_size is the user's per-process batch size, or the
    global one with split_batches). Only process 0 iterates the dataset; the others receive.
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        device: torch.device | str | None = None,
        even_batches: bool = True,
        rng_types: Sequence[str] | None = None,
        non_blocking: bool = False,
        progress: LoaderProgress | None = None,
        **kwargs: Any,
    ):
        super().__init__(
            dataset,
            device=device,
            non_blocking=non_blocking,
            rng_types=rng_types,
            skip_batches=skip_batches,
            progress=progress,
            **kwargs,
        )
        self._init_kwargs.update(split_batches=split_batches, even_batches=even_batches)
        state = PartialState()
        self.num_processes = state.num_processes
        self.process_index = state.process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.source_batch_size: int | None = (
            (self._loader_batch_size or getattr(self.batch_sampler, "batch_size", None))
            if self._auto_collation
            else None
        )
        self._drop_last = self.drop_last or bool(getattr(self.batch_sampler, "drop_last", False))
        if split_batches:
            check_split(self.source_batch_size, self.num_processes)
        self._last_real_samples = -1
        self._reader_loader: DataLoader | None = None

    def _process_batch_size(self) -> int | None:
        if self.source_batch_size is None or not self.split_batches:
            return self.source_batch_size
        return self.source_batch_size // self.num_processes

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes (the global batch)."""
        if self.source_batch_size is None or self.split_batches:
            return self.source_batch_size
        return self.source_batch_size * self.num_processes

    @property
    def samples_per_step(self) -> int:
        return self.total_batch_size or self.num_processes

    def _samples(self) -> int | None:
        """Samples per epoch before sharding, where known."""
        try:
            if isinstance(self.dataset, IterableDataset):
                return len(self.dataset)
            return len(self.batch_sampler.sampler)
        except (AttributeError, TypeError):
            return None

    def _epoch_length(self) -> int:
        samples = self._samples()
        if not isinstance(self.dataset, IterableDataset):
            source_batches = len(self._index_sampler)
        elif samples is None:
            raise TypeError(
                f"len() of this DataLoaderDispatcher is unknown: its {type(self.dataset).__name__} has no "
                "__len__. Iterate without asking for len(), or give the dataset a __len__."
            )
        elif self.source_batch_size is None:
            source_batches = samples
        elif self._drop_last:
            source_batches = samples // self.source_batch_size
        else:
            source_batches = math.ceil(samples / self.source_batch_size)
        last_batch_size = None
        if self.split_batches and samples is not None:
            last_batch_size = samples - (source_batches - 1) * self.source_batch_size
        return rounds_for_process(
            source_batches,
            last_batch_size,
            self.source_batch_size,
            self.num_processes,
            self.process_index,
            self.split_batches,
            self.even_batches,
            self._drop_last,
        )

    def _reader(self, skip_batches: int = 0, keep_first: int = 0) -> DataLoader:
        """Process 0's loader of raw samples: this loader's sampling and workers, collation deferred.

        With skip_batches (map-style data only), the index sampler's batches from the `keep_first`-th
        on are skipped unread.
        """
        if self._reader_loader is not None and not skip_batches:
            return self._reader_loader
        settings = {**carried_settings(self), "collate_fn": _as_read, "pin_memory": False}
        if isinstance(self.dataset, IterableDataset):
            batching = {"batch_size": self._loader_batch_size, "drop_last": self.drop_last}
        elif self._auto_collation:
            batching = {"batch_sampler": SkipBatchSampler(self.batch_sampler, skip_batches, keep_first)}
        else:
            batching = {
                "sampler": SkipBatchSampler(self.sampler, skip_batches, keep_first),
                "batch_size": None,
            }
        reader = DataLoader(self.dataset, **batching, **settings)
        if not skip_batches:
            self._reader_loader = reader
        return reader

    def _rounds(self, skip: int) -> Iterator[tuple[list[Any], int]]:
        """Process 0: each step's collated pieces (one per process, None for nothing) and real rows,
        from the `skip`-th step on.

        Map-style data skips in the sampler, unread, except the first step's samples where the final
        step may be topped up with them (even_batches); a stream, or data read by worker processes, is
        read through (see `reads_through`).
        """
        if reads_through(self) or not skip:
            return self._collated_rounds(self._reader(), skip)
        per_round = 1 if self.split_batches else self.num_processes
        keep = int(self.even_batches and self.num_processes > 1 and not self._drop_last)
        reader = self._reader((skip - keep) * per_round, keep * per_round)
        return self._collated_rounds(reader, keep)

    def _collated_rounds(self, reader: DataLoader, skip: int) -> Iterator[tuple[list[Any], int]]:
        units = reader if self._auto_collation else ([item] for item in reader)
        rounds = iter_rounds(
            units,
            self.source_batch_size,
            self.num_processes,
            self.split_batches,
            self.even_batches,
            self._drop_last,
        )
        for round_ in itertools.islice(rounds, skip, None):
            if self._auto_collation:
                pieces = [None if piece is None else self.collate_fn(list(piece)) for piece in round_.pieces]
                yield pieces, round_.real_samples
            else:  # each item is a ready-made batch: count the rows of the real ones
                pieces = [None if piece is None else self.collate_fn(piece[0]) for piece in round_.pieces]
                real = round_.real_samples
                yield pieces, -1 if real < 0 else sum(ops.find_batch_size(piece) for piece in pieces[:real])

    def _batches(self, skip: int) -> Iterator[Any]:
        self._last_real_samples = -1
        is_main = self.process_index == 0
        rounds = self._rounds(skip) if is_main else iter(())
        while True:
            messages, failure = None, None
            if is_main:
                try:
                    step = next(rounds, None)
                    if step is None:
                        messages = [{"done": True}] * self.num_processes
                    else:
                        pieces, real_samples = step
                        messages = [{"piece": piece, "real_samples": real_samples} for piece in pieces]
                except Exception as error:  # tell the others instead of leaving them waiting
                    failure = error
                    messages = [{"error": f"{type(error).__name__}: {error}"}] * self.num_processes
            message = _scatter_from_main(messages)
            if failure is not None:
                raise failure
            if "error" in message:
                raise RuntimeError(
                    f"process 0 failed to read the next batch for DataLoaderDispatcher ({message['error']}); "
                    "its own traceback shows where."
                )
            if message.get("done"):
                return
            self._last_real_samples = message["real_samples"]
            piece = message["piece"]
            if piece is not None:
                yield ops.recursively_apply(torch.Tensor.pin_memory, piece) if self.pin_memory else piece

    def _final_remainder(self) -> int:
        return self._last_real_samples

    def _even_deal(self) -> tuple[int, int] | None:
        batch_size = self._process_batch_size()
        if batch_size is None or not (self.even_batches or self._drop_last):
            return None
        return self.num_processes, batch_size
