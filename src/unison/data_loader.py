"""Accelerate's `accelerate.data_loader` names, for scripts that import from it: `from
accelerate.data_loader import DataLoaderShard` becomes `from unison.data_loader import DataLoaderShard`.

Re-exports only: the loaders live in `unison.data`. Its other names (Accelerate's internal adapters,
probes, `SkipDataLoader`) import too, through accelerate_surface/names.py: probes answer, the rest raise
when used with why and what to use instead.
"""

from .data import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    prepare_data_loader,
    skip_first_batches,
    synchronize_rng_states,
)
from .logging import get_logger
from .ops import broadcast, broadcast_object_list, concatenate, send_to_device
from .state import DistributedType, GradientState, PartialState

from .accelerate_surface.names import mirror  # isort: skip (after the imports: it serves what they do not)

__getattr__, __dir__, _more_names = mirror(__name__, globals())

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DistributedType",
    "GradientState",
    "IterableDatasetShard",
    "PartialState",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "get_logger",
    "prepare_data_loader",
    "send_to_device",
    "skip_first_batches",
    "synchronize_rng_states",
] + _more_names
