"""prepare_data_loader: re-create the user's DataLoader as a DataLoaderShard or DataLoaderDispatcher.

The new loader keeps everything the user chose (dataset, collate_fn, workers, pinning, generator,
...) and changes only who reads what: a sharded batch sampler for map-style data, a shard of the
stream for iterable data, or process 0 dispatching (the default for iterable data, which cannot be
split by index). A torch RandomSampler draws each pass's order as plain PyTorch does, from process 0's
generator states (torch_order), or, with use_seedable_sampler, from (seed, epoch) (randomness). A
sampler of the user's own keeps its order and is wrapped so that a resumed pass replays its draws
(replay).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from ..state import PartialState
from .dispatch import DataLoaderDispatcher
from .loader import PreparedDataLoader, carried_settings, skipping_loader
from .randomness import check_rng_types, with_replaced_shuffle, with_seedable_sampler
from .replay import with_replayed_sampler
from .shard import DataLoaderShard
from .sharding import (
    BatchSamplerShard,
    IterableDatasetShard,
    SamplerShard,
    check_process_index,
    check_split,
)
from .torch_order import TorchOrderRandomSampler, draw_int64

logger = logging.getLogger("unison")


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | str | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Sequence[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    non_blocking: bool | None = None,
    data_seed: int | None = None,
    use_seedable_sampler: bool = False,
    shuffle_seeded_at_prepare: bool = False,
) -> DataLoaderShard | DataLoaderDispatcher:
    """A DataLoaderShard (each process reads its shard) or DataLoaderDispatcher (process 0 reads).

    num_processes / process_index default to PartialState's. dispatch_batches defaults to True for an
    IterableDataset with more than one process. put_on_device moves every batch to `device`
    (default: the process's device); see `host_to_device_copies` for pinning and non_blocking.
    The order is the user's loader's: each pass draws as plain PyTorch does, from process 0's generator
    states (see torch_order). use_seedable_sampler=True, or a data_seed, makes each epoch's order a
    function of (seed, epoch) instead (see randomness): data_seed is that seed (default: the loader's
    generator's seed, else torch's initial seed, which set_seed sets); process 0's value is used
    everywhere.
    shuffle_seeded_at_prepare=True gives Accelerate's order on several processes (what
    numerics="accelerate" asks for): a shuffle with no generator of its own gets one here, seeded by one
    draw of the global RNG, and every pass draws its permutation from it (process 0's state), where
    plain PyTorch draws a fresh seed at each pass. Accelerate does so for map-style data read in shards
    by more than one process; on one process, or with use_seedable_sampler, it changes nothing.
    With split_batches, a batch size that is not a multiple of num_processes is a ValueError, raised
    on every process since every process prepares the same loader; so is even_batches=False for an
    IterableDataset read in shards, which always evens its last round.
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"prepare_data_loader needs a torch.utils.data.DataLoader, got a {type(dataloader).__name__}: "
            "wrap your dataset in DataLoader(dataset, batch_size=...) first."
        )
    if isinstance(dataloader, PreparedDataLoader):
        raise ValueError(
            f"this {type(dataloader).__name__} is already prepared: preparing it again would shard the "
            "shards. Pass the DataLoader you built, once, and use the loader prepare returned."
        )
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    check_process_index(num_processes, process_index)
    device = state.device if device is None else torch.device(device)
    iterable = isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches is None:
        dispatch_batches = iterable and num_processes > 1
    seedable = use_seedable_sampler or data_seed is not None
    pin_memory, non_blocking = host_to_device_copies(
        device, dataloader.pin_memory, put_on_device, non_blocking
    )
    common: dict[str, Any] = {
        **carried_settings(dataloader),
        "device": device if put_on_device else None,
        "non_blocking": non_blocking,
        "rng_types": check_rng_types(rng_types),
        "use_seedable_sampler": seedable,
        "pin_memory": pin_memory,
    }
    dataset = dataloader.dataset
    seeded_at_prepare = shuffle_seeded_at_prepare and num_processes > 1 and not dispatch_batches
    batching = _batching(dataloader, seedable, data_seed, seeded_at_prepare, dispatch_batches)

    if dispatch_batches:
        if (num_processes, process_index) != (state.num_processes, state.process_index):
            raise ValueError(
                f"dispatch_batches=True sends batches through the real process group ({state.num_processes} "
                f"processes, this one {state.process_index}), but num_processes={num_processes} and "
                f"process_index={process_index} were asked for. Leave them unset, or pass "
                "dispatch_batches=False."
            )
        return DataLoaderDispatcher(
            dataset, split_batches=split_batches, even_batches=even_batches, **batching, **common
        )
    if iterable:
        if num_processes > 1:
            if not even_batches:
                raise ValueError(
                    "even_batches=False cannot apply to an IterableDataset read in shards: every process "
                    "reads the stream and takes its slice of each round, and the last round is topped up "
                    "from the stream's start (unless drop_last) because no process knows the length "
                    "ahead. Leave even_batches=True (gather_for_metrics drops the top-up), set "
                    "drop_last=True, or dispatch_batches=True to have process 0 read and send batches."
                )
            if split_batches:
                check_split(dataloader.batch_size, num_processes)
            dataset = IterableDatasetShard(
                dataset,
                dataloader.batch_size or 1,
                dataloader.drop_last,
                num_processes,
                process_index,
                split_batches,
            )
            if dataloader.batch_size is not None:
                batching["batch_size"] = dataset.process_batch_size
        return DataLoaderShard(dataset, **batching, **common)
    if num_processes > 1:
        batching = _sharded(batching, num_processes, process_index, split_batches, even_batches)
    return DataLoaderShard(dataset, **batching, **common)


