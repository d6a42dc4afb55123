"""unison: run one ordinary PyTorch training script on one CPU, one GPU, many GPUs or many machines."""

from .state import AcceleratorState, DistributedType, GradientState, PartialState

__version__ = "0.1.0"

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState", "__version__"]
