"""Checks of a tensor-parallel plan against a model and a degree, before any communication.

Pure, so every rank reaches the same verdict and a layout that cannot work fails on every rank before
anything is sharded: each key names submodules, each size a style splits divides by the degree, head
counts divide by it where the attention is split, and tied parameters are sharded alike.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from .fused import FusedColwiseParallel
from .module_names import join_names, leaf_name, matching_modules
from .tensor_adapters import base_of, through_adapters
from .tensor_plans import PLAN_EXAMPLE, detect_layout, tensor_parallel_plan

logger = logging.getLogger("unison")


def _split_size(style: ParallelStyle, module: nn.Module) -> tuple[str, int, int] | None:
    """(what, size, equal blocks in it) that `style` splits over the TP ranks; None if nothing."""
    module = base_of(module)  # a PEFT adapter's wrapper splits as its base layer
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
    """The first of `names` that the model's config holds as an int (a transformers config whose layers
    differ refuses a global value with its own error: that reads as absent)."""
    config = getattr(model, "config", None)
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _head_counts(
    model: nn.Module, attention: nn.Module, layout: str, roles: dict[str, str]
) -> dict[str, int]:
    """Query and key/value heads of one attention module, from its projections and head_dim."""
    head_dim = getattr(attention, "head_dim", None)
    if layout == "gpt":
        qkv = base_of(attention.get_submodule(leaf_name(roles["qkv"])))
        width = qkv.out_features // 3
        if isinstance(head_dim, int) and head_dim > 0:
            return {"heads": width // head_dim}
        heads = _config_value(model, "n_head", "num_attention_heads")
        return {"heads": heads} if heads else {}
    q = base_of(attention.get_submodule(leaf_name(roles["q"])))
    k = base_of(attention.get_submodule(leaf_name(roles["k"])))
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
        layout, roles, _ = detect_layout(model)
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
            f"torch ParallelStyle, e.g. {PLAN_EXAMPLE}."
        )
    problems = []
    for pattern, style in plan.items():
        matched = matching_modules(model, pattern)
        if not matched:
            inside = next((n for n, m in model.named_modules() if n and matching_modules(m, pattern)), None)
            hint = (
                f" It names modules of {inside!r} (a wrapper such as PEFT's moves the model there): "
                f"use {join_names(inside, pattern)!r}."
                if inside
                else " Keys are qualified module names, '*' matching one name part (e.g. "
                "'transformer.h.*.mlp.c_fc'); fix the name."
            )
            raise ValueError(f"plan key {pattern!r} matches no submodule of {type(model).__name__}.{hint}")
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


def tied_locations(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, parameter name) that hold one shared parameter (e.g. wte and lm_head)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def retie(model: nn.Module, groups: list[list[tuple[nn.Module, str]]]) -> None:
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
    for group in tied_locations(model):
        inside = [f"{names[id(m)]}.{attr}" for m, attr in group if id(m) in planned]
        outside = [f"{names[id(m)]}.{attr}" for m, attr in group if id(m) not in planned]
        if inside and outside:
            raise ValueError(
                f"{', '.join(inside)} and {', '.join(outside)} are one tied parameter, but the plan covers "
                "only the first. Shard all of them alike (the built-in plans shard the embedding with "
                "RowwiseParallel and the head with ColwiseParallel, both over the vocabulary) or none."
            )


def _check_per_head_parameters(model: nn.Module, plan: Mapping[str, ParallelStyle], tp: int) -> None:
    """A parameter with one value per attention head, in a module whose projections the plan splits by
    columns (each rank then holds heads / tp heads), must be split too: left whole, each rank would
    apply every head's values to its own heads and fail on the shapes, or worse, broadcast them (T5's
    relative position bias, Doge's per-key/value-head A, a per-head gate). Found by shape: a dimension
    equal to the config's query or key/value head count, where that count differs from the head size
    (when they are equal, nothing tells them apart).
    """
    hidden = _config_value(model, "hidden_size", "d_model", "n_embd")
    heads = _config_value(model, "num_attention_heads", "num_heads", "n_head", "n_heads")
    head_size = _config_value(model, "head_dim", "d_kv") or (hidden // heads if hidden and heads else None)
    counts = {
        count: what
        for count, what in (
            (_config_value(model, "num_key_value_heads", "n_kv_heads"), "key/value heads"),
            (heads, "attention heads"),
        )
        if count and count % tp == 0 and count != head_size
    }  # a count tp does not divide: _check_heads refuses the degree already
    if tp == 1 or not counts:
        return
    planned = {id(module) for pattern in plan for _, module in matching_modules(model, pattern)}
    split_by: dict[str, list[str]] = {}  # module whose heads the plan splits -> its split projections
    for pattern, style in plan.items():
        if not isinstance(style, ColwiseParallel) or style.output_layouts != (Shard(-1),):
            continue  # not split by columns, or gathered whole again (colwise_gather_output)
        for name, module in matching_modules(model, pattern):
            parent = name.rpartition(".")[0]
            if isinstance(module, nn.Linear) and parent:
                split_by.setdefault(parent, []).append(leaf_name(name))
    for parent, projections in split_by.items():
        for name, parameter in model.get_submodule(parent).named_parameters():
            owner = name.rpartition(".")[0]
            module = model.get_submodule(join_names(parent, owner) if owner else parent)
            count = next((count for count in counts if count in parameter.shape), None)
            if count is None or _inside_planned(model.get_submodule(parent), owner, planned):
                continue
            how = (
                f" ({join_names(parent, owner)!r}: ColwiseParallel() splits an nn.Embedding's columns)"
                if isinstance(module, nn.Embedding) and module.embedding_dim == count
                else ""
            )
            raise ValueError(
                f"{join_names(parent, name)} {list(parameter.shape)} holds one value per head ({count} "
                f"{counts[count]}), but the plan leaves it whole while it splits the heads of {parent} over "
                f"tp={tp} ({', '.join(projections)} split by columns): each rank would apply all {count} "
                f"heads' values to its own {count // tp}. Add it to the plan split along its heads "
                f"dimension{how}, or leave that attention whole (no plan entries for its projections)."
            )


def _inside_planned(parent: nn.Module, owner: str, planned: set[int]) -> bool:
    """Whether the module at `owner` (under `parent`; "" is `parent` itself) or one of its ancestors
    below `parent` is planned: a PEFT adapter's r-wide A and B inside a planned wrapper are placed with
    it (tensor_adapters). `parent`'s own entry (PrepareModuleInput under sequence parallel) covers only
    its own parameters."""
    parts = owner.split(".") if owner else []
    ends = range(1, len(parts) + 1) if parts else [0]
    return any(id(parent.get_submodule(".".join(parts[:end]))) in planned for end in ends)


def check_tensor_parallel(
    model: nn.Module, tp_size: int, plan: Mapping[str, ParallelStyle] | None = None
) -> dict[str, ParallelStyle]:
    """Validate `plan` (None: the built-in one) for `model` at degree `tp_size` and return it.

    Pure and the same on every rank, so a layout that cannot work fails before any communication:
    every key must name submodules, every size a style splits must divide by `tp_size` (a fused
    projection per block), tied parameters must be sharded alike, and for a known layout whose
    attention is split, `tp_size` must divide the query and key/value head counts, and no parameter of
    one value per head may stay whole beside projections that split the heads. The plan returned is
    the one to apply: entries naming PEFT adapter wrappers become entries for their parts
    (`tensor_adapters`).
    """
    if plan is None:
        plan = tensor_parallel_plan(model)
    _check_plan(model, plan, tp_size)
    _check_heads(model, plan, tp_size)
    _check_per_head_parameters(model, plan, tp_size)
    _check_ties(model, plan)
    return through_adapters(model, plan)
