"""What the planner plans for: the model's shape and limits (`ModelFacts`) and the run (`Workload`).

Both are plain values read once (a model on the meta device is enough), so every rank that plans with the
same inputs reaches the same layout (unison.planning.planner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from ..parallel.blocks import find_blocks
from . import memory

_HEAD_NAMES = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_KV_HEAD_NAMES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")


@dataclass(frozen=True)
class ModelFacts:
    """What planning needs from a model: its shape (`memory`) plus the sizes that limit a split."""

    shape: memory.ModelShape
    blocks: int  # length of the block list (0: none, so no pipeline split and one ZeRO-3 unit)
    block_parameters: int
    heads: int | None
    kv_heads: int | None
    largest_layer: str
    largest_layer_parameters: int
    largest_layer_trainable: int | None = None  # None: all of them
    no_tensor_parallel: str | None = None  # why TP layouts are not proposed for this model, if they are not

    @property
    def root_parameters(self) -> int:
        """Parameters outside the block list (embeddings, final norm, output layer)."""
        return self.shape.parameters - self.blocks * self.block_parameters

    @property
    def largest_unit(self) -> int:
        """Parameters ZeRO-3 gathers at once: one block, or the root (everything outside the blocks)."""
        return max(self.block_parameters, self.root_parameters) if self.blocks else self.shape.parameters

    @property
    def block_trainable(self) -> int:
        """The most trainable parameters of one block (a shape written by hand: the block's share)."""
        if self.shape.block_trainable_parameters is not None:
            return self.shape.block_trainable_parameters
        return math.ceil(self.block_parameters * self.shape.trainable_fraction)

    @property
    def root_trainable(self) -> int:
        """Trainable parameters outside the block list."""
        if self.shape.root_trainable_parameters is not None:
            return self.shape.root_trainable_parameters
        return max(0, self.shape.trainable_parameters - self.blocks * self.block_trainable)

    @property
    def largest_unit_trainable(self) -> int:
        """The most trainable parameters of one ZeRO unit: its gradients, whole before the reduce-scatter."""
        if not self.blocks:
            return self.shape.trainable_parameters
        return max(self.block_trainable, self.root_trainable)

    def describe(self) -> str:
        shape = self.shape
        text = (
            f"{shape.parameters / 1e9:.2f}B parameters"
            if shape.parameters >= 1e8
            else (f"{shape.parameters:,} parameters")
        )
        if shape.layers:
            text += f", {shape.layers} blocks ({shape.blocks}) of hidden {shape.hidden}"
        if self.heads:
            text += f", {self.heads} heads" + (
                f" ({self.kv_heads} kv)" if self.kv_heads != self.heads else ""
            )
        text += f"; largest layer {self.largest_layer} ({self.largest_layer_parameters:,} parameters)"
        if shape.trainable_parameters != shape.parameters:
            text += f"; {shape.describe_trainable()}"
        return text


def model_facts(model: nn.Module) -> ModelFacts:
    """Read a model's ModelFacts (works on the meta device: only shapes are read)."""
    shape = memory.inspect_model(model)
    found = find_blocks(model)
    blocks, block_parameters = 0, 0
    if found is not None:
        blocks = len(found[1])
        block_parameters = sum(p.numel() for p in found[1].parameters()) // blocks
    name, largest, largest_trainable = "", 0, 0
    for module_name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        size = sum(p.numel() for p in own)
        if size > largest:
            name, largest = module_name or type(module).__name__, size
            largest_trainable = sum(p.numel() for p in own if p.requires_grad)
    heads = _find_int(model, _HEAD_NAMES)
    kv_heads = _find_int(model, _KV_HEAD_NAMES) or heads
    return ModelFacts(
        shape,
        blocks,
        block_parameters,
        heads,
        kv_heads,
        name,
        largest,
        largest_trainable,
        _no_tensor_parallel(model),
    )


def _no_tensor_parallel(model: nn.Module) -> str | None:
    """Why tensor parallelism cannot split `model`, or None (propose TP): asked only of a model whose
    layers an adapter wraps, since any other model may bring a plan of its own at run time.

    PEFT's LoRA (and its other tuners) replaces each targeted nn.Linear by a wrapper holding the original
    as `base_layer` beside the adapter's small layers, and prefixes every name (base_model.model.). The
    tensor-parallel plan unison would apply (`parallel.tensor.tensor_parallel_plan`: a transformers
    model's own, or the built-in one by module name) must see through that; where it refuses the model,
    or names none of its modules (a plan whose names lack the wrapper's prefix splits nothing), or
    `parallel.tensor_adapters` cannot split an adapter it names (DoRA, IA3, prompt learning, ...), TP
    layouts are not proposed and the plan says why: ZeRO-3 and PP shard the frozen weights instead.
    """
    wrapped = next(
        (
            (name, module)
            for name, module in model.named_modules()
            if isinstance(getattr(module, "base_layer", None), nn.Module)
        ),
        None,
    )
    if wrapped is None:
        return None
    from ..parallel.tensor import tensor_parallel_plan  # loads DTensor: only for a model with adapters
    from ..parallel.tensor_adapters import through_adapters

    name, module = wrapped
    kind = f"adapter layers ({type(module).__module__}.{type(module).__qualname__} at {name}, ...)"
    try:
        plan = tensor_parallel_plan(model)
        through_adapters(model, plan)  # refuses the adapters it cannot split (DoRA, IA3, ...) by name
    except ValueError as error:
        return f"{kind}: {error}"
    if not plan:
        return f"{kind}: the model's tensor-parallel plan names none of its modules (it would split nothing)"
    return None


def _find_int(model: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first positive int under one of `names` in model.config (object or dict), then in any module."""
    config = getattr(model, "config", None)
    for source in (config, *model.modules()):
        for name in names:
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@dataclass(frozen=True)
class Workload:
    """The training run: precision, batch shape (for activations), and what its loop and model allow.

    pipeline: pipeline layouts may be chosen (the loop calls the pipeline step; the model has a block list).
    tensor_parallel: TP layouts may be chosen (the model has a TP plan: built in or the user's).
    global_batch_size: sequences per optimizer step over all ranks; with it (and seq_len) the planner prices
        each layout's step (`cost_model`) and picks the fastest that fits, else the first in the guide's
        order. micro_batch_size may then be None: the planner tries 1, 2, 4, ... and keeps the fastest
        that fits.
    zero: layouts that shard parameters or gradients over the data-parallel ranks (ZeRO-2/3, HSDP, ZeRO-1
        beside a pipeline) may be chosen; False keeps plain data parallelism (e.g. to compare with runs made
        before ZeRO existed).
    """

    precision: str = "fp32"
    micro_batch_size: int | None = None
    seq_len: int | None = None
    activation_checkpointing: bool = False
    pipeline: bool = True
    tensor_parallel: bool = True
    global_batch_size: int | None = None
    zero: bool = True

    def __post_init__(self) -> None:
        names = [p.name for p in memory.PRECISIONS]
        if self.precision not in names:
            raise ValueError(f"precision={self.precision!r} is unknown: pass one of {', '.join(names)}.")
        searched = self.global_batch_size is not None and self.micro_batch_size is None
        if (self.micro_batch_size is None) != (self.seq_len is None) and not searched:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size}, seq_len={self.seq_len}: activations need both; "
                "give both or neither (neither: model state only)."
            )
        if self.global_batch_size is not None and self.seq_len is None:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} needs seq_len (tokens per sequence) to price "
                "a step: give it too."
            )
        for name in ("micro_batch_size", "seq_len", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is not a whole number >= 1.")

    @property
    def bytes(self) -> memory.Precision:
        return next(p for p in memory.PRECISIONS if p.name == self.precision)
