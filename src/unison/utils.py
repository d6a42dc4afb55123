"""What scripts import from `accelerate.utils`, under the same names: `from accelerate.utils import X`
becomes `from unison.utils import X`. Re-exports only; each name lives in the module that owns it.

Every other public name of `accelerate.utils` imports too (accelerate_surface/names.py): the probes and
constants work, and a name with no meaning in unison raises, when used, why and what to do instead.
`__all__` (and so `import *`) holds the working names."""

from .availability import (
    is_bf16_available,
    is_cuda_available,
    is_datasets_available,
    is_fp16_available,
    is_hpu_available,
    is_mlflow_available,
    is_mps_available,
    is_pytest_available,
    is_rocm_available,
    is_tensorboard_available,
    is_transformers_available,
    is_wandb_available,
    is_xpu_available,
)
from .checkpoint import ProjectConfiguration
from .configs import DataLoaderConfiguration, GradientAccumulationPlugin
from .data.randomness import synchronize_rng_states
from .device_memory import find_executable_batch_size, release_memory
from .kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
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
from .parallel.compiling import TorchDynamoPlugin
from .parallel.config import ParallelismConfig
from .plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from .random import set_seed
from .state import DistributedType, wait_for_everyone

from .accelerate_surface.names import mirror  # isort: skip (after the imports: it serves what they do not)

__getattr__, __dir__, _more_names = mirror(__name__, globals())

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GeneralTracker",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "LoggerType",
    "ParallelismConfig",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "is_bf16_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_fp16_available",
    "is_hpu_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_pytest_available",
    "is_rocm_available",
    "is_tensorboard_available",
    "is_transformers_available",
    "is_wandb_available",
    "is_xpu_available",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "synchronize_rng_states",
    "wait_for_everyone",
] + _more_names