def _batching(
    dataloader: DataLoader, seedable: bool, data_seed: int | None, seeded_at_prepare: bool, dispatched: bool
) -> dict[str, Any]:
    """The loader's index sampling as DataLoader arguments, its shuffle one that processes agree on
    (under dispatch_batches only process 0 draws a sampler of the user's own: no agreement)."""
    if isinstance(dataloader.dataset, IterableDataset):
        return {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last}

    def torch_order(shuffle: RandomSampler) -> TorchOrderRandomSampler:
        replaced = TorchOrderRandomSampler(shuffle)
        if seeded_at_prepare and replaced.generator is None:
            # Accelerate's prepare_data_loader: one global draw seeds the generator of every pass
            replaced.generator = torch.Generator().manual_seed(draw_int64(torch.default_generator))
        return replaced

    def agreed(sampler: Any) -> Any:
        if seedable:
            return with_seedable_sampler(sampler, data_seed)
        return with_replaced_shuffle(sampler, torch_order)

    if dataloader.batch_sampler is not None:
        batch_sampler = agreed(dataloader.batch_sampler)
        return {"batch_sampler": with_replayed_sampler(batch_sampler, batches=True, agree=not dispatched)}
    sampler = with_replayed_sampler(agreed(dataloader.sampler), batches=False, agree=not dispatched)
    return {"sampler": sampler, "batch_size": None}


def _sharded(
    batching: dict[str, Any], num_processes: int, process_index: int, split_batches: bool, even_batches: bool
) -> dict[str, Any]:
    if "batch_sampler" in batching:
        shard = BatchSamplerShard(
            batching["batch_sampler"], num_processes, process_index, split_batches, even_batches
        )
        return {"batch_sampler": shard}
    sampler = batching["sampler"]
    if isinstance(sampler, BatchSampler):  # batch_size=None with a batch sampler as sampler: dataset[list]
        shard = BatchSamplerShard(sampler, num_processes, process_index, split_batches, even_batches)
    elif split_batches:
        raise ValueError(
            "split_batches=True cannot cut the ready-made batches of a DataLoader with batch_size=None: "
            "give the DataLoader a batch_size, or use split_batches=False."
        )
    else:
        shard = SamplerShard(sampler, num_processes, process_index, even_batches)
    return {"sampler": shard, "batch_size": None}


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader like `dataloader` whose next pass skips its first `num_batches` batches.

    For map-style data the skip happens in the sampler, so the skipped batches are never loaded
    (an iterable stream has to be read through). Later passes are complete. A prepared loader's
    copy shares its progress, so finishing the resumed epoch moves the original on too. (After
    Accelerator.load_state a prepared loader resumes by itself: see PreparedDataLoader.load_state_dict.)
    """
    if num_batches < 0:
        raise ValueError(f"num_batches={num_batches} is negative: pass how many batches to skip, >= 0.")
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader._clone(skip_batches=num_batches)
    if isinstance(dataloader.dataset, IterableDataset):
        raise TypeError(
            "skip_first_batches on a plain DataLoader over an IterableDataset cannot skip without reading: "
            "prepare the loader first (prepare_data_loader / Accelerator.prepare) and skip on the result."
        )
    return skipping_loader(dataloader, num_batches)


def host_to_device_copies(
    device: torch.device, loader_pins: bool, put_on_device: bool, non_blocking: bool | None
) -> tuple[bool, bool]:
    """(pin_memory, non_blocking) of a prepared loader's batches: DataLoaderConfiguration.non_blocking
    None means True when the batches are put on a GPU, and a non-blocking copy needs a pinned source
    (from pageable memory CUDA copies synchronously whatever the flag says), so the loader then pins.
    On any other device both are False: pinned memory serves only host-to-GPU copies, and torch warns
    about pin_memory without an accelerator."""
    if device.type != "cuda":
        return False, False
    if non_blocking is None:
        non_blocking = put_on_device
    return loader_pins or (put_on_device and non_blocking), non_blocking
