"""Accelerate's FSDP and DeepSpeed plugins, translated into a `ParallelismConfig`.

A script written for Accelerate configures sharding with `FullyShardedDataParallelPlugin` or
`DeepSpeedPlugin` (or a DeepSpeed JSON file), in code or through `accelerate launch --use_fsdp ...`
flags. unison runs every such layout on torch's own engines, so each plugin is read once, at
`Accelerator(...)`, into the layout it names plus the precision and accumulation it asks for
(`resolve_plugins`). An option unison does not carry out is refused by name, at construction, on every
process (each reads the same plugin): it is never silently ignored. Options that only tune an engine's
own buffers (bucket sizes, prefetching) are accepted and have no effect; the plugins' docstrings list them.

`unison launch --use_fsdp ...` builds the plugin in the launcher (a wrong option fails before any
worker starts) and hands it to the workers as JSON in UNISON_PLUGIN (`plugin_to_env`, `plugin_from_env`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from .. import env_vars
from ..environment import detect_layout
from ..parallel.config import ParallelismConfig
from .deepspeed import DeepSpeedPlugin
from .fsdp import FullyShardedDataParallelPlugin
from .layout import PluginLayout

__all__ = ["DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "plugin_layout", "resolve_plugins"]

_KINDS = {"fsdp": FullyShardedDataParallelPlugin, "deepspeed": DeepSpeedPlugin}


def plugin_layout(
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    deepspeed_plugin: DeepSpeedPlugin | None,
    deepspeed_plugins: Any,
    num_processes: int,
    processes_per_node: int,
) -> PluginLayout | None:
    """The layout the Accelerator's plugin arguments ask for (`layout_of`), or None without a plugin."""
    if deepspeed_plugins is not None:
        raise ValueError(
            "Accelerator(deepspeed_plugins=...): several DeepSpeed configurations in one run (one per model) "
            "are not supported: pass one deepspeed_plugin, or parallelism=..."
        )
    if fsdp_plugin is not None and deepspeed_plugin is not None:
        raise ValueError(
            "Accelerator got both fsdp_plugin and deepspeed_plugin: they name two layouts; pass one."
        )
    plugin = fsdp_plugin if fsdp_plugin is not None else deepspeed_plugin
    if plugin is None:
        return None
    if not isinstance(plugin, (FullyShardedDataParallelPlugin, DeepSpeedPlugin)):
        raise TypeError(
            f"Accelerator got a {type(plugin).__module__}.{type(plugin).__name__} as a plugin: use unison's "
            "FullyShardedDataParallelPlugin / DeepSpeedPlugin (same fields: `from unison.utils import ...`)."
        )
    return layout_of(plugin, num_processes, processes_per_node)


def layout_of(
    plugin: FullyShardedDataParallelPlugin | DeepSpeedPlugin, num_processes: int, processes_per_node: int
) -> PluginLayout:
    """What `plugin` asks of a run of `num_processes`. In a single process (the same script run as plain
    `python train.py`) there is nothing to shard: the plugin's options are still checked, and its
    precision and accumulation still apply."""
    asked = plugin.layout(processes_per_node)
    if num_processes == 1:
        return PluginLayout(ParallelismConfig(), asked.mixed_precision, asked.gradient_accumulation_steps)
    return asked


def resolve_plugins(
    plugins: tuple[FullyShardedDataParallelPlugin | None, DeepSpeedPlugin | None, Any],
    parallelism: ParallelismConfig | str | None,
    mixed_precision: str | None,
    gradient_accumulation_steps: int | None,
) -> tuple[
    ParallelismConfig | str | None,
    str | None,
    int | None,
    FullyShardedDataParallelPlugin | DeepSpeedPlugin | None,
]:
    """The Accelerator's parallelism, mixed_precision and gradient_accumulation_steps once its plugins
    (fsdp_plugin, deepspeed_plugin, deepspeed_plugins) are read; with none given in code and no
    parallelism= either, the plugin `unison launch --use_fsdp ...` exported in UNISON_PLUGIN. Last, the
    plugin read (None without one): the state shows it as Accelerate's `state.fsdp_plugin` /
    `state.deepspeed_plugin`.

    A plugin and an explicit argument that ask for different things are refused, naming both; what the
    plugin leaves open stays the argument's (or the launcher's variables', later).
    """
    fsdp_plugin, deepspeed_plugin, deepspeed_plugins = plugins
    given_in_code = fsdp_plugin is not None or deepspeed_plugin is not None or deepspeed_plugins is not None
    if given_in_code and parallelism is not None:
        raise ValueError(
            f"Accelerator got parallelism={parallelism!r} and a {'FSDP' if fsdp_plugin else 'DeepSpeed'} "
            "plugin: both name the layout. Pass one of them."
        )
    if not given_in_code and parallelism is None:
        plugin = plugin_from_env()
        fsdp_plugin = plugin if isinstance(plugin, FullyShardedDataParallelPlugin) else None
        deepspeed_plugin = plugin if isinstance(plugin, DeepSpeedPlugin) else None
    layout = detect_layout()  # torchrun's or SLURM's variables: the process group is not formed yet
    asked = plugin_layout(
        fsdp_plugin, deepspeed_plugin, deepspeed_plugins, layout.world_size, layout.local_world_size
    )
    if asked is None:
        return parallelism, mixed_precision, gradient_accumulation_steps, None
    return (
        asked.parallelism,
        _agreeing("mixed_precision", mixed_precision, asked.mixed_precision),
        _agreeing(
            "gradient_accumulation_steps", gradient_accumulation_steps, asked.gradient_accumulation_steps
        ),
        fsdp_plugin if fsdp_plugin is not None else deepspeed_plugin,
    )


def _agreeing(name: str, argument: Any, from_plugin: Any) -> Any:
    if argument is not None and from_plugin is not None and str(argument).lower() != str(from_plugin).lower():
        raise ValueError(
            f"Accelerator({name}={argument!r}) and its plugin's {name} ({from_plugin!r}) disagree: give one "
            "of them, or make them equal."
        )
    return from_plugin if argument is None else argument


def plugin_to_env(plugin: FullyShardedDataParallelPlugin | DeepSpeedPlugin) -> str:
    """The JSON `unison launch` exports as UNISON_PLUGIN: the plugin's kind and the fields it sets."""
    kind = next(name for name, cls in _KINDS.items() if isinstance(plugin, cls))
    defaults = type(plugin)()
    fields = {
        f.name: getattr(plugin, f.name)
        for f in dataclasses.fields(plugin)
        if getattr(plugin, f.name) != getattr(defaults, f.name)
    }
    return json.dumps({kind: fields})


def plugin_from_env() -> FullyShardedDataParallelPlugin | DeepSpeedPlugin | None:
    """The plugin `unison launch --use_fsdp/--use_deepspeed ...` exported, or None."""
    raw = os.environ.get(env_vars.PLUGIN, "").strip()
    return read_plugin(raw) if raw else None


def read_plugin(raw: str) -> FullyShardedDataParallelPlugin | DeepSpeedPlugin:
    """The plugin of a `plugin_to_env` JSON text."""
    try:
        ((kind, fields),) = json.loads(raw).items()
        return _KINDS[kind](**fields)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{env_vars.PLUGIN}={raw!r} is not a plugin as `unison launch` writes it "
            f'({{"fsdp": {{FIELD: VALUE}}}} or {{"deepspeed": {{...}}}}): {error}. Unset it, or launch '
            "with --use_fsdp / --use_deepspeed."
        ) from None
