"""Tensor parallelism (Megatron-style) as plain functions over a module, on DTensor `parallelize_module`.

A plan maps module-name patterns ("transformer.h.*.attn.c_proj") to torch's parallel styles: each
block's first projections are column-parallel (a rank computes its share of the heads / hidden units),
the second ones row-parallel (partial sums, one all-reduce per sub-layer). `tensor_parallel_plan`
builds that plan for the layouts it recognises by their module names; any other model passes its own.
docs/tensor-parallel.md explains the choices; in short:

- Fused q|k|v (GPT-2's `c_attn`, split with `chunk(3, dim=-1)`): rank r must compute q_r, k_r and v_r,
  where a plain column split would give rank 0 the first 3E/T rows. `FusedColwiseParallel` marks such
  a projection; its rows are permuted once, before the plan is applied, so that the plain split gives
  each rank [q_r|k_r|v_r] (`unison.parallel.fused`): no weight traffic in forward or backward, and its
  state dicts translate back, so checkpoints hold the original layout.
- The token embedding (`RowwiseParallel`) and the head (`ColwiseParallel`) are both split over the
  vocabulary, rows `Shard(0)` of the same matrix, so a tied pair is re-tied as one parameter.
  `loss_parallel=True` leaves the logits a vocabulary-sharded DTensor: the cross-entropy and its
  backward must then run inside `torch.distributed.tensor.parallel.loss_parallel()`.
- Sequence parallel splits the norms and the residual stream over the sequence, turning each
  activation all-reduce into a reduce-scatter + all-gather.

Every rank of a TP group must see the same batch. Replicated parameters (norms, what the plan leaves
out) are broadcast from the group's first rank. For FSDP2 on top, apply this first on `mesh["tp"]`,
then `unison.parallel.zero.apply_zero(model, stage, mesh=mesh["dp_shard"])` on the same root mesh.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from fnmatch import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from .fused import FusedColwiseParallel, permute_fused_projections
from .transformers_plans import carried_plan, translate_plan

logger = logging.getLogger("unison")

_PLAN_EXAMPLE = (
    "tp_plan={'layers.*.attn.q': ColwiseParallel(), 'layers.*.attn.out': RowwiseParallel(), "
    "'layers.*.ffn.up': ColwiseParallel(), 'layers.*.ffn.down': RowwiseParallel()} "
    "(styles from torch.distributed.tensor.parallel; use unison.parallel.tensor.FusedColwiseParallel "
    "for a projection whose output is several blocks side by side, such as a fused q|k|v)"
)


# ----------------------------------------------------------------------------------------------------
# Built-in layouts, recognised by module names


def _module_patterns(model: nn.Module) -> dict[str, nn.Module]:
    """Module-name pattern (block indices as '*') -> one module with that pattern."""
    patterns: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name:
            pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
            patterns.setdefault(pattern, module)
    return patterns


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def _leaf(pattern: str) -> str:
    return pattern.rpartition(".")[2]


def _find(patterns: Mapping[str, nn.Module], leaf: str, in_blocks: bool | None = None) -> list[str]:
    """Patterns whose last name is `leaf` (inside a block list, outside it, or either)."""
    return [p for p in patterns if _leaf(p) == leaf and (in_blocks is None or ("*" in p) == in_blocks)]


def _require_types(patterns: Mapping[str, nn.Module], wanted: Mapping[str, type]) -> None:
    for pattern, kind in wanted.items():
        module = patterns[pattern]
        if not isinstance(module, kind):
            raise ValueError(
                f"{pattern} is a {type(module).__name__}, but the built-in tensor-parallel plan needs an "
                f"nn.{kind.__name__} there (Hugging Face GPT-2, for one, uses Conv1D). Pass your own plan, "
                f"{_example_plan(patterns)}"
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
            if _join(parent, leaf) not in patterns:
                return None
            roles[role] = _join(parent, leaf)
    block = _parent(roles["attention"])
    roles.update(
        {r: _join(block, leaf) for r, leaf in names["norms"].items() if _join(block, leaf) in patterns}
    )
    for role, leaf in names["top"].items():
        found = _find(patterns, leaf, in_blocks=False)
        if len(found) == 1:
            roles[role] = found[0]
    return roles


def _detect_layout(model: nn.Module) -> tuple[str, dict[str, str], dict[str, nn.Module]]:
    patterns = _module_patterns(model)
    for layout, names in _LAYOUTS.items():
        roles = _roles(patterns, names)
        if roles is not None:
            return layout, roles, patterns
    raise ValueError(
        f"{type(model).__name__} carries no tensor-parallel plan (transformers' model.tp_plan) and matches "
        "no built-in layout (GPT/GPT-2 names attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj; Llama names "
        f"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj). Pass your own plan, "
        f"{_example_plan(patterns)}"
    )


def _example_plan(patterns: Mapping[str, nn.Module]) -> str:
    """An example plan in the model's own module names: the projections of its repeated block, in order,
    the first split by columns and the last by rows (else the generic example)."""
    blocks: dict[str, list[str]] = {}
    for pattern, module in patterns.items():
        if "*" in pattern and type(module).__name__ in ("Linear", "Conv1D"):
            blocks.setdefault(pattern[: pattern.index("*") + 1], []).append(pattern)
    if not blocks or len(projections := next(iter(blocks.values()))) < 2:
        return f"e.g. {_PLAN_EXAMPLE}."
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
    if carried and not (sequence_parallel or loss_parallel):
        return translate_plan(model, carried)
    layout, roles, patterns = _detect_layout(model)
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


# ----------------------------------------------------------------------------------------------------
# Validation (pure: the same answer on every rank, before any communication)


def matching_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs `parallelize_module` applies `pattern` to: fnmatch per name part."""
    found = [("", model)]
    for token in pattern.split("."):
        found = [
            (_join(prefix, name), child)
            for prefix, module in found
            for name, child in module.named_children()
            if fnmatch(name, token)
        ]
    return found


