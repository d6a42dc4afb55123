"""Memory per device for each strategy, estimated from a model's shape before anything is allocated.

The model is built on the meta device (`with torch.device("meta"):`), so a 70B-parameter model costs
no memory and about a second; only its parameter count and a few shape facts are read. All formulas
live here, in one place, so the `estimate-memory` command and the planner agree.

Model state (design.md §3; Rajbhandari et al. 2020, "ZeRO", section 3.1), with Ψ the parameter count,
N the number of devices, and per precision p/g/o = bytes per parameter of parameters, gradients and
Adam state, priced as unison runs each precision: fp32 4/4/8; bf16-mixed (mixed_precision="bf16": fp32
master parameters, gradients and Adam moments, bf16 compute) also 4/4/8; plain bf16 (a model cast to
bfloat16, so bf16 gradients and Adam moments) 2/2/4. c = bytes per parameter FSDP2 gathers and
computes with: p, except 2 under bf16-mixed (its MixedPrecisionPolicy gathers bf16).

    single device, DDP   pΨ + gΨ + oΨ
    ZeRO-1               pΨ + gΨ + oΨ/N
    ZeRO-2               cΨ (+ pΨ/N when c < p: the master shards beside the gathered copy) + (g + o)Ψ/N
    ZeRO-3               (p + g + o)Ψ/N
    ZeRO-3 + offload     0 on the device; (p + g + o)Ψ/N in host memory (FSDP2's CPUOffloadPolicy)
    TP, PP of degree N   ~(p + g + o)Ψ/N   (an estimate: layer norms, biases and uneven stages differ)

Gradients and Adam state count only trainable parameters (requires_grad=True; Ψ_t in place of Ψ in g
and o above, and in the largest FSDP2 unit's gradients), the frozen ones count as parameters and shard
as they do: fine-tuning a 70B model with LoRA keeps its 70B weights and Adam state for the adapters
only. Ψ/N is rounded up, as sharding pads.

Autocast's copies (bf16-mixed, where the weights it computes with are fp32: single device, DDP, ZeRO-1,
TP and PP without data-parallel sharding): every matmul casts its fp32 weight to bf16 and keeps that copy
for backward, so from the end of forward until backward reaches it a device holds 2 bytes per parameter
it computes with that backward passes through (Ψ, or Ψ/N under TP and PP). A frozen weight counts too:
its copy is kept to compute its input's gradient (measured with torch's saved tensors: a tiny Llama with
LoRA on q/k/v/o keeps copies of every weight but its first block's q, k and v, frozen weights before the
first trainable one keep none), so ModelShape.reached_parameters counts the parameters from the first
trainable one on, in registration order. Counted with the parameters. Under ZeRO-2/3
FSDP2 already gathers bf16 weights, which autocast uses as they are: no copies. With activation
checkpointing only the recomputed block's copies exist at a time.

Activations per device (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4), for a transformer of L blocks with hidden size h, sequence length s
and micro-batch b, per block, in bytes with e bytes per activation element (2 in bf16, 4 in fp32) and
1-byte dropout masks:

    s·b·h·(16e + 2)                  = 34·s·b·h in 16-bit, the paper's figure; with tensor parallel of
                                       degree t: s·b·h·(4e + 2 + 12e/t) (= 10 + 24/t in 16-bit)
    + a·s²·b·(2e + 1)/t              only when the attention score matrix is stored (a heads; the 5as²b
                                       term); fused attention (torch SDPA flash / memory-efficient) does
                                       not store it, which is the default here
    + 4·s·b·V/t once                 fp32 logits of the output layer (V = vocabulary), when found

DDP and ZeRO run one micro-batch per device through all L blocks; with 1F1B pipeline parallelism the
first stage holds p micro-batches of its L/p blocks, the same total (the paper's observation).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..parallel.blocks import find_blocks
from ..parallel.expert_modules import experts_per_token, find_experts
from .memory_terms import PRECISIONS as PRECISIONS
from .memory_terms import STRATEGIES, Precision
from .memory_terms import format_bytes as format_bytes


class TargetError(ValueError):
    """A `module:factory` target that cannot be turned into an nn.Module."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model; `layers`/`hidden` are None when it is no transformer."""

    parameters: int
    trainable_parameters: int
    blocks: str | None = None  # qualified name of the block list
    layers: int | None = None
    hidden: int | None = None
    vocab: int | None = None
    largest_unit: int | None = None  # parameters FSDP2 gathers at once (see zero_gathered_unit_bytes)
    block_linear_outputs: int | None = None  # one block's Linear output widths summed (selective AC keeps)
    block_parameters: int | None = None  # of one block (the casts activation checkpointing does not keep)
    expert_parameters: int = 0  # in mixture-of-experts experts modules (parallel/expert_modules.py)
    experts: int = 0  # experts per MoE layer
    expert_layers: int = 0  # MoE layers (experts modules)
    experts_per_token: int = 0  # top-k: experts each token is computed by
    # fine-tuning with frozen weights (None: as if every parameter trained, for shapes written by hand)
    backward_parameters: int | None = None  # from the first trainable one on: what backward passes through
    block_trainable_parameters: int | None = None  # the most trainable parameters of one block
    root_trainable_parameters: int | None = None  # trainable parameters outside the blocks

    @property
    def reached_parameters(self) -> int:
        """Parameters backward passes through (`backward_parameters`; all when not given)."""
        return self.parameters if self.backward_parameters is None else self.backward_parameters

    @property
    def trainable_fraction(self) -> float:
        return self.trainable_parameters / self.parameters if self.parameters else 0.0

    @property
    def largest_unit_trainable(self) -> int:
        """The most trainable parameters of one FSDP2 unit (a block, or the root): the gradients a unit holds
        whole before its reduce-scatter. Not given: the largest unit's share of the trainable parameters."""
        if self.block_trainable_parameters is None or self.root_trainable_parameters is None:
            unit = self.largest_unit or self.parameters
            return math.ceil(unit * self.trainable_fraction)
        return max(self.block_trainable_parameters, self.root_trainable_parameters)

    def describe_trainable(self) -> str:
        """'trainable 0.09% (65.5M of 70.6B)': the share of the parameters with requires_grad=True."""
        return (
            f"trainable {_percent(self.trainable_fraction)} ({_count(self.trainable_parameters)} of "
            f"{_count(self.parameters)})"
        )

    @property
    def active_parameters(self) -> int:
        """Parameters one token is computed with: every expert's share only for the k experts it goes to."""
        if not self.experts:
            return self.parameters
        return (
            self.parameters
            - self.expert_parameters
            + self.expert_parameters * self.experts_per_token // self.experts
        )


