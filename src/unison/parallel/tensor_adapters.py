"""Tensor parallelism through PEFT's adapter layers: a LoRA-wrapped model splits as its base model does.

PEFT replaces each targeted `nn.Linear` (say `q_proj`) by a wrapper of the same name that holds the
original as `q_proj.base_layer` and, per adapter, `q_proj.lora_A[name]` (in -> r) and
`q_proj.lora_B[name]` (r -> out); its forward is `base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`.
A plan written for the base model (transformers' `tp_plan`, the built-in plans, the user's) names the
wrapper, which has no weight of its own: torch's styles would skip it and nothing would be split. Here
each such entry becomes entries for the wrapper's parts, placed as Megatron-LM's LoRA layers (and
PEFT's `LoraParallelLinear`) place them, so that each rank computes exactly its share of what one
process computes and every parameter's gradient is the whole one:

- Column-parallel base (its output split over out features, its input whole): `lora_A` stays whole on
  every rank (it reads the whole input), `lora_B` is split by columns like the base (a fused q|k|v's
  rows permuted alike), so the adapter's output has the base output's layout. `lora_A`'s gradient is
  whole: `lora_B`'s column split all-reduces the gradient of its input, as the base's does.
- Row-parallel base (its input split over in features): `lora_A` is split by rows, its r-wide output
  all-reduced (r numbers a token: far less than the base's own all-reduce), and `lora_B` reads it
  whole; under sequence parallelism (the output split over the sequence) `lora_B` computes on this
  rank's tokens and its gradient is summed over the ranks (`ReplicatedOverShards`).

Anything else PEFT puts under a planned name is refused by name before anything is sharded: DoRA and
the other LoRA variants (a magnitude per output row, normalised over the whole weight), LoRA on an
embedding, and the other adapter kinds (IA3, LoHa, ...): the run would otherwise split the base and
leave the adapter computing on the wrong shares.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from .fused import FusedColwiseParallel
from .module_names import join_names, matching_modules
from .transformers_plans import ReplicatedOverShards

REFUSAL_ADVICE = (
    "Tensor parallelism splits plain LoRA on nn.Linear layers; leave these modules out of the adapter's "
    "target_modules, or shard the model with ZeRO instead (parallelism='zero3' or "
    "'dp_shard_size=N'), which trains every PEFT adapter kind."
)


class WholeInput(ParallelStyle):
    """A layer kept whole on every rank that reads the whole input of a column-split one: the input may
    arrive as a replicated DTensor (under sequence parallelism the block's hidden states do, from
    PrepareModuleInput), which a plain layer cannot multiply; it computes on the local tensor, which is
    the whole input. Its gradient towards the input is whole on every rank too: lora_B's column split
    all-reduced the gradient of lora_A's output."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(
            lambda _, args: tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
        )
        return module


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether `module` is one of PEFT's adapter wrappers (peft is only consulted once it was imported:
    a model cannot hold its layers otherwise)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def base_of(module: nn.Module) -> nn.Module:
    """The layer an adapter wraps (`base_layer`, through nested wrappers), or `module` itself."""
    while is_adapter_layer(module) and isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def _lora_linear(module: nn.Module) -> bool:
    from peft.tuners.lora import Linear

    return isinstance(module, Linear)


def _unsupported(name: str, module: nn.Module) -> str | None:
    """Why the adapter wrapper `module` (at `name`) cannot be split, or None."""
    if not _lora_linear(module):
        return f"{name} is PEFT's {type(module).__module__}.{type(module).__name__}"
    variants = sorted(getattr(module, "lora_variant", {}) or {})
    if variants or len(getattr(module, "lora_magnitude_vector", None) or {}):
        which = variants or "with a magnitude vector"
        return f"{name} carries a LoRA variant (DoRA or another, on adapters {which})"
    if is_adapter_layer(module.base_layer):
        return f"{name} wraps another adapter ({type(module.base_layer).__name__})"
    return None


