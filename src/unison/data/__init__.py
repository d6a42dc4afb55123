"""Data loading across processes: sharded samplers, prepared DataLoaders, dispatching, skipping.

`prepare_data_loader` turns a user's DataLoader into a `DataLoaderShard` (every process reads its
own shard) or a `DataLoaderDispatcher` (process 0 reads and sends each process its piece). The
sharding arithmetic lives in `sharding`, shuffling that agrees across processes in `randomness`.
"""

from .dispatch import DataLoaderDispatcher
from .loader import DataLoaderShard, LoaderProgress, PreparedDataLoader
from .prepare import prepare_data_loader, skip_first_batches
from .randomness import SeedableRandomSampler, synchronize_rng_states
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