def _count(number: int) -> str:
    """65_536_000 -> '65.5M', 70_553_706_496 -> '70.6B', 4_096 -> '4,096'."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if number >= size:
            return f"{number / size:.1f}{unit}"
    return f"{number:,}"


def _percent(fraction: float) -> str:
    """Two significant figures below 1% (0.09%), whole or one decimal above (12.5%, 100%)."""
    if fraction in (0.0, 1.0) or fraction >= 0.1:
        return f"{fraction:.0%}" if fraction in (0.0, 1.0) else f"{fraction:.1%}"
    return f"{fraction * 100:.2g}%"


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device for one precision and one strategy."""

    precision: str
    strategy: str
    estimate: bool
    parameters: int
    gradients: int
    optimizer: int
    activations: int | None

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + (self.activations or 0)


@dataclass(frozen=True)
class MemoryEstimate:
    shape: ModelShape
    devices: int
    micro_batch_size: int | None
    seq_len: int | None
    rows: tuple[DeviceMemory, ...]
    notes: tuple[str, ...]


def load_factory(target: str) -> Callable[[], object]:
    """Resolve `module:factory` (dotted module or .py file path) to the callable it names.

    A dotted module resolves against the current directory too (as with `python -m`); a file's own
    folder becomes importable (as with `python file.py`), so a wrapper can `from model import GPT`.
    """
    module_part, colon, attribute = target.rpartition(":")
    if not colon or not module_part or not attribute:
        raise TargetError(
            f"TARGET {target!r} is not of the form module:factory. Name a module or .py file and a "
            "callable in it that returns an nn.Module, e.g. examples/gpt/my_model.py:build."
        )
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise TargetError(f"TARGET {target!r}: file {module_part!r} does not exist.")
        name = "_unison_target_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        if os.path.dirname(path) not in sys.path:
            sys.path.insert(0, os.path.dirname(path))
        sys.modules[name] = module  # dataclasses in the file look their module up here
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            del sys.modules[name]
            raise TargetError(f"TARGET {target!r}: importing {module_part!r} failed: {error!r}") from error
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as error:
            raise TargetError(
                f"TARGET {target!r}: module {module_part!r} not found ({error}). Give a dotted module "
                "importable from the current directory or a path to a .py file."
            ) from error
    factory = getattr(module, attribute, None)
    if factory is None:
        raise TargetError(f"TARGET {target!r}: {module_part!r} has no attribute {attribute!r}.")
    if not callable(factory):
        raise TargetError(f"TARGET {target!r}: {attribute!r} is a {type(factory).__name__}, not callable.")
    return factory


