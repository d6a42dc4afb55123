"""Accelerate's configuration objects for the Accelerator: how loaders are prepared and how gradients
accumulate. Names, fields and defaults are Accelerate 1.x's, so `Accelerator(dataloader_config=...,
gradient_accumulation_plugin=...)` migrates unchanged; each field says what unison does with it.

`resolve_dataloader_config` and `resolve_accumulation` merge them with the Accelerator's older direct
arguments (split_batches=..., gradient_accumulation_steps=...), which keep working: a value given both
ways must agree, so that nothing the user wrote is silently overruled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass
class DataLoaderConfiguration:
    """How `prepare()` shards data loaders (Accelerate's `DataLoaderConfiguration`).

    Attributes:
        split_batches: the loader's batch size is the global one, cut into a share per process (it must be
            a multiple of the process count); False: each process reads batches of the loader's size.
        dispatch_batches: process 0 reads and sends each process its share; None: True for an
            IterableDataset on several processes, else False.
        even_batches: the last round is topped up from the data's start so every process gets a batch
            (gather_for_metrics drops the top-up); False: processes may get fewer batches.
        use_seedable_sampler: False (the default, as in Accelerate): a shuffled loader yields the order the
            user's unprepared loader gives in one process, drawn from the same generators (the global RNG or
            the loader's generator, process 0's state on every process; see docs/data-order.md). True: each
            epoch's order is a function of (seed, epoch) alone and iterating never draws from the global RNG.
            Both give the same samples per global step on any number of processes and resume exactly.
        data_seed: the seed of the use_seedable_sampler order (setting it implies use_seedable_sampler; None:
            the loader's generator's seed, else torch's initial seed).
        non_blocking: copy batches to the GPU without waiting, from pinned memory (the loader pins its
            batches); None (the default; Accelerate's is False) means True on a GPU: a blocking copy stalls
            the Python thread until the batch has arrived, while a copy from pinned memory is queued on the
            stream the model's kernels run on, so it overlaps the launch of the step and is ordered before
            them. No effect on the CPU. False: blocking copies, and pinned memory only if the loader asks.
        use_stateful_dataloader: prepared loaders already save and restore their position mid-epoch through
            state_dict()/load_state_dict() (and save_state/load_state), so True needs no torchdata.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool | None = None
    use_stateful_dataloader: bool = False


@dataclass
class GradientAccumulationPlugin:
    """How gradients accumulate over micro-batches (Accelerate's `GradientAccumulationPlugin`).

    Attributes:
        num_steps: micro-batches per optimizer step (Accelerator's gradient_accumulation_steps).
        adjust_scheduler: in Accelerate, only a counter that silences torch's "scheduler before optimizer"
            warning on micro-steps; unison's prepared scheduler steps once per real optimizer step either
            way, so both values give the same learning rates (as they do in Accelerate).
        sync_with_dataloader: the last batch of a loader ends the accumulation window (a window it cuts short
            is the mean over its own micro-batches); False: windows run on across the loader's end.
        sync_each_batch: reduce gradients on every micro-batch instead of only the window's last; the
            optimizer still steps once per window, with the same numbers (up to the order of the sums).
            None (the default) chooses by memory: True where FSDP2 shards gradients (ZeRO-2/3, HSDP, replicas
            beside TP or PP), which otherwise keeps every parameter's unsharded gradient between
            micro-batches (4 bytes per parameter, not 4/N: ZeRO-2/3's saving gone while accumulating), at
            the cost of one reduce-scatter per micro-batch; False under DDP and ZeRO-1, whose gradients are
            whole either way. Accelerate's default is False everywhere.
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool | None = None


def resolve_dataloader_config(
    config: DataLoaderConfiguration | None, **direct: Any
) -> DataLoaderConfiguration:
    """The configuration to use: `config` (or the defaults) with the direct arguments that were given.

    A direct argument left as None was not given. One given with a different value than `config`
    sets is an error naming both, raised on every process before any work.
    """
    if config is not None and not isinstance(config, DataLoaderConfiguration):
        raise TypeError(
            f"dataloader_config={config!r} is a {type(config).__name__}: pass a "
            "unison.DataLoaderConfiguration(split_batches=..., even_batches=..., ...)."
        )
    base = config or DataLoaderConfiguration()
    given = {name: value for name, value in direct.items() if value is not None}
    for name, value in given.items():
        if config is not None and getattr(config, name) != value:
            raise ValueError(
                f"{name}={value!r} conflicts with dataloader_config.{name}={getattr(config, name)!r}: "
                f"set it in one place, e.g. DataLoaderConfiguration({name}={value!r})."
            )
    return replace(base, **given)


def resolve_accumulation(
    plugin: GradientAccumulationPlugin | None, gradient_accumulation_steps: int | None
) -> GradientAccumulationPlugin:
    """The accumulation settings: the plugin's, or gradient_accumulation_steps (both: an error, as in
    Accelerate, since one would overrule the other). num_steps None means 1 (no accumulation)."""
    if plugin is None:
        return GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
    if not isinstance(plugin, GradientAccumulationPlugin):
        raise TypeError(
            f"gradient_accumulation_plugin={plugin!r} is a {type(plugin).__name__}: pass a "
            "unison.GradientAccumulationPlugin(num_steps=...)."
        )
    if gradient_accumulation_steps is not None:
        raise ValueError(
            f"gradient_accumulation_steps={gradient_accumulation_steps} and gradient_accumulation_plugin "
            f"(num_steps={plugin.num_steps}) were both given: pass one, e.g. "
            f"GradientAccumulationPlugin(num_steps={gradient_accumulation_steps})."
        )
    return plugin
