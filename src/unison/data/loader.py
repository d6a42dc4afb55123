"""Prepared data loaders: real DataLoader subclasses that know where they stand in the epoch.

A prepared loader reads one batch ahead, so while the training loop processes the last batch of the
epoch `end_of_dataloader` is already True: the Accelerator forces the gradient synchronisation on
it, and gather_for_metrics drops the samples that topped up the final round (`remainder`). While it
is being iterated the loader registers itself in GradientState, which is how the Accelerator finds
it. The epoch counter lives with the loader: each pass first hands the epoch to the sampler and
the dataset (so every process shuffles alike) and a complete pass advances it, so a script that
never calls set_epoch still gets a new order every epoch.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from .. import ops
from ..state import GradientState
from .randomness import check_rng_types, synchronize_rng_states
from .sharding import BatchSamplerShard, IterableDatasetShard, SamplerShard

_END = object()

# DataLoader settings a re-created loader carries over unchanged (those this torch version has)
CARRIED_SETTINGS = [
    name
    for name in (
        "num_workers",
        "collate_fn",
        "pin_memory",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    )
    if name in inspect.signature(DataLoader.__init__).parameters
]


def carried_settings(dataloader: DataLoader) -> dict[str, Any]:
    return {name: getattr(dataloader, name) for name in CARRIED_SETTINGS if hasattr(dataloader, name)}


@dataclass
class LoaderProgress:
    """Where a prepared loader stands; shared with the loaders skip_first_batches derives from it,
    so finishing a resumed epoch advances the original loader too."""

    epoch: int = 0


def find_in_chain(root: Any, kind: type) -> Any | None:
    """The first object of type `kind` among root and the samplers it wraps (.batch_sampler/.sampler)."""
    for sampler in _sampler_chain(root):
        if isinstance(sampler, kind):
            return sampler
    return None


def _sampler_chain(root: Any) -> Iterator[Any]:
    seen: set[int] = set()
    pending = [root]
    while pending:
        sampler = pending.pop(0)
        if sampler is None or id(sampler) in seen:
            continue
        seen.add(id(sampler))
        yield sampler
        pending += [getattr(sampler, "batch_sampler", None), getattr(sampler, "sampler", None)]


class PreparedDataLoader(DataLoader):
    """What DataLoaderShard and DataLoaderDispatcher share: look-ahead, epochs, device placement.

    Subclasses provide `_batches(skip)`, this process's batches on the host, and
    `_final_remainder()`, read once the last batch is known.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        device: torch.device | str | None = None,
        non_blocking: bool = False,
        rng_types: Sequence[str] | None = None,
        skip_batches: int = 0,
        progress: LoaderProgress | None = None,
        **loader_kwargs: Any,
    ):
        self._init_kwargs = dict(
            dataset=dataset,
            device=device,
            non_blocking=non_blocking,
            rng_types=rng_types,
            skip_batches=skip_batches,
            **loader_kwargs,
        )
        super().__init__(dataset, **loader_kwargs)
        self.device = None if device is None else torch.device(device)
        self.non_blocking = non_blocking
        self.rng_types = check_rng_types(rng_types)
        self.skip_batches = skip_batches
        self.progress = progress if progress is not None else LoaderProgress()
        self.gradient_state = GradientState()
        self.end_of_dataloader = False
        self.remainder = -1

    def _clone(self, **overrides: Any) -> PreparedDataLoader:
        """A loader like this one (same kind, same arguments, same progress) with some arguments changed."""
        return type(self)(**{**self._init_kwargs, "progress": self.progress, **overrides})

    # torch's DataLoader stores batch_size=None whenever a batch sampler is given; a prepared loader
    # reports the batch size each process actually receives.
    @property
    def batch_size(self) -> int | None:
        return self._process_batch_size()

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:  # called once, by DataLoader.__init__
        self._loader_batch_size = value

    def _process_batch_size(self) -> int | None:
        return self._loader_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the current (or next) pass uses; advanced by one after each complete pass."""
        return self.progress.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.progress.epoch = int(value)

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch` for the next pass, and tell the samplers and the dataset (their set_epoch)."""
        self.epoch = epoch
        for sampler in _sampler_chain(self._index_sampler):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _batches(self, skip: int) -> Iterator[Any]:
        raise NotImplementedError

    def _final_remainder(self) -> int:
        raise NotImplementedError

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return ops.send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip_batches = self.skip_batches, 0
        self.set_epoch(self.epoch)
        synchronize_rng_states(self.rng_types, self.generator)
        self.end_of_dataloader = False
        self.remainder = -1
        self.gradient_state._add_dataloader(self)
        try:
            batches = self._batches(skip)
            current = next(batches, _END)
            while current is not _END:
                current = self._place(current)
                upcoming = next(batches, _END)  # read ahead: is `current` the last batch?
                if upcoming is _END:
                    self.remainder = self._final_remainder()
                    self.end_of_dataloader = True
                yield current
                current = upcoming
            self.epoch += 1
        finally:
            self.gradient_state._remove_dataloader(self)


class DataLoaderShard(PreparedDataLoader):
    """A DataLoader that yields this process's shard of every epoch, on `device`.

    Built by prepare_data_loader from the user's loader: same dataset, collate_fn, workers and
    other settings, with a BatchSamplerShard (map-style data) or an IterableDatasetShard (iterable
    data) deciding which samples this process reads.
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device | str | None = None,
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

    def _batches(self, skip: int) -> Iterator[Any]:
        return itertools.islice(DataLoader.__iter__(self), skip, None)

    def _final_remainder(self) -> int:
        if isinstance(self.dataset, IterableDatasetShard):
            if not self._auto_collation:
                return -1  # each item is a ready-made batch of unknown size
            # with worker processes the shard iterates in the workers' copies of the dataset
            return self.dataset.remainder if self.num_workers == 0 else self.dataset.remainder_from_length()
        shard = self._shard()
        return -1 if shard is None else shard.remainder