def build_on_meta(target: str) -> nn.Module:
    """Call the target's factory with no arguments on the meta device: shapes only, no memory."""
    factory = load_factory(target)
    try:
        required = [
            p.name
            for p in inspect.signature(factory).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
    except (TypeError, ValueError):  # builtins without a signature: just try the call
        required = []
    if required:
        raise TargetError(
            f"TARGET {target!r}: the factory needs arguments ({', '.join(required)}) but is called with "
            "none. Write a small wrapper, e.g. `def build(): return GPT(GPTConfig(n_layer=32))`, and "
            "point TARGET at it."
        )
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:
        raise TargetError(
            f"TARGET {target!r}: calling the factory on the meta device raised {error!r}. The factory "
            "must only build the module (no data-dependent code, no loading of weights)."
        ) from error
    if not isinstance(model, nn.Module):
        raise TargetError(
            f"TARGET {target!r}: the factory returned a {type(model).__name__}, not an nn.Module."
        )
    return model


def inspect_model(model: nn.Module) -> ModelShape:
    """Parameter counts (tied weights once, as `model.parameters()` yields them) and transformer shape.

    A model counts as a transformer when its block list's blocks hold a module whose class name says
    attention (or nn.MultiheadAttention); the hidden size is the first Linear's input size in a block.
    A mixture of experts also gets its experts' parameters, count and top-k (`moe_shape`).
    """
    return dataclasses.replace(_dense_shape(model), **moe_shape(model))


def moe_shape(model: nn.Module) -> dict[str, int]:
    """ModelShape's expert fields of `model` (all 0 for a dense model)."""
    found = find_experts(model)
    if not found:
        return {}
    counts = [next(iter(module.parameters(recurse=False))).shape[0] for _, module in found]
    return {
        "expert_parameters": sum(p.numel() for _, module in found for p in module.parameters(recurse=False)),
        "experts": max(counts),
        "expert_layers": len(found),
        "experts_per_token": experts_per_token(model) or 1,
    }


def _dense_shape(model: nn.Module) -> ModelShape:
    parameters = list(model.parameters())
    total = sum(p.numel() for p in parameters)
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    first = next((i for i, p in enumerate(parameters) if p.requires_grad), len(parameters))
    frozen = {"backward_parameters": sum(p.numel() for p in parameters[first:])}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = max((m.num_embeddings for m in embeddings), default=None)
    found = find_blocks(model)
    if found is None:
        return ModelShape(total, trainable, vocab=vocab, **frozen)
    name, blocks = found
    block_parameters = sum(p.numel() for p in blocks.parameters()) // len(blocks)
    unit = max(block_parameters, total - block_parameters * len(blocks))  # a block, or the root
    per_block = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks]
    frozen["block_trainable_parameters"] = max(per_block)
    frozen["root_trainable_parameters"] = max(0, trainable - sum(per_block))  # (a weight tied across: once)
    block = blocks[0]
    has_attention = any(
        isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower()
        for m in block.modules()
    )
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    if not has_attention or not linears:
        return ModelShape(total, trainable, blocks=name, vocab=vocab, largest_unit=unit, **frozen)
    outputs = sum(m.out_features for m in linears)
    hidden = linears[0].in_features
    return ModelShape(
        total, trainable, name, len(blocks), hidden, vocab, unit, outputs, block_parameters, **frozen
    )


