"""`accelerate launch`'s FSDP and DeepSpeed flags on `unison launch`, read into a plugin.

A job script written for Accelerate says `accelerate launch --use_fsdp --fsdp_sharding_strategy
FULL_SHARD train.py`. The same flags after `unison launch` build the FullyShardedDataParallelPlugin (or
DeepSpeedPlugin) those flags would build, which the launcher checks against the process count before any
worker starts and exports as JSON (env_vars.PLUGIN) for `Accelerator()` to read (unison.plugins).
Flags of a plugin that was not chosen, and flags of options unison cannot carry out, are errors.

This module holds the flags' tables and their argparse spellings and imports no torch, so `unison
launch --help` and the config-file readers need none; the plugin the flags ask for is built by
`unison.launching.options.plugin_from_flags` when a launch runs.
"""

from __future__ import annotations

import argparse

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
