"""Tensor-parallel plans that Hugging Face `transformers` models carry, as DTensor parallel styles.

transformers ships a plan on most decoders' configs (`config.base_model_tp_plan`, plus the head in the
model class's `_tp_plan`); a model object exposes the merged plan, with its own module paths, as
`model.tp_plan`: {"model.layers.*.self_attn.q_proj": "colwise", ...}. Its styles are names that
transformers maps onto its own classes (transformers.distributed.tensor_parallel, 5.x); here each
dense style becomes the torch style that computes the same thing:

| transformers | here |
| --- | --- |
| colwise | ColwiseParallel(): weight rows split, the output stays split over the last dim |
| colwise_gather_output, colwise_rep | ColwiseParallel(output_layouts=Replicate()) |
| rowwise | RowwiseParallel(): the input split over its last dim, the partial sums all-reduced |
| rowwise_split_input, rowwise_rep | RowwiseParallel(input_layouts=Replicate()): a whole input, split here |
| embedding_rowwise | RowwiseParallel(input_layouts=Replicate()) on the vocabulary |
| embedding_colwise | ColwiseParallel(output_layouts=Replicate()) on the embedding dim |
| packed_colwise (a Linear) | FusedColwiseParallel(parts=2): gate and up packed side by side |
| replicated_with_grad_allreduce | `ReplicatedOverShards`: a norm of this rank's heads (q_norm, k_norm) |
| (no entry) | `ReplicatedOverShards`: parameters between split projections (Apertus's xIELU) |
| replicate | no entry: replicated, as everything outside the plan |

The mixture-of-experts styles (moe_tp_experts, moe_identity_expert, packed_* on 3-D expert weights,
all_reduce of shared experts, mla_kv_a_proj, local_params) are refused by name: unison does not shard
experts inside tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from .fused import FusedColwiseParallel
from .module_names import join_names


class ReplicatedOverShards(ParallelStyle):
    """A module with replicated parameters applied to this rank's share of a column-split activation
    (its heads for a per-head norm such as Qwen3's q_norm, its hidden units for an activation with
    parameters such as Apertus's xIELU), row- or element-wise over the last dim: the parameters become
    replicated DTensors and the input is declared sharded over dim 0, so each parameter's gradient is
    summed over the ranks (each saw another share), as transformers' replicated_with_grad_allreduce
    does. Any dim but the last gives that sum; dim 0 is the one every input has."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_parameters, _shard_input, _local_output)


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for parameter_name, parameter in list(module.named_parameters(recurse=False)):
        replicated = DTensor.from_local(parameter.data, mesh, [Replicate()], run_check=False)
        module.register_parameter(parameter_name, nn.Parameter(replicated, parameter.requires_grad))


def _shard_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    first, *rest = inputs
    if not isinstance(first, DTensor):
        first = DTensor.from_local(first, mesh, [Shard(0)], run_check=False)
    return (first, *rest)


def _local_output(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local() if isinstance(output, DTensor) else output


_DENSE_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise": lambda: RowwiseParallel(),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda: ReplicatedOverShards(),
}
_EXPERT_STYLES = {"moe_tp_experts", "moe_identity_expert", "packed_rowwise", "all_reduce", "mla_kv_a_proj"}


def carried_plan(model: nn.Module) -> dict[str, str]:
    """The plan a transformers model carries (`model.tp_plan`), keyed by `model`'s module paths; {} for
    any other model.

    A wrapper that forwards attribute reads to the model it wraps (PEFT's PeftModel answers `tp_plan`
    for the transformers model it holds at `base_model.model`) gives that model's plan, whose keys name
    modules from there: they are prefixed with the path of the module that holds the plan."""
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, Mapping) or not all(isinstance(v, str) for v in plan.values()):
        return {}
    if not _holds_plan(model):
        for name, module in model.named_modules():
            if name and _holds_plan(module) and module.tp_plan == plan:
                return {join_names(name, pattern): style for pattern, style in plan.items()}
    return dict(plan)


