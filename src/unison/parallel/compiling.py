"""torch.compile inside prepare(): each repeated block compiled in place, else the whole model.

`Accelerator(dynamo_backend="inductor")` (or `dynamo_plugin=TorchDynamoPlugin(...)`, or `unison launch
--dynamo-backend inductor`) compiles at prepare(), in torchtitan's order: after tensor parallelism (and
activation checkpointing), before the data-parallel engine (DDP, FSDP2), so that DTensor layouts are
traced into the graphs and the engines' hooks wrap compiled code.

Why per block (torchtitan's and PyTorch's "regional compilation"): the blocks of a transformer are
modules of one class, so the graph traced for the first is reused by the others (one compile instead
of n_layer), and the points where FSDP2 gathers and frees parameters fall between graphs, where they
run eagerly. A model with no block list (`blocks.find_blocks`) is compiled whole.

Why `nn.Module.compile()` and not `torch.compile(module)`: it compiles the module's call in place, so
the module keeps its class, its place in its parent and its parameter names. `torch.compile(module)`
returns a wrapper whose state-dict keys gain `_orig_mod.`, which checkpoints, `unwrap_model` and every
name-based option (tp_plan, zero_blocks, pp_split_points) would then have to see through.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .. import env_vars
from .blocks import find_blocks

if TYPE_CHECKING:
    from .config import ParallelismConfig

logger = logging.getLogger("unison")

OFF = "no"
"""The backend value that turns compilation off (Accelerate's DynamoBackend.NO)."""

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's modes, as its docstring lists them."""


@dataclass
class TorchDynamoPlugin:
    """How prepare() compiles the model (Accelerate's `TorchDynamoPlugin`, the same fields).

    backend: a torch.compile backend ("inductor", or "aot_eager" / "eager" to debug), or "no" (off).
        None reads UNISON_DYNAMO_BACKEND (`unison launch --dynamo-backend`), else "no".
    mode: torch.compile's mode ("default", "reduce-overhead", "max-autotune", ...); None reads
        UNISON_DYNAMO_MODE, else torch's default.
    fullgraph, dynamic, options: torch.compile's arguments of those names.
    disable: True turns compilation off (Accelerate's switch for testing).
    use_regional_compilation: True (unison's default) compiles each block of the model's block list
        (ParallelismConfig.zero_blocks names it, else the largest ModuleList of one class) and the
        whole model only when it has none; False always compiles the whole model (Accelerate's default).
    """

    backend: str | None = None
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = None
    disable: bool = False
    use_regional_compilation: bool = True

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = env_vars.env_str(env_vars.DYNAMO_BACKEND, OFF)
        if self.mode is None:
            self.mode = os.environ.get(env_vars.DYNAMO_MODE, "").strip() or None
        self.backend = check_backend(self.backend)
        self.mode = check_mode(self.mode)
        if self.mode is not None and self.options:
            raise ValueError(
                f"TorchDynamoPlugin(mode={self.mode!r}, options={self.options!r}): torch.compile takes a "
                "mode or backend options, not both. Drop one (a mode is a named set of inductor options)."
            )

    @property
    def enabled(self) -> bool:
        return self.backend != OFF and not self.disable

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for torch.compile (those left None keep torch's defaults)."""
        kwargs = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        kwargs.update({k: v for k, v in (("mode", self.mode), ("options", self.options)) if v is not None})
        return kwargs


def check_backend(value: Any) -> str:
    """`value` as a backend name torch.compile knows (lower case), or "no"; ValueError naming the valid
    ones otherwise. "no" and "none" (any case) mean off, as Accelerate's `dynamo_backend="no"`.

    Pure and local (torch's registry of backends), so every process reaches the same verdict before work.
    """
    if value is None:
        return OFF
    if not isinstance(value, str):
        raise TypeError(
            f"dynamo_backend={value!r} is a {type(value).__name__}: pass a backend name such as 'inductor', "
            "or 'no' to train without torch.compile."
        )
    name = value.strip().lower()
    if name in ("", OFF, "none"):
        return OFF
    import torch.compiler  # torch._dynamo loads here (about 1.5 s), only when a backend is asked for

    known = torch.compiler.list_backends(exclude_tags=())  # with the debug ones: eager, aot_eager
    if name not in known:
        shown = ", ".join(repr(b) for b in ["no", *torch.compiler.list_backends(), "aot_eager", "eager"])
        raise ValueError(
            f"dynamo_backend={value!r} is not a torch.compile backend this torch knows: choose one of "
            f"{shown} ('no': no compilation; 'aot_eager', 'eager': debugging backends that generate no "
            "code). torch.compiler.list_backends(exclude_tags=()) lists them all."
        )
    return name


def check_mode(value: str | None) -> str | None:
    if value is None or value in MODES:
        return value
    raise ValueError(
        f"dynamo mode={value!r} is not a torch.compile mode: pass one of {', '.join(map(repr, MODES))}, "
        "or None for torch's default."
    )


def resolve_dynamo_plugin(
    dynamo_backend: str | None, dynamo_plugin: TorchDynamoPlugin | None
) -> TorchDynamoPlugin | None:
    """The Accelerator's compile settings: its `dynamo_plugin`, else a plugin of `dynamo_backend` (None:
    the launch flags' environment); None when compilation is off."""
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise ValueError(
            f"dynamo_backend={dynamo_backend!r} and dynamo_plugin={dynamo_plugin!r} were both given: pass "
            "one (the plugin's backend field is the backend)."
        )
    if dynamo_plugin is not None and not isinstance(dynamo_plugin, TorchDynamoPlugin):
        raise TypeError(
            f"dynamo_plugin={dynamo_plugin!r} is a {type(dynamo_plugin).__name__}: pass a "
            "unison.utils.TorchDynamoPlugin(backend=..., mode=...)."
        )
    plugin = dynamo_plugin or TorchDynamoPlugin(backend=dynamo_backend)
    return plugin if plugin.enabled else None


def compile_model(model: nn.Module, plugin: TorchDynamoPlugin | None, config: ParallelismConfig) -> None:
    """Compile `model` in place for `plugin` (None: leave it as it is), as the layout `config` runs it.

    Each block's call is compiled (`nn.Module.compile`): the blocks `config.zero_blocks` names, else
    the model's block list; the whole model's call where there is no block list or regional compilation
    is off. Names, classes and parameters are unchanged.
    """
    if plugin is None:
        return
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError(
            f"the {type(model).__name__} given to prepare() is already compiled (torch.compile), and "
            f"dynamo_backend={plugin.backend!r} asks prepare() to compile it again: compile in one place. "
            "Pass the model before torch.compile, or drop dynamo_backend."
        )
    units = _blocks(model, config.zero_blocks) if plugin.use_regional_compilation else []
    kwargs = plugin.compile_kwargs()
    # torch compiles the block's forward and runs its hooks eagerly; disable() keeps this one out of any
    # graph should a torch trace the hooks too (built here: disable() imports torch._dynamo)
    wait_hook = torch.compiler.disable(_wait_for_collective_inputs)
    for unit in units or [model]:
        if (config.tp_size or 1) > 1:
            unit.register_forward_pre_hook(wait_hook)
        unit.compile(**kwargs)
    what = (
        f"each of {len(units)} {type(units[0]).__name__} blocks"
        if units
        else f"the whole {type(model).__name__}"
    )
    logger.info("torch.compile (%s): %s", ", ".join(f"{k}={v!r}" for k, v in kwargs.items()), what)


def _wait_for_collective_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Hand a compiled block plain tensors where tensor parallelism gave it an AsyncCollectiveTensor.

    A tensor-parallel embedding (RowwiseParallel, replicated output) returns `DTensor.to_local()` of an
    all-reduce: an AsyncCollectiveTensor, waited for on first use. Fed as such into a graph compiled by
    AOTAutograd, the backward hands the all-reduce's backward a plain tensor where it expects a DTensor
    and fails ("'Tensor' object has no attribute '_local_tensor'"; torch 2.13, reproduced with torch
    alone). A copy made here, outside the graph, is an ordinary tensor whose backward chain stays eager.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor  # private: pinned by a test

    return tuple(arg.clone() if isinstance(arg, AsyncCollectiveTensor) else arg for arg in args)


def _blocks(model: nn.Module, blocks: str | None) -> list[nn.Module]:
    if blocks is not None:
        from .zero import resolve_blocks  # zero_blocks is given only with ZeRO-2/3: FSDP2 is loaded anyway

        return resolve_blocks(model, blocks)
    found = find_blocks(model)
    return list(found[1]) if found is not None else []
