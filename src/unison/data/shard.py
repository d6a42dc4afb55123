"""DataLoaderShard: each process reads its own shard of every epoch, by index or from the stream.

The prepared loader for data every process can read itself: map-style data through a BatchSamplerShard
(or a SamplerShard for ready-made batches) that deals each process its batches of the shared order, an
IterableDataset through an IterableDatasetShard that reads the stream and keeps this process's slice of
each round. What all prepared loaders share (look-ahead, epochs, position, resume) is in `loader`;
process 0 reading for everyone is `dispatch`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from .loader import PreparedDataLoader, find_in_chain, reads_through, skipping_loader
from .sharding import BatchSamplerShard, IterableDatasetShard, SamplerShard


class DataLoaderShard(PreparedDataLoader):
    """A DataLoader that yields this process's shard of every epoch, on `device`.

    Built by prepare_data_loader from the user's loader: same dataset, collate_fn, workers and
    other settings, with a BatchSamplerShard (map-style data) or an IterableDatasetShard (iterable
    data) deciding which samples this process reads.
    """

    def _shard(self) -> BatchSamplerShard | None:
        if find_in_chain(self._index_sampler, SamplerShard) is not None:
            return None  # each index fetches a ready-made batch: the shard counts batches, not samples
        return find_in_chain(self._index_sampler, BatchSamplerShard)

    def _process_batch_size(self) -> int | None:
        shard = self._shard()
        if shard is not None:
            return shard.process_batch_size
        if self._loader_batch_size is not None or not self._auto_collation:
            return self._loader_batch_size
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes (the global batch)."""
        shard = self._shard()
        if shard is not None:
            return shard.total_batch_size
        if isinstance(self.dataset, IterableDatasetShard) and self._auto_collation:
            return self.dataset.total_batch_size
        return self.batch_size

    @property
    def samples_per_step(self) -> int:
        total = self.total_batch_size
        if total is not None:
            return total
        shard = find_in_chain(self._index_sampler, BatchSamplerShard)  # a SamplerShard's, or of unknown size
        if shard is not None:
            return shard.num_processes
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.num_processes
        return 1

    def _epoch_length(self) -> int:
        return DataLoader.__len__(self)

    def _batches(self, skip: int) -> Iterator[Any]:
        if skip and not reads_through(self):
            return iter(skipping_loader(self, skip))
        return itertools.islice(DataLoader.__iter__(self), skip, None)

    def _even_deal(self) -> tuple[int, int] | None:
        if isinstance(self.dataset, IterableDatasetShard):  # every round topped up, or dropped
            if not self._auto_collation:
                return None
            return self.dataset.num_processes, self.dataset.process_batch_size
        shard = self._shard()
        if shard is None or shard.process_batch_size is None or not (shard.even_batches or shard.drop_last):
            return None
        return shard.num_processes, shard.process_batch_size

    def _final_remainder(self) -> int:
        if isinstance(self.dataset, IterableDatasetShard):
            if not self._auto_collation:
                return -1  # each item is a ready-made batch of unknown size
            # with worker processes the shard iterates in the workers' copies of the dataset
            return self.dataset.remainder if self.num_workers == 0 else self.dataset.remainder_from_length()
        shard = self._shard()
        return -1 if shard is None else shard.remainder