def _adapter_styles(name: str, module: nn.Module, style: ParallelStyle) -> dict[str, ParallelStyle]:
    """Plan entries (full module names) for a LoRA-wrapped Linear at `name` planned with `style`."""
    adapters = list(module.lora_A)
    entries: dict[str, ParallelStyle] = {join_names(name, "base_layer"): style}
    if isinstance(style, ColwiseParallel):
        (input_layout,) = style.input_layouts
        for adapter in adapters:
            if input_layout != Replicate():  # the input arrives split: lora_A sees this rank's share
                entries[join_names(name, f"lora_A.{adapter}")] = ReplicatedOverShards()
            else:
                entries[join_names(name, f"lora_A.{adapter}")] = WholeInput()
            if isinstance(style, FusedColwiseParallel):
                part = FusedColwiseParallel(
                    style.parts, input_layouts=input_layout, use_local_output=style.use_local_output
                )
            else:
                part = ColwiseParallel(
                    input_layouts=input_layout,
                    output_layouts=style.output_layouts[0],
                    use_local_output=style.use_local_output,
                )
            entries[join_names(name, f"lora_B.{adapter}")] = part
        return entries
    (output_layout,) = style.output_layouts
    for adapter in adapters:
        entries[join_names(name, f"lora_A.{adapter}")] = RowwiseParallel(
            input_layouts=style.input_layouts[0], output_layouts=output_layout
        )
        if output_layout != Replicate():  # sequence parallel: lora_B computes on this rank's tokens
            entries[join_names(name, f"lora_B.{adapter}")] = ReplicatedOverShards()
    return entries


def _refuse_prompt_learning(model: nn.Module) -> None:
    """Prompt learning (prefix tuning, prompt tuning, p-tuning) feeds the model virtual tokens or, per
    attention layer, key/value states for every head, built outside the model's layers: a
    tensor-parallel attention holds a share of the heads and would get all of them."""
    try:
        config = model.active_peft_config  # a PeftModel's; other modules have none
    except (AttributeError, KeyError):
        return
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(config.peft_type, "value", config.peft_type)
        raise ValueError(
            f"tensor parallelism cannot split {type(model).__name__}: its PEFT adapter is prompt learning "
            f"({kind}), whose virtual tokens or key/value states cover every attention head, "
            "while each tensor-parallel process computes a share of the heads. Train it with ZeRO "
            "(parallelism='zero3' or 'dp_shard_size=N') or plain data parallelism instead."
        )


def _as_pattern(text: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in text.split("."))


def through_adapters(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` with every entry that names PEFT adapter wrappers replaced by entries for their parts
    (see the module docstring); a plan that names none comes back as it is. Raises ValueError naming
    every wrapper it cannot split, before anything is sharded."""
    if "peft" not in sys.modules:
        return dict(plan)
    _refuse_prompt_learning(model)
    result: dict[str, ParallelStyle] = {}
    refused: list[str] = []
    for pattern, style in plan.items():
        matched = matching_modules(model, pattern)
        wrapped = [(name, module) for name, module in matched if is_adapter_layer(module)]
        if not wrapped:
            result[pattern] = style
            continue
        for name, module in matched:  # module by module: a pattern may match wrapped and plain layers
            if not is_adapter_layer(module):
                result[name] = style
            elif not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                refused.append(f"{name} ({type(style).__name__} on an adapter wrapper)")
            elif reason := _unsupported(name, module):
                refused.append(reason)
            elif not style.use_local_output and isinstance(style, RowwiseParallel):
                refused.append(f"{name} (RowwiseParallel with use_local_output=False)")
            else:
                result.update(_adapter_styles(name, module, style))
    if refused:  # one line per kind of layer: block indices as '*'
        kinds = list(dict.fromkeys(_as_pattern(reason) for reason in refused))
        raise ValueError(
            f"tensor parallelism cannot split these PEFT adapter layers of {type(model).__name__}: "
            f"{'; '.join(kinds[:6])}{' ...' if len(kinds) > 6 else ''}. {REFUSAL_ADVICE}"
        )
    return result
