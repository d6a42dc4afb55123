"""Accelerate's DeepSpeedPlugin and a DeepSpeed JSON config, read into a ParallelismConfig.

unison runs the ZeRO stages on torch's own engines (DDP with ZeroRedundancyOptimizer for ZeRO-1,
FSDP2 for ZeRO-2/3), not on DeepSpeed: the plugin and the config's zero_optimization.stage, fp16/bf16
and gradient_accumulation_steps sections choose the layout, precision and accumulation. Sections that
would configure DeepSpeed's own engine (its optimizer, scheduler, offload) are refused by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..parallel.config import ParallelismConfig
from .layout import PluginLayout, unsupported

# zero_optimization keys that tune DeepSpeed's own buffers and communication: no effect under FSDP2
_DEEPSPEED_TUNING_KEYS = {
    "stage",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "reduce_scatter",
    "reduce_bucket_size",
    "contiguous_gradients",
    "round_robin_gradients",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "ignore_unused_parameters",
}
# top-level DeepSpeed keys read here or harmless; any other is refused by name
_DEEPSPEED_KEYS = {
    "zero_optimization",
    "fp16",
    "bf16",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "communication_data_type",
}


@dataclass
class DeepSpeedPlugin:
    """Accelerate's DeepSpeed plugin, with its field names, read into a ParallelismConfig.

    zero_stage 0 -> DDP, 1/2/3 -> ZeRO-1/2/3 on torch's engines (ZeroRedundancyOptimizer, FSDP2);
    None takes the DeepSpeed config's zero_optimization.stage, else 2 (Accelerate's default).
    hf_ds_config (a dict or a JSON file's path): zero_optimization.stage, fp16/bf16.enabled (mixed
    precision), gradient_accumulation_steps; "auto" values are left to the Accelerator's arguments.
    zero_optimization keys that tune DeepSpeed's own buffers (bucket sizes, overlap_comm,
    contiguous_gradients, stage3_* thresholds) are accepted without effect. Refused with a message:
    offload of optimizer or parameters, zero3_init_flag, optimizer/scheduler sections (unison steps the
    torch optimizer you prepare), a numeric gradient_clipping or batch size (call clip_grad_norm_; set the
    DataLoader's batch_size), MoE and MS-AMP options, and any key not listed here.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None

    def layout(self, processes_per_node: int) -> PluginLayout:
        del processes_per_node  # ZeRO shards over every process
        plugin = "DeepSpeedPlugin"
        for option in ("offload_optimizer_device", "offload_param_device"):
            value = getattr(self, option)
            if value not in (None, "none", "None"):
                raise unsupported(
                    plugin,
                    option,
                    value,
                    "Leave it 'none': ZeRO state stays on the device "
                    "(CPU offload comes with FSDP2's CPUOffloadPolicy in a later version).",
                )
        refused = {
            "zero3_init_flag": (
                self.zero3_init_flag,
                "Leave it unset: every process builds the whole model.",
            ),
            "transformer_moe_cls_names": (self.transformer_moe_cls_names, "Leave it unset."),
            "enable_msamp": (self.enable_msamp, "Leave it unset."),
            "gradient_clipping": (
                self.gradient_clipping,
                "Call accelerator.clip_grad_norm_(params, max_norm) in the loop instead.",
            ),
        }
        for option, (value, advice) in refused.items():
            if value not in (None, False, "auto"):
                raise unsupported(plugin, option, value, advice)
        config = self._config()
        stage = self.zero_stage
        file_stage = config.get("zero_optimization", {}).get("stage")
        if stage is not None and file_stage not in (None, "auto") and int(file_stage) != int(stage):
            raise ValueError(
                f"DeepSpeedPlugin(zero_stage={stage}) and its config's zero_optimization.stage={file_stage} "
                "disagree: give one of them."
            )
        if stage is None:
            stage = 2 if file_stage in (None, "auto") else int(file_stage)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"DeepSpeedPlugin: ZeRO stage {stage!r} does not exist: give 0, 1, 2 or 3.")
        parallelism = ParallelismConfig(zero_stage=stage) if stage else ParallelismConfig()
        return PluginLayout(parallelism, _config_precision(config), self._accumulation(config))

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed config as Accelerate's plugin exposes it: the hf_ds_config given (a copy), else
        the one Accelerate builds from the fields. Scripts read it, e.g. transformers' no_trainer
        examples choose their optimizer by `"optimizer" in plugin.deepspeed_config` (never here: unison
        refuses that section and steps the torch optimizer you prepare)."""
        if self.hf_ds_config is not None:
            return json.loads(json.dumps(self._config()))
        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps or 1,
            "zero_optimization": {
                "stage": 2 if self.zero_stage is None else self.zero_stage,
                "offload_optimizer": {"device": self.offload_optimizer_device or "none"},
                "offload_param": {"device": self.offload_param_device or "none"},
                "stage3_gather_16bit_weights_on_model_save": bool(self.zero3_save_16bit_model),
            },
        }
        if self.gradient_clipping:
            config["gradient_clipping"] = self.gradient_clipping
        return config

    def _config(self) -> dict[str, Any]:
        source = self.hf_ds_config
        if source is None:
            return {}
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            if not path.is_file():
                raise ValueError(f"DeepSpeedPlugin(hf_ds_config={str(source)!r}): no such file.")
            source = json.loads(path.read_text())
        if not isinstance(source, dict):
            raise TypeError(
                "DeepSpeedPlugin(hf_ds_config=...) takes a dict or a JSON file's path, got a "
                f"{type(source).__name__}."
            )
        _check_deepspeed_config(source)
        return source

    def _accumulation(self, config: dict[str, Any]) -> int | None:
        values = [
            v
            for v in (self.gradient_accumulation_steps, config.get("gradient_accumulation_steps"))
            if v not in (None, "auto")
        ]
        if len(values) == 2 and int(values[0]) != int(values[1]):
            raise ValueError(
                f"DeepSpeedPlugin(gradient_accumulation_steps={values[0]}) and its config's "
                f"gradient_accumulation_steps={values[1]} disagree: give one of them."
            )
        return int(values[0]) if values else None


def _check_deepspeed_config(config: dict[str, Any]) -> None:
    unknown = sorted(set(config) - _DEEPSPEED_KEYS)
    if unknown:
        raise ValueError(
            f"DeepSpeedPlugin(hf_ds_config=...): unison does not carry out the config's sections {unknown}, "
            "so they cannot be honoured and are not ignored silently. Remove them (for an optimizer or "
            "scheduler section: build the torch optimizer/scheduler yourself and prepare() it)."
        )
    zero = config.get("zero_optimization", {})
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in ("none", None):
            raise unsupported(
                "DeepSpeedPlugin",
                f"zero_optimization.{key}.device",
                device,
                "Set it to 'none' or remove the section.",
            )
    unknown_zero = sorted(set(zero) - _DEEPSPEED_TUNING_KEYS - {"offload_optimizer", "offload_param"})
    if unknown_zero:
        raise unsupported(
            "DeepSpeedPlugin",
            "zero_optimization",
            unknown_zero,
            "Remove these keys: unison does not know what they would ask of FSDP2.",
        )
    for key in ("gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu"):
        if config.get(key) not in (None, "auto"):
            raise unsupported(
                "DeepSpeedPlugin",
                f"hf_ds_config[{key!r}]",
                config[key],
                "Use 'auto': set the DataLoader's batch_size and call accelerator.clip_grad_norm_.",
            )


def _config_precision(config: dict[str, Any]) -> str | None:
    enabled = [name for name in ("fp16", "bf16") if _enabled(config.get(name))]
    if len(enabled) == 2:
        raise ValueError("DeepSpeedPlugin: its config enables both fp16 and bf16; enable one of them.")
    return enabled[0] if enabled else None


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") not in (None, False, "auto", "false")
