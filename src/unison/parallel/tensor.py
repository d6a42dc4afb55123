"""Tensor parallelism (Megatron-style) as plain functions over a module, on DTensor `parallelize_module`.

A plan maps module-name patterns ("transformer.h.*.attn.c_proj") to torch's parallel styles: each
block's first projections are column-parallel (a rank computes its share of the heads / hidden units),
the second ones row-parallel (partial sums, one all-reduce per sub-layer). `tensor_parallel_plan`
(`tensor_plans`) gives the plan a model gets when it passes none: the one a Hugging Face model carries,
or the built-in plan of a layout recognised by its module names; `check_tensor_parallel`
(`tensor_checks`) refuses a plan that cannot work before any communication; this module applies it.
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

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from .fused import FusedColwiseParallel, permute_fused_projections
from .module_names import matching_modules
from .tensor_checks import check_tensor_parallel, retie, tied_locations
from .tensor_plans import tensor_parallel_plan

logger = logging.getLogger("unison")

__all__ = [
    "FusedColwiseParallel",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "keep_gradients_in_parameter_layout",
    "matching_modules",
    "tensor_parallel_plan",
    "total_grad_norm",
]
"""The public names of tensor parallelism, those of tensor_plans and tensor_checks included."""


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


def _keep_frozen(model: nn.Module, frozen: set[str]) -> None:
    """Freeze again the parameters that were frozen (a fine-tuned model's base) and that a style replaced:
    torch's SequenceParallel (and `distribute_module`'s default) registers `nn.Parameter(DTensor)`, which
    requires grad, so a frozen norm would get gradients, enter the clipping norm and leave the frozen set
    without a word."""
    for name, param in model.named_parameters():
        if name in frozen and param.requires_grad:
            param.requires_grad_(False)


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
    tied = tied_locations(model)
    fused = {
        name: (module, style.parts)
        for pattern, style in plan.items()
        if isinstance(style, FusedColwiseParallel)
        for name, module in matching_modules(model, pattern)
    }
    permute_fused_projections(fused, tp)  # then the plain column split gives each rank its heads
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    _keep_frozen(model, frozen)
    retie(model, tied)
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
