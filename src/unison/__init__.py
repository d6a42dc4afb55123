"""unison: run one ordinary PyTorch training script on one CPU, one GPU, many GPUs or many machines.

The public names follow Hugging Face Accelerate, so a script migrates by changing its import line.
"""

from .accelerator import Accelerator
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
)
from .device_memory import find_executable_batch_size
from .kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from .notebook import notebook_launcher
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
from .tracking import GeneralTracker, LoggerType

__version__ = "0.1.0"

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
    "notebook_launcher",
    "pad_across_processes",
    "prepare_data_loader",
    "reduce",
    "send_to_device",
    "set_seed",
    "skip_first_batches",
]
