"""DataLoaderDispatcher: process 0 reads the data, every process gets its piece of each step.

For data that cannot be sharded by index (an IterableDataset, a stream) every process reading the
whole stream would multiply the I/O by the number of processes. Instead process 0 alone iterates the
user's loader, groups its batches into rounds with the same arithmetic as BatchSamplerShard
(`iter_rounds`: batch i goes to process i % n, or with split_batches each batch is cut into n
slices; the final round topped up from the start with even_batches) and scatters each process its
piece. A scatter sends every process only its own piece, with the batch structure (any nested
lists/dicts, strings included) in the same message.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from .. import ops
from ..state import PartialState
from .loader import LoaderProgress, PreparedDataLoader
from .sharding import check_split, iter_rounds, rounds_for_process


class _RowStore:
    """Process 0's batches, addressed by the running row numbers that iter_rounds deals out.

    It keeps the batches of the current round and of the first round (whose rows top up the final
    round), and turns a piece (a sequence of row numbers) back into a batch: the batch itself when
    the piece is one whole batch, else tensor slices concatenated.
    """

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.batches: dict[int, Any] = {}
        self.sizes: dict[int, int] = {}
        self.first_round: set[int] | None = None

    def read(self, batches: Iterable[Any]) -> Iterator[range]:
        next_row = 0
        for batch in batches:
            size = ops.find_batch_size(batch)
            self.starts.append(next_row)
            self.batches[next_row] = batch
            self.sizes[next_row] = size
            yield range(next_row, next_row + size)
            next_row += size

    def end_round(self) -> None:
        if self.first_round is None:
            self.first_round = set(self.starts)
            return
        for start in self.starts:
            if start not in self.first_round:
                del self.batches[start], self.sizes[start]
        self.starts = sorted(self.first_round)

    def rows(self, rows: Sequence[int]) -> Any:
        runs: list[list[int]] = []  # [batch start, first row, end row) within that batch
        for row in rows:
            last = runs[-1] if runs else None
            if last and row == last[0] + last[2] and last[2] < self.sizes[last[0]]:
                last[2] += 1
            else:
                start = self.starts[bisect.bisect_right(self.starts, row) - 1]
                runs.append([start, row - start, row - start + 1])
        parts = [self._part(*run) for run in runs]
        return parts[0] if len(parts) == 1 else ops.concatenate(parts)

    def _part(self, start: int, begin: int, end: int) -> Any:
        batch = self.batches[start]
        if (begin, end) == (0, self.sizes[start]):
            return batch
        try:
            return ops.recursively_apply(lambda tensor: tensor[begin:end], batch, error_on_other_type=True)
        except TypeError as error:
            raise TypeError(
                "DataLoaderDispatcher has to cut a batch into slices here (split_batches, or topping up "
                f"the final round), which works for tensors only ({error}). Collate the batch into "
                "tensors, or prepare the loader with dispatch_batches=False."
            ) from error


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
        device: torch.device | str | None = None,
        split_batches: bool = False,
        even_batches: bool = True,
        rng_types: Sequence[str] | None = None,
        skip_batches: int = 0,
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

    def _samples(self) -> int | None:
        """Samples per epoch before sharding, where known."""
        try:
            if isinstance(self.dataset, IterableDataset):
                return len(self.dataset)
            return len(self.batch_sampler.sampler)
        except (AttributeError, TypeError):
            return None

    def __len__(self) -> int:
        samples = self._samples()
        if not isinstance(self.dataset, IterableDataset):
            source_batches = len(self._index_sampler)
        elif samples is None:
            raise TypeError(
                f"len() of a DataLoaderDispatcher needs len() of its dataset, a {type(self.dataset).__name__}"
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

    def _rounds(self) -> Iterator[tuple[list[Any], int]]:
        """Process 0: each step's pieces (one per process, None for nothing) and its real sample count."""
        store = _RowStore()
        rounds = iter_rounds(
            store.read(DataLoader.__iter__(self)),
            self.source_batch_size,
            self.num_processes,
            self.split_batches,
            self.even_batches,
            self._drop_last,
        )
        for round_ in rounds:
            yield (
                [None if piece is None else store.rows(piece) for piece in round_.pieces],
                round_.real_samples,
            )
            store.end_round()

    def _batches(self, skip: int) -> Iterator[Any]:
        self._last_real_samples = -1
        is_main = self.process_index == 0
        rounds = self._rounds() if is_main else iter(())
        for _ in range(skip):  # skipped steps are read by process 0 but never sent
            if next(rounds, None) is None:
                break
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
            if message["piece"] is not None:
                yield message["piece"]

    def _final_remainder(self) -> int:
        return self._last_real_samples