def _holds_plan(module: nn.Module) -> bool:
    """Whether `tp_plan` is the module's own attribute or its class's, not one it forwards."""
    return "tp_plan" in vars(module) or any("tp_plan" in vars(kind) for kind in type(module).__mro__)


def translate_plan(model: nn.Module, carried: Mapping[str, str]) -> dict[str, ParallelStyle]:
    """`carried` (transformers style names) as torch parallel styles for `model`; entries that match
    none of its modules are dropped (a plan written for the whole model, applied to a pipeline stage),
    and modules with parameters that sit between split projections without an entry get
    ReplicatedOverShards (see `_between_split_projections`).

    Raises ValueError naming every entry it cannot apply (its pattern and style, or the parameter it
    names), before anything is sharded."""
    modules = dict(model.named_modules())
    parameters = {name for name, _ in model.named_parameters()}
    plan: dict[str, ParallelStyle] = {}
    refused: list[str] = []
    for pattern, style in carried.items():
        matched = [name for name in modules if name and fnmatch(name, pattern)]
        on_parameters = [name for name in parameters if fnmatch(name, pattern)]
        if style == "replicate" or not (matched or on_parameters):
            continue
        if on_parameters and not matched:
            refused.append(f"{pattern!r}: {style!r} on a parameter (e.g. {on_parameters[0]})")
        elif style == "packed_colwise":
            if all(isinstance(modules[name], nn.Linear) for name in matched):
                plan[pattern] = FusedColwiseParallel(parts=2)
            else:
                refused.append(f"{pattern!r}: {style!r} on {type(modules[matched[0]]).__name__}")
        elif style in _DENSE_STYLES:
            plan[pattern] = _DENSE_STYLES[style]()
        else:
            kind = "a mixture-of-experts style" if style in _EXPERT_STYLES else "a style unison does not know"
            refused.append(f"{pattern!r}: {style!r} ({kind})")
    for pattern, module in _between_split_projections(model, plan):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            refused.append(f"{pattern!r}: no entry, but it sits between split projections")
        else:
            plan[pattern] = ReplicatedOverShards()
    if refused:
        raise ValueError(
            f"{type(model).__name__} carries a tensor-parallel plan from transformers (model.tp_plan) with "
            f"entries unison cannot apply: {'; '.join(refused)}. Tensor parallelism here splits dense layers "
            "only (colwise, rowwise, their gather/split variants, embeddings, packed_colwise on a Linear, "
            "replicated_with_grad_allreduce): divide the experts of a mixture-of-experts model with expert "
            "parallelism (parallelism='ep_size=N', docs/expert-parallel.md) or shard them with ZeRO "
            "(parallelism='dp_shard_size=N'), or pass tp_plan= with the dense entries only."
        )
    return plan


def _between_split_projections(
    model: nn.Module, plan: Mapping[str, ParallelStyle]
) -> list[tuple[str, nn.Module]]:
    """(pattern, module) of the modules with parameters of their own that the plan leaves out although
    they sit in a module whose projections it splits by columns (not gathered again): they compute on
    each rank's share, so their gradients are partial (xIELU's alpha beside a column-split up_proj).
    This assumes they run after the split, never on the module's whole input (they would then get the
    gradient tp times): true of every transformers model with a plan that builds at tiny sizes, which
    tests/test_tp_transformers_plans.py runs against one process."""
    planned = {
        id(module) for pattern in plan for name, module in model.named_modules() if fnmatch(name, pattern)
    }
    split_parents = set()
    for pattern, style in plan.items():
        if isinstance(style, ColwiseParallel) and style.output_layouts == (Shard(-1),):
            split_parents |= {
                name.rpartition(".")[0] for name, _ in model.named_modules() if fnmatch(name, pattern)
            }
    found: dict[str, nn.Module] = {}
    for parent in sorted(split_parents - {""}):
        for child_name, child in model.get_submodule(parent).named_children():
            if id(child) not in planned and any(True for _ in child.parameters(recurse=False)):
                name = f"{parent}.{child_name}"
                found.setdefault(".".join("*" if part.isdigit() else part for part in name.split(".")), child)
    return list(found.items())
