"""unison: run one ordinary PyTorch training script on one CPU, one GPU, many GPUs or many machines.

The public names follow Hugging Face Accelerate, so a migrated script changes only its import lines
(docs/migrating-from-accelerate.md).

The names load on first use (PEP 562), so `import unison` and the `unison` command's `--help` cost no
torch import; `from unison import Accelerator` imports what it needs then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .accelerate_surface.names import mirror

if TYPE_CHECKING:
    from .accelerator import Accelerator
    from .availability import is_rich_available
    from .big_modeling import init_empty_weights
    from .checkpoint import CheckpointError, ProjectConfiguration
    from .configs import DataLoaderConfiguration, GradientAccumulationPlugin
    from .data import (
        BatchSamplerShard,
        DataLoaderDispatcher,
        DataLoaderShard,
        IterableDatasetShard,
        prepare_data_loader,
        skip_first_batches,
        synchronize_rng_states,
    )
    from .device_memory import find_executable_batch_size
    from .kwargs_handlers import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from .launching.notebook import notebook_launcher
    from .observing.tracking import GeneralTracker, LoggerType
    from .ops import (
        broadcast,
        broadcast_object_list,
        concatenate,
        gather,
        gather_object,
        pad_across_processes,
        reduce,
        send_to_device,
    )
    from .parallel.comm_hooks import DDPCommunicationHookType
    from .parallel.config import ParallelismConfig
    from .plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from .random import set_seed
    from .state import AcceleratorState, DistributedType, GradientState, PartialState

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_EXPORTS = {
    "Accelerator": "accelerator",
    "init_empty_weights": "big_modeling",
    "CheckpointError": "checkpoint",
    "ProjectConfiguration": "checkpoint",
    "DataLoaderConfiguration": "configs",
    "GradientAccumulationPlugin": "configs",
    "BatchSamplerShard": "data",
    "DataLoaderDispatcher": "data",
    "DataLoaderShard": "data",
    "IterableDatasetShard": "data",
    "prepare_data_loader": "data",
    "skip_first_batches": "data",
    "synchronize_rng_states": "data",
    "find_executable_batch_size": "device_memory",
    "is_rich_available": "availability",
    "AutocastKwargs": "kwargs_handlers",
    "DistributedDataParallelKwargs": "kwargs_handlers",
    "GradScalerKwargs": "kwargs_handlers",
    "InitProcessGroupKwargs": "kwargs_handlers",
    "ProfileKwargs": "kwargs_handlers",
    "notebook_launcher": "launching.notebook",
    "GeneralTracker": "observing.tracking",
    "LoggerType": "observing.tracking",
    "broadcast": "ops",
    "broadcast_object_list": "ops",
    "concatenate": "ops",
    "gather": "ops",
    "gather_object": "ops",
    "pad_across_processes": "ops",
    "reduce": "ops",
    "send_to_device": "ops",
    "DDPCommunicationHookType": "parallel.comm_hooks",
    "ParallelismConfig": "parallel.config",
    "DeepSpeedPlugin": "plugins",
    "FullyShardedDataParallelPlugin": "plugins",
    "set_seed": "random",
    "AcceleratorState": "state",
    "DistributedType": "state",
    "GradientState": "state",
    "PartialState": "state",
}


# Accelerate's other top-level names (big-model inference, PiPPy, ...): stand-ins that say why when used
_accelerate_getattr, _accelerate_dir, _ = mirror(__name__, globals(), frozenset(_EXPORTS))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        return _accelerate_getattr(name)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_accelerate_dir()))


__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "BatchSamplerShard",
    "CheckpointError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GeneralTracker",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "InitProcessGroupKwargs",
    "IterableDatasetShard",
    "LoggerType",
    "ParallelismConfig",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "__version__",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "init_empty_weights",
    "is_rich_available",
    "notebook_launcher",
    "pad_across_processes",
    "prepare_data_loader",
    "reduce",
    "send_to_device",
    "set_seed",
    "skip_first_batches",
    "synchronize_rng_states",
]
