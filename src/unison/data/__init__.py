"""Data loading across processes: sharded samplers, prepared DataLoaders, dispatching, skipping.

`prepare_data_loader` turns a user's DataLoader into a `DataLoaderShard` (every process reads its
own shard, `shard`) or a `DataLoaderDispatcher` (process 0 reads and sends each process its piece,
`dispatch`); what both share (look-ahead, epochs, position, resume) is `loader`. The sharding arithmetic
lives in `sharding`; shuffling that agrees across processes in `torch_order` and `randomness`, and
samplers of the user's own in `replay`.
"""

from .dispatch import DataLoaderDispatcher
from .loader import LoaderProgress, PreparedDataLoader
from .prepare import prepare_data_loader, skip_first_batches
from .randomness import SeedableRandomSampler, synchronize_rng_states
from .shard import DataLoaderShard
from .sharding import BatchSamplerShard, IterableDatasetShard, SamplerShard, SkipBatchSampler

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "LoaderProgress",
    "PreparedDataLoader",
    "SamplerShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "prepare_data_loader",
    "skip_first_batches",
    "synchronize_rng_states",
]
