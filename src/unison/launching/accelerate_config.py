"""An Accelerate `default_config.yaml`, given explicitly (`unison launch --config FILE.yaml`), read into
unison's launch settings.

Only an explicit path is read: Accelerate's hidden ~/.cache/huggingface/accelerate file is never looked
for. Keys unison carries out are mapped onto the launch flags they correspond to (the FSDP and DeepSpeed
sections onto the same settings `--use_fsdp` / `--use_deepspeed` and their flags give). Keys that change
nothing here (where the job runs, TPU settings, ...) are named in warnings; keys whose numbers or layout
unison cannot reproduce (FP8, Megatron-LM, TPUs) are errors, since training without them would silently
be a different run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ConfigError
from .plugin_flags import DEEPSPEED_FLAGS, FSDP_FLAGS

_DATA_PARALLEL = {"NO", "MULTI_GPU", "MULTI_CPU"}  # DDP, or one process: unison's default layout

_HARMLESS = {
    "compute_environment": "where Accelerate runs the job; unison launches on this machine",
    "downcast_bf16": "applies to TPUs only",
    "main_training_function": "used by Accelerate's notebook/TPU launcher only",
    "same_network": "unison's nodes always reach each other through the rendezvous address",
    "enable_cpu_affinity": "unison sets OMP_NUM_THREADS per process instead of pinning cores",
    "gpu_ids": "export CUDA_VISIBLE_DEVICES to choose GPUs",
    "use_ipex": "Intel Extension for PyTorch is not used",
    "ipex_config": "Intel Extension for PyTorch is not used",
    "mpirun_config": "unison launches through torch's elastic launcher, not mpirun",
    "commands": "Accelerate's cluster commands",
    "command_file": "Accelerate's cluster commands",
    "deepspeed_multinode_launcher": "unison's launcher starts every node",
    "zero3_save_16bit_model": "save a full state dict with accelerator.save_model",
    "dynamo_use_fullgraph": "the model is compiled block by block",
    "dynamo_use_dynamic": "torch.compile decides dynamic shapes itself",
    "dynamo_use_regional_compilation": "the model is always compiled block by block",
    "fsdp_offload_params_device": "offloading goes to the CPU",
}
_NO_OP = {  # the values `accelerate config` writes that ask for nothing: not worth a warning
    "compute_environment": "LOCAL_MACHINE",
    "downcast_bf16": "no",
    "main_training_function": "main",
    "same_network": True,
    "enable_cpu_affinity": False,
    "gpu_ids": "all",
    "use_ipex": False,
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "deepspeed_multinode_launcher": "standard",
    "dynamo_use_fullgraph": False,
    "dynamo_use_dynamic": False,
    "dynamo_use_regional_compilation": False,
    "fsdp_cpu_ram_efficient_loading": False,
    "fsdp_use_orig_params": True,
    "zero3_init_flag": False,
}
_LOADING_ONLY = {  # refused as flags, but they only change how the model is built: same numbers without
    "fsdp_cpu_ram_efficient_loading": "every process builds the model: more host memory, same numbers",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters: same numbers",
    "zero3_init_flag": "every process builds the whole model: more host memory, same numbers",
}
_REFUSED = {
    "fp8_config": "FP8 training changes the numerics and unison has no FP8 path",
    "megatron_lm_config": "Megatron-LM is not supported: use --parallelism tp_size=..,pp_size=..",
}


class AccelerateConfigError(ConfigError):
    """The Accelerate config asks for something unison cannot do, or is not an Accelerate config."""


def read_accelerate_yaml(path: Path) -> tuple[dict[str, Any], list[str]]:
    """(unison settings, warning lines naming each unused key and why) from an Accelerate YAML file."""
    try:
        import yaml
    except ModuleNotFoundError:
        raise AccelerateConfigError(
            f"--config {path} is YAML (an Accelerate config), and reading YAML needs PyYAML, which is not "
            "installed: pip install 'unison[config]'."
        ) from None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise AccelerateConfigError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise AccelerateConfigError(f"{path} holds no mapping of Accelerate settings (`key: value` lines).")
    return map_accelerate(data, str(path))


def map_accelerate(data: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """The mapping itself (see read_accelerate_yaml); `where` names the file in messages."""
    values: dict[str, Any] = {}
    warnings: list[str] = []
    data = {key: value for key, value in data.items() if not _says_nothing(key, value)}
    for key, why in _REFUSED.items():
        if key in data:
            raise AccelerateConfigError(f"{where}: {key}: {why}. Remove it to train without it.")
    machines = int(data.pop("num_machines", 1))
    rank = data.pop("machine_rank", 0)
    address, port = data.pop("main_process_ip", None), data.pop("main_process_port", None)
    backend = str(data.pop("rdzv_backend", "static")).lower()
    if machines > 1:
        values["nnodes"] = machines
        if backend == "static":
            values.update(node_rank=rank, master_addr=address, master_port=port)
        elif address and port:  # c10d / etcd: one endpoint, ranks by arrival
            values["rdzv_endpoint"] = f"{address}:{port}"
    elif port is not None:
        warnings.append(f"main_process_port: {port} (one node's rendezvous uses a free loopback port)")
    if "num_processes" in data:  # Accelerate counts every machine's processes together, as unison's flag
        values["num_processes"] = int(data.pop("num_processes"))
    if "use_cpu" in data:
        values["cpu"] = bool(data.pop("use_cpu"))
    if "debug" in data:
        values["debug"] = bool(data.pop("debug"))
    _map_precision(data.pop("mixed_precision", None), values, where)
    if "gradient_accumulation_steps" in data:
        values["gradient_accumulation_steps"] = int(data.pop("gradient_accumulation_steps"))
    _map_dynamo(data.pop("dynamo_config", {}), data.pop("dynamo_backend", None), values, warnings)
    _map_layout(data, values, warnings, where)
    for key in sorted(data):
        why = _HARMLESS.get(key) or (
            "TPUs are not supported" if key.startswith("tpu_") else "not read by unison"
        )
        warnings.append(f"{key}: {data[key]} ({why})")
    return {key: value for key, value in values.items() if value is not None}, warnings


def _says_nothing(key: str, value: Any) -> bool:
    if value is None or value == {} or value == []:
        return True
    return key in _NO_OP and _NO_OP[key] in (value, _unquoted_no(value))


def _unquoted_no(value: Any) -> Any:
    """YAML 1.1 reads an unquoted `no` as False: `mixed_precision: no` means "no", not "false"."""
    return "no" if value is False else value


def _map_precision(value: Any, values: dict[str, Any], where: str) -> None:
    if value is None:
        return
    precision = str(_unquoted_no(value)).lower()
    if precision == "fp8":
        raise AccelerateConfigError(
            f"{where}: mixed_precision: fp8 changes the numerics and unison has no FP8 path. Use bf16."
        )
    values["mixed_precision"] = precision


def _map_dynamo(config: dict[str, Any], backend: Any, values: dict[str, Any], warnings: list[str]) -> None:
    config = {key: value for key, value in config.items() if not _says_nothing(key, value)}
    backend = config.pop("dynamo_backend", backend)
    if backend is not None and str(_unquoted_no(backend)).lower() != "no":
        values["dynamo_backend"] = str(backend).lower()
    if "dynamo_mode" in config:
        values["dynamo_mode"] = str(config.pop("dynamo_mode"))
    warnings.extend(
        f"dynamo_config.{key}: {value} ({_HARMLESS.get(key, 'not read by unison')})"
        for key, value in config.items()
    )


def _map_layout(data: dict[str, Any], values: dict[str, Any], warnings: list[str], where: str) -> None:
    """distributed_type and its fsdp_config / deepspeed_config, as --use_fsdp / --use_deepspeed flags."""
    kind = str(data.pop("distributed_type", "NO")).upper()
    fsdp, deepspeed = data.pop("fsdp_config", {}), data.pop("deepspeed_config", {})
    if kind in _DATA_PARALLEL:
        return
    if kind == "FSDP":
        values["use_fsdp"] = True
        _plugin_fields(fsdp, FSDP_FLAGS, "fsdp_config", values, warnings)
    elif kind == "DEEPSPEED":
        values["use_deepspeed"] = True
        deepspeed = dict(deepspeed)
        if "gradient_accumulation_steps" in deepspeed:
            values.setdefault(
                "gradient_accumulation_steps", int(deepspeed.pop("gradient_accumulation_steps"))
            )
        _plugin_fields(deepspeed, DEEPSPEED_FLAGS, "deepspeed_config", values, warnings)
    else:
        raise AccelerateConfigError(
            f"{where}: distributed_type: {kind} is not something unison runs (it runs NO, MULTI_GPU, "
            "MULTI_CPU, FSDP and DEEPSPEED). Pick one of those, or launch this config with accelerate."
        )


def _plugin_fields(
    section: dict[str, Any],
    flags: dict[str, tuple[str, Any]],
    name: str,
    values: dict[str, Any],
    warnings: list[str],
) -> None:
    for key, value in section.items():
        if _says_nothing(key, value):
            continue
        if key not in flags or key in _LOADING_ONLY:
            why = _LOADING_ONLY.get(key) or _HARMLESS.get(key, "not read by unison")
            warnings.append(f"{name}.{key}: {value} ({why})")
        elif flags[key][1] == "bool":
            values[key] = value if isinstance(value, bool) else str(value).lower() in ("true", "1", "yes")
        else:
            values[key] = flags[key][1](value)
