"""Accelerate's availability probes (accelerate.utils.is_*_available) that scripts branch on.

Each answers truthfully, from torch or from whether a package is installed (importlib's find_spec,
without importing it; a vendor's torch extension is imported only where it is installed), so a migrated
script's `if is_bf16_available(): ...` keeps working unchanged. A probe of something unison does not
use (DeepSpeed, Megatron-LM, an NPU) says whether it is there; `is_npu_available()` is False on a machine
without one. Version checks (`compare_versions`, `is_torch_version`) use the `packaging` rules torch
itself vendors.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import operator
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.torch_version import Version

_Function = TypeVar("_Function", bound=Callable[..., Any])
_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le}
_OPERATIONS["<"] = operator.lt


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """Whether an installed library's version (given by name) or a version compares to the requirement
    as `operation` (`">="`, `"<"`, ...) says, as Accelerate's does."""
    if operation not in _OPERATIONS:
        raise ValueError(
            f"operation={operation!r} is not a comparison: pass one of {sorted(_OPERATIONS)}, e.g. "
            f"compare_versions('torch', '>=', '2.12')."
        )
    if isinstance(library_or_version, str):
        library_or_version = Version(importlib.metadata.version(library_or_version))
    return _OPERATIONS[operation](library_or_version, Version(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Whether the running torch's version compares to `version` as `operation` says."""
    return compare_versions(Version(torch.__version__), operation, version)


def _version_at_least(package: str, minimum: str) -> bool:
    return _installed(package) and compare_versions(package, ">=", minimum)


def _vendor_device(extension: str, backend: str) -> bool:
    """A vendor's device: its torch extension is installed, imports, and torch sees a device."""
    if not _installed(extension):
        return False
    try:
        importlib.import_module(extension)
    except Exception:  # an extension that fails to load (no driver) means no device, as in Accelerate
        return False
    module = getattr(torch, backend, None)
    return module is not None and module.is_available()


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


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether Habana's PyTorch bridge is installed and torch sees a Gaudi device."""
    del init_hccl  # unison does not use HCCL
    return _installed("habana_frameworks") and _vendor_device("habana_frameworks.torch", "hpu")


def is_habana_gaudi1() -> bool:
    """Whether the Gaudi device here is a first-generation one."""
    if not is_hpu_available():
        return False
    experimental = importlib.import_module("habana_frameworks.torch.utils.experimental")
    return experimental._get_device_type() == experimental.synDeviceType.synDeviceGaudi


def is_npu_available(check_device: bool = False) -> bool:
    """Whether Ascend's torch_npu is installed and torch sees an NPU."""
    del check_device  # is_available() already asks for a device
    return _vendor_device("torch_npu", "npu")


def is_mlu_available(check_device: bool = False) -> bool:
    """Whether Cambricon's torch_mlu is installed and torch sees an MLU."""
    del check_device
    return _vendor_device("torch_mlu", "mlu")


def is_musa_available(check_device: bool = False) -> bool:
    """Whether Moore Threads' torch_musa is installed and torch sees a MUSA device."""
    del check_device
    return _vendor_device("torch_musa", "musa")


def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether torch_sdaa is installed and torch sees an SDAA device."""
    del check_device
    return _vendor_device("torch_sdaa", "sdaa")


def is_neuron_available(check_device: bool = False) -> bool:
    """Whether AWS's torch_neuronx is installed and torch sees a Neuron device."""
    del check_device
    return _vendor_device("torch_neuronx", "neuron")


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla is installed (and, when asked, whether its device is a TPU or a GPU)."""
    if not _installed("torch_xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    device_type = importlib.import_module("torch_xla.runtime").device_type()
    return device_type == "TPU" if check_is_tpu else device_type in ("GPU", "CUDA")


def is_xccl_available() -> bool:
    """Whether torch.distributed has Intel's XCCL backend."""
    probe = getattr(torch.distributed.distributed_c10d, "is_xccl_available", None)
    return bool(probe and probe())


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


def is_deepspeed_available() -> bool:
    return _installed("deepspeed")


def is_megatron_lm_available() -> bool:
    return _installed("megatron")


def is_msamp_available() -> bool:
    return _installed("msamp")


def is_transformer_engine_available() -> bool:
    return _installed("transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is installed and says the device runs MXFP8."""
    if not is_transformer_engine_available():
        return False
    return importlib.import_module("transformer_engine.pytorch.fp8").check_mxfp8_support()[0]


def is_torchao_available() -> bool:
    return _version_at_least("torchao", "0.6.1")


def is_fp8_available() -> bool:
    """Whether one of Accelerate's FP8 backends is installed (unison trains in bf16 or fp16, not FP8)."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def torchao_required(function: _Function) -> _Function:
    """Decorates a function that needs torchao: calling it without torchao raises ImportError."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_torchao_available():
            raise ImportError(f"{function.__qualname__} needs torchao >= 0.6.1: pip install torchao")
        return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def is_bnb_available(min_version: str | None = None) -> bool:
    return _version_at_least("bitsandbytes", min_version or "0")


def is_4bit_bnb_available() -> bool:
    return _version_at_least("bitsandbytes", "0.39.0")


def is_8bit_bnb_available() -> bool:
    return _version_at_least("bitsandbytes", "0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    if not is_bnb_available():
        return False
    return "multi_backend" in getattr(importlib.import_module("bitsandbytes"), "features", set())


def is_torchdata_available() -> bool:
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    return _version_at_least("torchdata", "0.8.0")


def is_pippy_available() -> bool:
    """Whether torch has its pipelining package (PiPPy's successor), as Accelerate asks: torch >= 2.4."""
    return is_torch_version(">=", "2.4.0")


def is_weights_only_available() -> bool:
    """Whether torch.load takes weights_only with an allowlist (torch >= 2.4)."""
    return is_torch_version(">=", "2.4.0")


def is_aim_available() -> bool:
    return _installed("aim") and compare_versions("aim", "<", "4.0.0")


def is_trackio_available() -> bool:
    return sys.version_info >= (3, 10) and _installed("trackio")


def is_pynvml_available() -> bool:
    return _installed("pynvml")


def _package_probe(name: str, package: str) -> Callable[[], bool]:
    def probe() -> bool:
        return _installed(package)

    probe.__name__ = probe.__qualname__ = name
    probe.__doc__ = f"Whether {package} is installed (found by importlib, not imported)."
    return probe


is_amdsmi_available = _package_probe("is_amdsmi_available", "amdsmi")
is_boto3_available = _package_probe("is_boto3_available", "boto3")
is_clearml_available = _package_probe("is_clearml_available", "clearml")
is_comet_ml_available = _package_probe("is_comet_ml_available", "comet_ml")
is_dvclive_available = _package_probe("is_dvclive_available", "dvclive")
is_import_timer_available = _package_probe("is_import_timer_available", "import_timer")
is_lomo_available = _package_probe("is_lomo_available", "lomo_optim")
is_matplotlib_available = _package_probe("is_matplotlib_available", "matplotlib")
is_pandas_available = _package_probe("is_pandas_available", "pandas")
is_peft_available = _package_probe("is_peft_available", "peft")
is_rich_available = _package_probe("is_rich_available", "rich")
is_sagemaker_available = _package_probe("is_sagemaker_available", "sagemaker")
is_schedulefree_available = _package_probe("is_schedulefree_available", "schedulefree")
is_swanlab_available = _package_probe("is_swanlab_available", "swanlab")
is_timm_available = _package_probe("is_timm_available", "timm")
is_torchvision_available = _package_probe("is_torchvision_available", "torchvision")
is_triton_available = _package_probe("is_triton_available", "triton")