def _split_size(style: ParallelStyle, module: nn.Module) -> tuple[str, int, int] | None:
    """(what, size, equal blocks in it) that `style` splits over the TP ranks; None if nothing."""
    if isinstance(module, nn.Linear):
        if isinstance(style, FusedColwiseParallel):
            return "out_features (each fused block)", module.out_features, style.parts
        if isinstance(style, ColwiseParallel):
            return "out_features", module.out_features, 1
        if isinstance(style, RowwiseParallel):
            return "in_features", module.in_features, 1
    if isinstance(module, nn.Embedding):
        if isinstance(style, ColwiseParallel):
            return "embedding_dim", module.embedding_dim, 1
        if isinstance(style, RowwiseParallel):
            return "num_embeddings (vocabulary)", module.num_embeddings, 1
    return None


def _config_value(model: nn.Module, *names: str) -> int | None:
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _head_counts(
    model: nn.Module, attention: nn.Module, layout: str, roles: dict[str, str]
) -> dict[str, int]:
    """Query and key/value heads of one attention module, from its projections and head_dim."""
    head_dim = getattr(attention, "head_dim", None)
    if layout == "gpt":
        qkv = attention.get_submodule(_leaf(roles["qkv"]))
        width = qkv.out_features // 3
        if isinstance(head_dim, int) and head_dim > 0:
            return {"heads": width // head_dim}
        heads = _config_value(model, "n_head", "num_attention_heads")
        return {"heads": heads} if heads else {}
    q = attention.get_submodule(_leaf(roles["q"]))
    k = attention.get_submodule(_leaf(roles["k"]))
    if isinstance(head_dim, int) and head_dim > 0:
        return {"heads": q.out_features // head_dim, "key/value heads": k.out_features // head_dim}
    counts = {
        "heads": _config_value(model, "num_attention_heads", "n_heads"),
        "key/value heads": _config_value(model, "num_key_value_heads", "n_kv_heads"),
    }
    return {name: value for name, value in counts.items() if value}


def _check_heads(model: nn.Module, plan: Mapping[str, ParallelStyle], tp: int) -> None:
    """A known layout whose attention projections the plan shards: tp must divide the head counts."""
    try:
        layout, roles, _ = _detect_layout(model)
    except ValueError:
        return  # a user plan for a layout we do not know: the size checks are all we can do
    projections = ("qkv",) if layout == "gpt" else ("q", "k", "v")
    sharded = {id(module) for pattern in plan for _, module in matching_modules(model, pattern)}
    if not any(id(m) in sharded for role in projections for _, m in matching_modules(model, roles[role])):
        return
    for name, attention in matching_modules(model, roles["attention"]):
        counts = _head_counts(model, attention, layout, roles)
        if not counts:
            logger.warning(
                "tensor parallel: could not find the number of heads of %s (no head_dim attribute or "
                "config); only the projection sizes were checked against tp=%d.",
                name,
                tp,
            )
            return
        for what, count in counts.items():
            if count % tp:
                raise ValueError(
                    f"tensor parallel degree tp={tp} must divide the number of attention {what}, but {name} "
                    f"has {count}: each rank computes whole heads. Choose tp among "
                    f"{[d for d in range(1, count + 1) if count % d == 0]}, or a model with more heads."
                )


def _check_plan(model: nn.Module, plan: Mapping[str, ParallelStyle], tp: int) -> None:
    if not isinstance(plan, Mapping) or not all(
        isinstance(k, str) and isinstance(v, ParallelStyle) for k, v in plan.items()
    ):
        raise TypeError(
            f"plan={plan!r} is not a tensor-parallel plan: pass a dict from module name pattern to a "
            f"torch ParallelStyle, e.g. {_PLAN_EXAMPLE}."
        )
    problems = []
    for pattern, style in plan.items():
        matched = matching_modules(model, pattern)
        if not matched:
            raise ValueError(
                f"plan key {pattern!r} matches no submodule of {type(model).__name__}. Keys are qualified "
                "module names, '*' matching one name part (e.g. 'transformer.h.*.mlp.c_fc'); fix the name."
            )
        for name, module in matched:
            split = _split_size(style, module)
            if split is not None and split[1] % (split[2] * tp):
                what, size, blocks = split
                share = f"{blocks} blocks of {size // blocks}" if blocks > 1 else str(size)
                problems.append(f"{name} ({type(style).__name__}): {what} = {share}")
    if problems:
        raise ValueError(
            f"tensor parallel degree tp={tp} must divide every size the plan splits, but these do not: "
            f"{'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}. Choose a tp that divides "
            "them, pad the sizes (e.g. the vocabulary to a multiple of tp, as nanoGPT's 50304), or leave "
            "those modules out of the plan."
        )


def _tied_locations(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, parameter name) that hold one shared parameter (e.g. wte and lm_head)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _retie(model: nn.Module, groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each tied group one parameter again after the styles replaced its members separately."""
    names = {id(module): name or type(model).__name__ for name, module in model.named_modules()}
    for group in groups:
        params = [getattr(module, attr) for module, attr in group]
        layouts = [
            (p.device_mesh, p.placements) if isinstance(p, DTensor) else "not distributed" for p in params
        ]
        if any(layout != layouts[0] for layout in layouts[1:]):
            described = ", ".join(
                f"{names[id(m)]}.{attr}: {lay[1] if isinstance(lay, tuple) else lay}"
                for (m, attr), lay in zip(group, layouts)
            )
            raise ValueError(
                f"tied parameter ({described}) got different layouts from the plan, so it would split into "
                "independent copies. Give every module sharing it the same layout (the built-in plans shard "
                "both the embedding (RowwiseParallel) and the head (ColwiseParallel) over the vocabulary) "
                "or leave all of them out of the plan."
            )
        for module, attr in group[1:]:
            setattr(module, attr, params[0])


def _check_ties(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> None:
    """A shared parameter's modules must be all in the plan or all out of it, else it would split."""
    planned = {id(module) for pattern in plan for _, module in matching_modules(model, pattern)}
    names = {id(module): name for name, module in model.named_modules()}
    for group in _tied_locations(model):
        inside = [f"{names[id(m)]}.{attr}" for m, attr in group if id(m) in planned]
        outside = [f"{names[id(m)]}.{attr}" for m, attr in group if id(m) not in planned]
        if inside and outside:
            raise ValueError(
                f"{', '.join(inside)} and {', '.join(outside)} are one tied parameter, but the plan covers "
                "only the first. Shard all of them alike (the built-in plans shard the embedding with "
                "RowwiseParallel and the head with ColwiseParallel, both over the vocabulary) or none."
            )


def check_tensor_parallel(
    model: nn.Module, tp_size: int, plan: Mapping[str, ParallelStyle] | None = None
) -> dict[str, ParallelStyle]:
    """Validate `plan` (None: the built-in one) for `model` at degree `tp_size` and return it.

    Pure and the same on every rank, so a layout that cannot work fails before any communication:
    every key must name submodules, every size a style splits must divide by `tp_size` (a fused
    projection per block), tied parameters must be sharded alike, and for a known layout whose
    attention is split, `tp_size` must divide the query and key/value head counts.
    """
    if plan is None:
        plan = tensor_parallel_plan(model)
    _check_plan(model, plan, tp_size)
    _check_heads(model, plan, tp_size)
    _check_ties(model, plan)
    return dict(plan)


# ----------------------------------------------------------------------------------------------------
# Applying a plan


@torch.no_grad()
def _broadcast_replicated(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Copy what every TP rank holds in full (norms, biases, unplanned modules) from the group's rank 0.

    Sharded parameters were scattered from rank 0 by the styles; replicated ones are used as each rank
    built them, so without this a model initialised differently per rank would train inconsistently.
    """
    group = tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if isinstance(tensor, DTensor):
            if not all(isinstance(p, Replicate) for p in tensor.placements):
                continue
            tensor = tensor.to_local()
        dist.broadcast(tensor.data, src=source, group=group)


def keep_gradients_in_parameter_layout(model: nn.Module) -> None:
    """Store each DTensor parameter's gradient in the parameter's own placements.

    DTensor's embedding backward returns a Replicate gradient for a vocabulary-sharded (Shard(0))
    table, which would keep a full-size gradient, and a full-size optimizer state built from it, on
    every rank (and under pipeline parallelism, a tied copy's gradient of another size than the other
    stage's). Replicate -> Shard is a local slice, so the redistribution costs no communication.

    Parameters on the meta device are skipped: materialising one (`to_empty`) gives it new storage,
    and autograd's hook goes with the old one, while its record on the parameter stays and keeps a
    later registration from taking effect. A model sharded on meta calls this after materialising
    (unison.parallel.materialize).
    """

    def hook(param: torch.Tensor) -> None:
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)

    for param in {id(p): p for p in model.parameters()}.values():
        if isinstance(param, DTensor) and param.requires_grad and not param.is_meta:
            param.register_post_accumulate_grad_hook(hook)


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients together, as one plain tensor, for any mix of layouts.

    `torch.nn.utils.clip_grad_norm_` refuses a TP model: it stacks per-gradient norms, and a model
    holds plain tensors (what the plan leaves replicated) beside DTensors, or (under FSDP2 x TP)
    DTensors on two meshes. Here the norms are taken per mesh (one collective each) and the plain
    gradients, identical on every rank that holds them, are counted once. Scale the gradients by
    `max_norm / (norm + 1e-6)` clamped to 1 to clip; a DTensor gradient multiplies by the plain result.
    """
    groups: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for param in {id(p): p for p in parameters}.values():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param.grad)
    norms = []
    for grads in groups.values():  # torch's foreach norm: one kernel per group, not one per gradient
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    return torch.nn.utils.get_total_norm(norms, norm_type)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Mapping[str, ParallelStyle] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh` (e.g. `mesh["tp"]`) and return it.

    `plan`: module-name pattern -> ParallelStyle; None builds the built-in plan for the model's layout
    with `sequence_parallel` / `loss_parallel` (see `tensor_parallel_plan`). A given plan is used as
    it is, so those two flags must stay False with it. Sizes and head counts are checked against the
    TP degree before any communication. The model must be on its device; build the optimizer after
    (and give it to `unison.parallel.fused.keep_user_layout_in_optimizer`, as prepare() does, for
    checkpoints of its state in the model's original layout).
    """
    if plan is not None and (sequence_parallel or loss_parallel):
        raise ValueError(
            f"sequence_parallel={sequence_parallel}, loss_parallel={loss_parallel} choose the built-in plan, "
            "but a plan was given and is used as it is. Build it with tensor_parallel_plan(model, "
            "sequence_parallel=..., loss_parallel=...) and edit it, or leave both flags False."
        )
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"tp_mesh has {tp_mesh.ndim} dimensions {tp_mesh.mesh_dim_names}; tensor parallelism runs over "
            "one. Pass the tensor-parallel sub-mesh, e.g. mesh['tp']."
        )
    tp = tp_mesh.size()
    if plan is None:
        plan = tensor_parallel_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    plan = check_tensor_parallel(model, tp, plan)
    tied = _tied_locations(model)
    fused = {
        name: (module, style.parts)
        for pattern, style in plan.items()
        if isinstance(style, FusedColwiseParallel)
        for name, module in matching_modules(model, pattern)
    }
    permute_fused_projections(fused, tp)  # then the plain column split gives each rank its heads
    parallelize_module(model, tp_mesh, plan)
    _retie(model, tied)
    _broadcast_replicated(model, tp_mesh)
    keep_gradients_in_parameter_layout(model)
    logger.info(
        "tensor parallel: %d plan entries over tp=%d (sequence_parallel=%s, loss_parallel=%s)",
        len(plan),
        tp,
        sequence_parallel,
        loss_parallel,
    )
    return model