def model_state_bytes(
    strategy: str, precision: Precision, parameters: int, trainable: int, devices: int
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per device: the table in design.md §3."""
    full = (
        precision.param_bytes * parameters,
        precision.grad_bytes * trainable,
        precision.optimizer_bytes * trainable,
    )
    param_shard = math.ceil(parameters / devices) * precision.param_bytes
    grad_shard = math.ceil(trainable / devices) * precision.grad_bytes
    optim_shard = math.ceil(trainable / devices) * precision.optimizer_bytes
    if strategy in ("single", "ddp"):
        return full
    if strategy == "zero1":
        return full[0], full[1], optim_shard
    if strategy == "zero2":
        gathered = precision.gathered_bytes * parameters
        master = param_shard if precision.gathered_bytes < precision.param_bytes else 0
        return gathered + master, grad_shard, optim_shard
    if strategy in ("zero3", "tp", "pp"):
        return param_shard, grad_shard, optim_shard
    if strategy == "zero3_offload":
        return 0, 0, 0  # all of it in host memory: host_bytes
    if strategy == "zero2_offload":  # the gathered copy stays on the device from forward to backward
        return precision.gathered_bytes * parameters, 0, 0
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {[s for s, _, _ in STRATEGIES]}")


def zero_gathered_unit_bytes(
    strategy: str, precision: Precision, unit_parameters: int, unit_trainable: int | None = None
) -> tuple[int, int]:
    """(parameter, gradient) bytes a device holds beyond its shards under unison's FSDP2 ZeRO-2/3.

    FSDP2 shards per unit (each block, then the root: everything outside the blocks) and a unit's
    gradients are whole until its reduce-scatter; under ZeRO-3 its parameters are whole while it
    computes too. So the largest unit adds that much to the ZeRO paper's per-device formulas. Both
    `unison estimate-memory` and `unison plan` add it, from here. Only trainable parameters have
    gradients: `unit_trainable` is the most any unit has (default: all `unit_parameters`), which under
    LoRA is a block's adapters while the largest unit by parameters is the frozen root.
    """
    grads = (unit_parameters if unit_trainable is None else unit_trainable) * precision.grad_bytes
    if strategy in ("zero2", "zero2_offload"):
        return 0, grads
    if strategy in ("zero3", "zero3_offload"):
        return unit_parameters * precision.gathered_bytes, grads
    return 0, 0


def host_bytes(strategy: str, precision: Precision, parameters: int, trainable: int, devices: int) -> int:
    """Host memory per device's process for its offloaded shards: (p + g + o)Ψ/N under offload, else 0."""
    if not strategy.endswith("_offload"):
        return 0
    return sum(model_state_bytes("zero3", precision, parameters, trainable, devices))


def autocast_copy_bytes(precision: Precision, computed_reached: int, strategy: str = "ddp") -> int:
    """Autocast's 16-bit weight copies saved for backward (module docstring), for the parameters a device
    computes with that backward passes through (ModelShape.reached_parameters: all of them in full
    training, frozen ones too under LoRA, since the input gradient of a frozen matmul needs its weight):
    all of them under DDP and ZeRO-1, its share under TP and PP, none under ZeRO-2/3 (FSDP2 gathers the
    weights in the compute dtype already)."""
    if strategy.startswith(("zero2", "zero3")):
        return 0
    return precision.autocast_copy_bytes * computed_reached


def activation_bytes(
    shape: ModelShape,
    micro_batch_size: int,
    seq_len: int,
    element_bytes: int,
    tensor_parallel: int = 1,
    attention_heads: int | None = None,
) -> int:
    """Korthikanti et al. 2022 per-block activations × blocks, plus the fp32 logits (module docstring)."""
    if shape.layers is None or shape.hidden is None:
        raise ValueError("activations are estimated for transformers only; this model has no block list")
    sbh = seq_len * micro_batch_size * shape.hidden
    e, t = element_bytes, tensor_parallel
    per_layer = sbh * (4 * e + 2) + sbh * 12 * e / t
    if attention_heads:
        per_layer += attention_heads * seq_len**2 * micro_batch_size * (2 * e + 1) / t
    logits = 4 * seq_len * micro_batch_size * shape.vocab / t if shape.vocab else 0
    return math.ceil(per_layer * shape.layers + logits)
