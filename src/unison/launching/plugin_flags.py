"""`accelerate launch`'s FSDP and DeepSpeed flags on `unison launch`, read into a plugin.

A job script written for Accelerate says `accelerate launch --use_fsdp --fsdp_sharding_strategy
FULL_SHARD train.py`. The same flags after `unison launch` build the FullyShardedDataParallelPlugin (or
DeepSpeedPlugin) those flags would build, which the launcher checks against the process count before any
worker starts and exports as JSON (env_vars.PLUGIN) for `Accelerator()` to read (unison.plugins).
Flags of a plugin that was not chosen, and flags of options unison cannot carry out, are errors.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin, plugin_to_env
from .errors import LaunchError

# flag -> (plugin field, value type); "bool" takes Accelerate's true/false strings
FSDP_FLAGS = {
    "fsdp_version": ("fsdp_version", int),
    "fsdp_offload_params": ("cpu_offload", "bool"),
    "fsdp_min_num_params": ("min_num_params", int),
    "fsdp_sharding_strategy": ("sharding_strategy", str),
    "fsdp_reshard_after_forward": ("reshard_after_forward", str),
    "fsdp_auto_wrap_policy": ("auto_wrap_policy", str),
    "fsdp_transformer_layer_cls_to_wrap": ("transformer_cls_names_to_wrap", str),
    "fsdp_backward_prefetch": ("backward_prefetch", str),
    "fsdp_state_dict_type": ("state_dict_type", str),
    "fsdp_forward_prefetch": ("forward_prefetch", "bool"),
    "fsdp_use_orig_params": ("use_orig_params", "bool"),
    "fsdp_cpu_ram_efficient_loading": ("cpu_ram_efficient_loading", "bool"),
    "fsdp_sync_module_states": ("sync_module_states", "bool"),
    "fsdp_activation_checkpointing": ("activation_checkpointing", "bool"),
}
DEEPSPEED_FLAGS = {
    "deepspeed_config_file": ("hf_ds_config", str),
    "zero_stage": ("zero_stage", int),
    "offload_optimizer_device": ("offload_optimizer_device", str),
    "offload_param_device": ("offload_param_device", str),
    "gradient_clipping": ("gradient_clipping", float),
    "zero3_init_flag": ("zero3_init_flag", "bool"),
}


def add_plugin_flags(parser: argparse.ArgumentParser) -> None:
    """Accelerate's spellings (underscores), as its users type them; each defaults to "not given"."""
    fsdp = parser.add_argument_group("FSDP, as accelerate launch spells it (exported as UNISON_PLUGIN)")
    fsdp.add_argument(
        "--use_fsdp", "--use-fsdp", action="store_true", default=None, help="shard with FSDP2 (ZeRO-3)"
    )
    deepspeed = parser.add_argument_group("DeepSpeed's ZeRO stages, run on torch's engines (UNISON_PLUGIN)")
    deepspeed.add_argument(
        "--use_deepspeed", "--use-deepspeed", action="store_true", default=None, help="ZeRO stage (default 2)"
    )
    for group, flags, plugin in (
        (fsdp, FSDP_FLAGS, "FullyShardedDataParallelPlugin"),
        (deepspeed, DEEPSPEED_FLAGS, "DeepSpeedPlugin"),
    ):
        for flag, (field, kind) in flags.items():
            group.add_argument(
                f"--{flag}",
                f"--{flag.replace('_', '-')}",
                dest=flag,
                default=None,
                type=str if kind == "bool" else kind,
                metavar="true|false" if kind == "bool" else "VALUE",
                help=f"{plugin}({field}=...)",
            )


def plugin_from_flags(args: argparse.Namespace) -> str | None:
    """The UNISON_PLUGIN JSON the flags ask for, or None. Raises LaunchError naming a wrong flag."""
    chosen = [name for name in ("use_fsdp", "use_deepspeed") if getattr(args, name)]
    if len(chosen) == 2:
        raise LaunchError("--use_fsdp and --use_deepspeed name two layouts: pass one of them.")
    for use, flags in (("use_fsdp", FSDP_FLAGS), ("use_deepspeed", DEEPSPEED_FLAGS)):
        stray = [f"--{flag}" for flag in flags if getattr(args, flag) is not None and use not in chosen]
        if stray:
            raise LaunchError(f"{', '.join(stray)} without --{use}: add --{use}, or drop them.")
    if not chosen:
        return None
    if args.parallelism is not None:
        raise LaunchError(
            f"--parallelism {args.parallelism} and --{chosen[0]} both name the layout: pass one of them."
        )
    if chosen == ["use_fsdp"]:
        plugin: Any = FullyShardedDataParallelPlugin(**_fields(args, FSDP_FLAGS))
    else:
        fields = _fields(args, DEEPSPEED_FLAGS)
        if args.gradient_accumulation_steps is not None:  # Accelerate hands it to the DeepSpeed plugin too
            fields["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        plugin = DeepSpeedPlugin(**fields)
    return plugin_to_env(plugin)


def _fields(args: argparse.Namespace, flags: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    fields = {}
    for flag, (field, kind) in flags.items():
        value = getattr(args, flag)
        if value is not None:
            fields[field] = _boolean(flag, value) if kind == "bool" else value
    return fields


def _boolean(flag: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise LaunchError(f"--{flag} {value!r} is not true or false: pass --{flag} true or --{flag} false.")
