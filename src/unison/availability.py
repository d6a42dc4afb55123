"""Accelerate's availability probes (accelerate.utils.is_*_available) that scripts branch on.

Each answers from torch or from whether a package is installed (importlib's find_spec, without
importing it), so a migrated script's `if is_bf16_available(): ...` keeps working unchanged.
"""

from __future__ import annotations

import importlib.util

import torch


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def is_cuda_available() -> bool:
    """Whether torch sees a CUDA (or ROCm) device."""
    return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """Whether this torch is a ROCm build with a device."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS backend is built and has a device (min_version: Accelerate's, always met)."""
    del min_version  # unison needs torch >= 2.12
    return torch.backends.mps.is_built() and torch.backends.mps.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether torch sees an Intel XPU device."""
    del check_device  # torch.xpu.is_available() already asks for a device
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def is_hpu_available() -> bool:
    """Whether Habana's PyTorch bridge is installed and torch sees a Gaudi device."""
    return _installed("habana_frameworks") and hasattr(torch, "hpu") and torch.hpu.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 runs here: the CUDA device supports it, or the computation is on the CPU."""
    del ignore_tpu  # no TPU support in unison
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    """Whether fp16 runs here (everywhere torch runs; fast only on GPUs)."""
    return True


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_pytest_available() -> bool:
    return _installed("pytest")
