"""Accelerate's FullyShardedDataParallelPlugin, read into a ParallelismConfig.

unison runs FSDP (versions 1 and 2 alike) on FSDP2's fully_shard, so the plugin is not an engine's
configuration here but a description of a layout: its sharding strategy becomes a ZeRO stage, hybrid
sharding a dp_shard x dp_replicate mesh, transformer-based wrapping the blocks ZeRO shards one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..parallel.config import ParallelismConfig
from .layout import PluginLayout, enum_name, unsupported

_FSDP_STRATEGIES = {
    "FULL_SHARD": 3,
    "SHARD_GRAD_OP": 2,
    "NO_SHARD": 0,
    "HYBRID_SHARD": 3,
    "_HYBRID_SHARD_ZERO2": 2,
    "HYBRID_SHARD_ZERO2": 2,
}
# Accelerate's FSDP1 spelling of reshard_after_forward
_RESHARD_NAMES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_RESHARD": 2}
_FSDP_STRATEGY_NUMBERS = {
    1: "FULL_SHARD",
    2: "SHARD_GRAD_OP",
    3: "NO_SHARD",
    4: "HYBRID_SHARD",
    5: "_HYBRID_SHARD_ZERO2",
}
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "NO_WRAP")
_PRECISION_OF_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "no", None: "no"}
_PRECISION_NAMES = {"bf16": "bf16", "fp16": "fp16", "no": "no", "fp32": "no"}


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP plugin, with its field names, read into a ParallelismConfig (see `layout`).

    sharding_strategy (a name, torch's ShardingStrategy, or Accelerate's numbers 1-5): FULL_SHARD -> ZeRO-3,
    SHARD_GRAD_OP -> ZeRO-2, NO_SHARD -> DDP, HYBRID_SHARD / _HYBRID_SHARD_ZERO2 -> shards within a node
    (dp_shard = processes per node) and replicas across nodes, ZeRO-3 / ZeRO-2. reshard_after_forward
    True / False (FSDP2's spelling) is ZeRO-3 / ZeRO-2. auto_wrap_policy TRANSFORMER_BASED_WRAP with
    transformer_cls_names_to_wrap shards every module of those classes one by one
    (ParallelismConfig.zero_blocks); without names, unison's own choice, the model's largest list of
    same-class blocks. mixed_precision_policy ("bf16", "fp16", or anything with a param_dtype, as torch's
    MixedPrecision / MixedPrecisionPolicy) sets Accelerator(mixed_precision=...): FSDP2 gathers
    parameters in that dtype and reduces gradients in fp32 over fp32 shards, with autocast on top.
    state_dict_type FULL_STATE_DICT and SHARDED_STATE_DICT are both accepted:
    save_state writes a sharded checkpoint under sharding (loadable into any layout), save_model a full
    one. sync_module_states (Accelerate's default True): FSDP2 shards each process's own copy, so build
    the model identically on every process (set_seed before building it, or load the same weights).
    limit_all_gathers, forward_prefetch, backward_prefetch and use_orig_params=True only tune FSDP1 and
    are accepted without effect. activation_checkpointing=True is unison's activation_checkpointing="full"
    on the same blocks (docs/activation-checkpointing.md). Refused with a message: cpu_offload,
    cpu_ram_efficient_loading, ignored_modules, param_init_fn, use_orig_params=False, min_num_params /
    SIZE_BASED_WRAP, LOCAL_STATE_DICT.
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None

    def layout(self, processes_per_node: int) -> PluginLayout:
        self._refuse_unsupported()
        stage = self._stage()
        config: dict[str, Any] = {}
        if stage:
            config["zero_stage"] = stage
        if enum_name(self.sharding_strategy).startswith(("HYBRID", "_HYBRID")):
            config["dp_shard_size"] = processes_per_node
        names = self.transformer_cls_names_to_wrap
        if enum_name(self.auto_wrap_policy) == "TRANSFORMER_BASED_WRAP" and names:
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            if not stage:
                raise ValueError(
                    "FullyShardedDataParallelPlugin: transformer_cls_names_to_wrap names the units ZeRO-2/3 "
                    "shards, but sharding_strategy NO_SHARD shards nothing: drop the names or shard."
                )
            config["zero_blocks"] = ",".join(names)
        if self.activation_checkpointing:
            config["activation_checkpointing"] = "full"
        return PluginLayout(ParallelismConfig(**config), self._precision())

    def _precision(self) -> str | None:
        """Accelerator(mixed_precision=...) as the policy names it, or None (the Accelerator's own)."""
        policy = self.mixed_precision_policy
        if policy is None:
            return None
        if isinstance(policy, str) and policy.lower() in _PRECISION_NAMES:
            return _PRECISION_NAMES[policy.lower()]
        dtype = policy.get("param_dtype") if isinstance(policy, dict) else getattr(policy, "param_dtype", 0)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, dtype)
        if dtype in _PRECISION_OF_DTYPE:
            return _PRECISION_OF_DTYPE[dtype]
        raise unsupported(
            "FullyShardedDataParallelPlugin",
            "mixed_precision_policy",
            policy,
            "Give 'bf16', 'fp16', or a policy whose param_dtype is torch.bfloat16, torch.float16 or "
            "torch.float32 (or set Accelerator(mixed_precision=...)).",
        )

    def _stage(self) -> int:
        strategy = self.sharding_strategy
        if isinstance(strategy, int) and not isinstance(strategy, bool):
            if strategy not in _FSDP_STRATEGY_NUMBERS:
                raise ValueError(
                    f"FullyShardedDataParallelPlugin(sharding_strategy={strategy}): Accelerate numbers the "
                    f"strategies 1-5 ({_FSDP_STRATEGY_NUMBERS}); give one of those or its name."
                )
            strategy = self.sharding_strategy = _FSDP_STRATEGY_NUMBERS[strategy]
        from_strategy = None if strategy is None else _FSDP_STRATEGIES.get(enum_name(strategy))
        if strategy is not None and from_strategy is None:
            raise ValueError(
                f"FullyShardedDataParallelPlugin(sharding_strategy={strategy!r}) is not a sharding strategy: "
                f"choose one of {', '.join(_FSDP_STRATEGIES)}."
            )
        reshard = self.reshard_after_forward
        if isinstance(reshard, str) and reshard.lower() in ("true", "false"):
            reshard = reshard.lower() == "true"
        if isinstance(reshard, str) or (reshard is not None and not isinstance(reshard, bool)):
            from_reshard = _RESHARD_NAMES.get(enum_name(reshard))
            if from_reshard is None:
                raise ValueError(
                    f"FullyShardedDataParallelPlugin(reshard_after_forward={reshard!r}): give True (ZeRO-3), "
                    f"False (ZeRO-2) or one of {', '.join(_RESHARD_NAMES)}."
                )
        else:
            from_reshard = None if reshard is None else (3 if reshard else 2)
        if from_strategy is not None and from_reshard is not None and from_strategy != from_reshard:
            raise ValueError(
                f"FullyShardedDataParallelPlugin: sharding_strategy={strategy!r} and reshard_after_forward="
                f"{self.reshard_after_forward!r} ask for different sharding (stage {from_strategy} vs "
                f"{from_reshard}); give one of them."
            )
        for stage in (from_strategy, from_reshard):
            if stage is not None:
                return stage
        return 3  # FULL_SHARD, Accelerate's default

    def _refuse_unsupported(self) -> None:
        plugin = "FullyShardedDataParallelPlugin"
        if self.fsdp_version not in (None, 1, 2):
            raise ValueError(
                f"{plugin}(fsdp_version={self.fsdp_version!r}): give 1 or 2 (both run on FSDP2)."
            )
        offload = self.cpu_offload
        if offload not in (None, False) and getattr(offload, "offload_params", True):
            raise unsupported(
                plugin,
                "cpu_offload",
                offload,
                "Leave it unset: CPU offload comes with FSDP2's CPUOffloadPolicy in a later version.",
            )
        checks = {
            "activation_checkpointing_offload": (
                self.activation_checkpointing_offload,
                (None, False),
                "Leave it unset.",
            ),
            "cpu_ram_efficient_loading": (
                self.cpu_ram_efficient_loading,
                (None, False),
                "Leave it unset: every process builds the model.",
            ),
            "ignored_modules": (self.ignored_modules, None, "Leave it unset: every module is sharded."),
            "param_init_fn": (self.param_init_fn, None, "Leave it unset: build the model on every process."),
            "use_orig_params": (
                self.use_orig_params,
                (None, True),
                "FSDP2 always keeps the original parameters: leave it unset.",
            ),
            "min_num_params": (
                self.min_num_params,
                (None, 0),
                "Size-based wrapping is not supported: use "
                "auto_wrap_policy='TRANSFORMER_BASED_WRAP' with transformer_cls_names_to_wrap.",
            ),
        }
        for option, (value, allowed, advice) in checks.items():
            if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
                raise unsupported(plugin, option, value, advice)
        policy = self.auto_wrap_policy
        if policy is not None and (not isinstance(policy, str) or policy.upper() not in _WRAP_POLICIES):
            raise unsupported(
                plugin,
                "auto_wrap_policy",
                policy,
                "Give 'TRANSFORMER_BASED_WRAP' (with transformer_cls_names_to_wrap) or leave it unset.",
            )
        if self.state_dict_type is not None and enum_name(self.state_dict_type) not in _STATE_DICT_TYPES:
            raise unsupported(
                plugin,
                "state_dict_type",
                self.state_dict_type,
                f"Give one of {', '.join(_STATE_DICT_TYPES)}.",
            )
