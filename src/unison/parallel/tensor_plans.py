"""Which tensor-parallel plan a model gets when none is given: the one a Hugging Face model carries
(`transformers_plans`), else the built-in plan of a layout recognised by its module names (GPT/GPT-2,
Llama), with sequence and loss parallel; a model with neither is shown a plan in its own names.

docs/tensor-parallel.md explains the styles each layout gets and why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from .fused import FusedColwiseParallel
from .module_names import join_names, leaf_name
from .tensor_adapters import base_of
from .transformers_plans import carried_plan, translate_plan

logger = logging.getLogger("unison")

PLAN_EXAMPLE = (
    "tp_plan={'layers.*.attn.q': ColwiseParallel(), 'layers.*.attn.out': RowwiseParallel(), "
    "'layers.*.ffn.up': ColwiseParallel(), 'layers.*.ffn.down': RowwiseParallel()} "
    "(styles from torch.distributed.tensor.parallel; use unison.parallel.tensor.FusedColwiseParallel "
    "for a projection whose output is several blocks side by side, such as a fused q|k|v)"
)


def _module_patterns(model: nn.Module) -> dict[str, nn.Module]:
    """Module-name pattern (block indices as '*') -> one module with that pattern."""
    patterns: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name:
            pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
            patterns.setdefault(pattern, module)
    return patterns


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def _find(patterns: Mapping[str, nn.Module], leaf: str, in_blocks: bool | None = None) -> list[str]:
    """Patterns whose last name is `leaf` (inside a block list, outside it, or either)."""
    return [p for p in patterns if leaf_name(p) == leaf and (in_blocks is None or ("*" in p) == in_blocks)]


def _require_types(patterns: Mapping[str, nn.Module], wanted: Mapping[str, type]) -> None:
    for pattern, kind in wanted.items():
        module = base_of(patterns[pattern])  # a PEFT adapter's wrapper is planned as its base layer
        if not isinstance(module, kind):
            raise ValueError(
                f"{pattern} is a {type(module).__name__}, but the built-in tensor-parallel plan needs an "
                f"nn.{kind.__name__} there (Hugging Face GPT-2, for one, uses Conv1D). Pass your own plan, "
                f"{example_plan(patterns)}"
            )


# Leaf module names of each layout: the attention and MLP projections (the first one locates the
# parent module), the two norms of a block, and the modules outside the block list.
_LAYOUTS: dict[str, dict[str, dict[str, str]]] = {
    "gpt": {
        "attention": {"qkv": "c_attn", "attention_out": "c_proj"},
        "mlp": {"mlp_in": "c_fc", "mlp_out": "c_proj"},
        "norms": {"norm_attention": "ln_1", "norm_mlp": "ln_2"},
        "top": {"embedding": "wte", "position_embedding": "wpe", "final_norm": "ln_f", "head": "lm_head"},
    },
    "llama": {
        "attention": {"q": "q_proj", "k": "k_proj", "v": "v_proj", "attention_out": "o_proj"},
        "mlp": {"gate": "gate_proj", "up": "up_proj", "mlp_out": "down_proj"},
        "norms": {"norm_attention": "input_layernorm", "norm_mlp": "post_attention_layernorm"},
        "top": {"embedding": "embed_tokens", "final_norm": "norm", "head": "lm_head"},
    },
}


def _roles(patterns: Mapping[str, nn.Module], names: dict[str, dict[str, str]]) -> dict[str, str] | None:
    """Role -> module pattern when every projection of the layout is there, else None."""
    roles: dict[str, str] = {}
    for group in ("attention", "mlp"):
        found = _find(patterns, next(iter(names[group].values())), in_blocks=True)
        if len(found) != 1:
            return None
        roles[group] = parent = _parent(found[0])
        for role, leaf in names[group].items():
            if join_names(parent, leaf) not in patterns:
                return None
            roles[role] = join_names(parent, leaf)
    block = _parent(roles["attention"])
    roles.update(
        {
            r: join_names(block, leaf)
            for r, leaf in names["norms"].items()
            if join_names(block, leaf) in patterns
        }
    )
    for role, leaf in names["top"].items():
        found = _find(patterns, leaf, in_blocks=False)
        if len(found) == 1:
            roles[role] = found[0]
    return roles


def detect_layout(model: nn.Module) -> tuple[str, dict[str, str], dict[str, nn.Module]]:
    patterns = _module_patterns(model)
    for layout, names in _LAYOUTS.items():
        roles = _roles(patterns, names)
        if roles is not None:
            return layout, roles, patterns
    raise ValueError(
        f"{type(model).__name__} carries no tensor-parallel plan (transformers' model.tp_plan) and matches "
        "no built-in layout (GPT/GPT-2 names attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj; Llama names "
        f"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj). Pass your own plan, "
        f"{example_plan(patterns)}"
    )


def example_plan(patterns: Mapping[str, nn.Module]) -> str:
    """An example plan in the model's own module names: the projections of its repeated block, in order,
    the first split by columns and the last by rows (else the generic example)."""
    blocks: dict[str, list[str]] = {}
    for pattern, module in patterns.items():
        if "*" in pattern and type(module).__name__ in ("Linear", "Conv1D"):
            blocks.setdefault(pattern[: pattern.index("*") + 1], []).append(pattern)
    if not blocks or len(projections := next(iter(blocks.values()))) < 2:
        return f"e.g. {PLAN_EXAMPLE}."
    conv1d = any(type(patterns[name]).__name__ == "Conv1D" for name in projections)
    return (
        f"naming its block's projections, which are, in order, {projections}: split by columns "
        "(ColwiseParallel()) those whose outputs another projection takes, by rows (RowwiseParallel()) "
        f"those that combine them, e.g. tp_plan={{{projections[0]!r}: ColwiseParallel(), ..., "
        f"{projections[-1]!r}: RowwiseParallel()}} (styles from torch.distributed.tensor.parallel"
        + ("; a Conv1D stores its weight transposed: replace it by an nn.Linear first" if conv1d else "")
        + ")."
    )


def _check_sequence_parallel_roles(
    model: nn.Module, layout: str, roles: dict[str, str], patterns: Mapping[str, nn.Module]
) -> None:
    """Sequence parallel must know every module that sees the residual stream whole.

    A norm or embedding the plan missed would compute on sequence shards with replicated weights:
    silently wrong gradients. A pipeline stage legitimately lacks the embedding (it receives sequence
    shards from the previous stage) or the final norm and head (it sends them on), so those may be
    absent when the stage has no module of their kind at all.
    """
    missing = [role for role in ("norm_attention", "norm_mlp") if role not in roles]
    embeddings = [p for p, m in patterns.items() if isinstance(m, nn.Embedding) and "*" not in p]
    if "embedding" not in roles and embeddings:
        missing.append(f"embedding (the model has {embeddings}, not named as the {layout} layout's)")
    if "final_norm" not in roles and "head" in roles:
        missing.append("final_norm (before lm_head)")
    if missing:
        raise ValueError(
            f"sequence_parallel=True needs every norm and the token embedding of the {layout} layout, but "
            f"{type(model).__name__} has no module for {missing}. Use sequence_parallel=False or pass "
            "your own plan."
        )


def tensor_parallel_plan(
    model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The plan unison applies when none is given, to apply or to edit.

    A Hugging Face transformers model that carries its own plan (`model.tp_plan`) gets that plan,
    translated (`transformers_plans`); other models, and any model asked for `sequence_parallel` or
    `loss_parallel` (which transformers' plans do not describe), the built-in plan for their layout
    (GPT/GPT-2 or Llama names). `sequence_parallel`: norms and the residual stream split over the
    sequence (dim 1) between the parallel regions. `loss_parallel`: the head returns logits as a DTensor
    sharded over the vocabulary (cross-entropy and backward then go inside `loss_parallel()`). A model
    that matches no layout raises ValueError showing the shape of a plan to pass instead.
    """
    carried = carried_plan(model)
    if carried and sequence_parallel:
        raise ValueError(
            f"sequence_parallel=True cannot split {type(model).__name__}, a transformers model: its decoder "
            "computes the rotary position tables and the causal mask from the hidden states it holds, which "
            "sequence parallelism cuts to this process's share of the sequence (positions 0.. on every "
            "process). The built-in sequence-parallel plans are for the GPT example's and "
            "examples/llama's models, whose positions cover the whole sequence. Use sequence_parallel=False "
            "(tensor parallelism from the model's own plan)."
        )
    if carried and not (sequence_parallel or loss_parallel):
        plan = translate_plan(model, carried)
        if not plan:  # never split nothing in silence
            raise ValueError(
                f"{type(model).__name__} carries a tensor-parallel plan (model.tp_plan) whose keys name none "
                f"of its modules: it expected modules such as {sorted(carried)[:4]}, and the model's are "
                f"named like {[n for n, _ in model.named_modules() if n][:4]}. Pass tp_plan= in the "
                f"model's own names, {example_plan(_module_patterns(model))}"
            )
        return plan
    layout, roles, patterns = detect_layout(model)
    rep, seq = Replicate(), Shard(1)
    between = seq if sequence_parallel else rep  # layout of the residual stream outside the blocks' matmuls
    if sequence_parallel:
        _check_sequence_parallel_roles(model, layout, roles, patterns)
    if loss_parallel and "head" not in roles:  # e.g. a pipeline stage before the last: nothing to shard
        logger.warning(
            "loss_parallel=True: %s has no module named lm_head, so its logits are not sharded.",
            type(model).__name__,
        )
    linear = nn.Linear
    plan: dict[str, ParallelStyle] = {}
    if "embedding" in roles:
        _require_types(patterns, {roles["embedding"]: nn.Embedding})
        plan[roles["embedding"]] = RowwiseParallel(input_layouts=rep, output_layouts=between)
    if "position_embedding" in roles:
        _require_types(patterns, {roles["position_embedding"]: nn.Embedding})
        # positions are a (T,) vector: its sequence dim is 0
        plan[roles["position_embedding"]] = RowwiseParallel(
            input_layouts=rep, output_layouts=Shard(0) if sequence_parallel else rep
        )
    if sequence_parallel:
        plan[roles["norm_attention"]] = SequenceParallel()
        plan[roles["norm_mlp"]] = SequenceParallel()
        if "final_norm" in roles:
            plan[roles["final_norm"]] = SequenceParallel()
        plan[roles["attention"]] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,))
        plan[roles["mlp"]] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,))
    if layout == "gpt":
        _require_types(patterns, {roles[r]: linear for r in ("qkv", "attention_out", "mlp_in", "mlp_out")})
        plan[roles["qkv"]] = FusedColwiseParallel(parts=3)
        plan[roles["mlp_in"]] = ColwiseParallel()
    else:
        _require_types(patterns, {roles[r]: linear for r in ("q", "k", "v", "attention_out", "gate", "up")})
        for role in ("q", "k", "v", "gate", "up"):
            plan[roles[role]] = ColwiseParallel()
    plan[roles["attention_out"]] = RowwiseParallel(output_layouts=between)
    plan[roles["mlp_out"]] = RowwiseParallel(output_layouts=between)
    if "head" in roles:
        _require_types(patterns, {roles["head"]: linear})
        plan[roles["head"]] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else rep,
            use_local_output=not loss_parallel,
        )
    return plan
