"""Expert parallelism (`ep_size`): each mixture-of-experts layer's experts divided over the processes of
the data-parallel dimension, tokens sent to their experts and back by all-to-all.

What is recognised as experts is the module transformers 5 gives every mixture of experts it ships
(Mixtral, Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V3, ...) and unison's example GPT: one module holding every
expert's weights as 3-D tensors (`[experts, out, in]`) whose forward takes `(hidden_states, top_k_index,
top_k_weights)`, the router's choice for each token. The router, the shared experts and everything else
stay with the data-parallel engine (ZeRO-2/3 over dp_shard); only the experts module changes:

1. Its parameters become DTensors on a 2-D mesh (`ep_replicate`, `ep`): `Shard(0)` over `ep` (process j
   of an EP group holds experts [j E/ep, (j+1) E/ep)) and replicated over `ep_replicate` (dp / ep groups
   of EP, one beside the other, as torchtitan places them). Their names and global shapes are the
   model's: a checkpoint saved under EP loads on one process and back (DCP reshards).
2. Its forward is replaced on the instance (not the class) by `ExpertParallelForward`: each process sorts
   its own tokens' (token, expert) pairs by expert, sends each pair to the process holding that expert
   (`all_to_all_single` with uneven splits: capacity-free, no token dropped), runs the model's own expert
   code on what it received with its local experts only, sends the results back and combines them with
   the router's weights in the order the model's own loop adds them (expert by expert).
3. Gradients: an expert's gradient on its process sums the contributions of its EP group's tokens,
   where the other parameters' gradients are averaged over the data-parallel processes; a hook divides
   it by the data-parallel degree as it arrives, and at the end of a window's backward the replicas of
   each expert (over `ep_replicate`) are summed (`synchronise_expert_replicas`), so every parameter
   gets what one process over the whole batch computes.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

logger = logging.getLogger("unison")

EXPERT_ARGUMENTS = ("top_k_index", "top_k_weights")
"""What an experts module's forward takes beside the tokens (transformers 5's experts interface)."""

_EXPERT_PARALLEL = "_unison_expert_parallel"
"""Set on an experts module expert parallelism was applied to: its `ExpertParallelForward`."""


def is_experts_module(module: nn.Module) -> bool:
    """True for a module that holds every expert's weights and routes by `top_k_index`/`top_k_weights`."""
    try:
        parameters = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in EXPERT_ARGUMENTS) and any(
        True for _ in module.parameters(recurse=False)
    )


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every experts module of `model`, in model order."""
    return [(name, module) for name, module in model.named_modules() if is_experts_module(module)]


def check_expert_parallel(model: nn.Module, ep_size: int) -> list[tuple[str, nn.Module]]:
    """The experts modules `ep_size` divides, or a ValueError naming what cannot be divided and why.

    A pure function of the model: every process reaches the same verdict before any communication.
    """
    found = find_experts(model)
    if not found:
        lists = [name for name, m in model.named_modules() if name.endswith("experts")]
        seen = f" It has {', '.join(lists[:3])}, but as separate expert modules." if lists else ""
        raise ValueError(
            f"ep_size={ep_size}: {type(model).__name__} has no experts module unison can divide.{seen} "
            "Expert parallelism recognises a module holding every expert's weights as tensors of "
            "[experts, ...] whose forward takes (hidden_states, top_k_index, top_k_weights), as "
            "transformers 5's mixtures of experts (Mixtral, Qwen2-MoE, OLMoE, ...) and examples/gpt's "
            "MoE block have. Drop ep_size, or use such a module (docs/expert-parallel.md)."
        )
    for name, module in found:
        counts = {
            param_name: (tuple(p.shape)[0] if p.dim() >= 2 else None)
            for param_name, p in module.named_parameters(recurse=False)
        }
        experts = set(counts.values())
        if len(experts) != 1 or None in experts:
            shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in module.named_parameters(recurse=False))
            raise ValueError(
                f"ep_size={ep_size}: {name} ({type(module).__name__}) has parameters {shapes}, which do not "
                "all lead with the number of experts, so they cannot be divided by expert. Expert "
                "parallelism needs every parameter of an experts module to be [experts, ...]."
            )
        (count,) = experts
        if count % ep_size:
            raise ValueError(
                f"ep_size={ep_size} does not divide the {count} experts of {name}: each process of an EP "
                "group holds the same number of experts. Choose an ep_size that divides {count}."
            )
    return found


def expert_mesh(ep_size: int, device_type: str) -> DeviceMesh:
    """The (ep_replicate, ep) mesh: consecutive data-parallel ranks form an EP group, the groups side by
    side replicate each other. Collective: every process calls it (it forms process groups)."""
    world = dist.get_world_size()
    return init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("ep_replicate", "ep"))


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, dp_size: int) -> set[nn.Parameter]:
    """Divide every experts module of `model` over `mesh["ep"]`; returns the new expert parameters (which
    the data-parallel engine must leave alone). `dp_size`: the processes whose gradients are averaged."""
    ep_size = mesh["ep"].size()
    placed: set[nn.Parameter] = set()
    for _, module in check_expert_parallel(model, ep_size):
        for name, parameter in list(module.named_parameters(recurse=False)):
            local = parameter.detach().chunk(ep_size, dim=0)[mesh["ep"].get_local_rank()].clone()
            sharded = nn.Parameter(
                DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False),
                requires_grad=parameter.requires_grad,
            )
            if sharded.requires_grad and dp_size > 1:
                sharded.register_hook(_divide_by(dp_size))
            module.register_parameter(name, sharded)
            placed.add(sharded)
        forward = ExpertParallelForward(module, mesh)
        setattr(module, _EXPERT_PARALLEL, forward)
        module.forward = forward
    return placed


def _divide_by(count: int):
    def divide(grad: torch.Tensor) -> torch.Tensor:
        return grad / count

    return divide


def synchronise_expert_replicas(models: list[nn.Module]) -> None:
    """Sum each expert's gradient over the EP groups that hold a copy of it (`ep_replicate`): each holds
    its group's tokens' share, already divided by the data-parallel degree.

    Call after the backward that ends an accumulation window, on every process. Nothing to do when
    ep_size is the whole data-parallel degree (one copy of each expert).
    """
    for parameter in _expert_parameters(models):
        if parameter.grad is None:
            continue
        mesh = parameter.device_mesh
        replicas = mesh["ep_replicate"]
        if replicas.size() > 1:
            # each replica's gradient is already divided by the whole data-parallel degree: their sum
            # is the average over every process's tokens
            dist.all_reduce(parameter.grad.to_local(), group=replicas.get_group())


def _expert_parameters(models: list[nn.Module]) -> Iterator[nn.Parameter]:
    for model in models:
        for module in model.modules():
            if getattr(module, _EXPERT_PARALLEL, None) is not None:
                yield from module.parameters(recurse=False)


def has_expert_parallel(model: nn.Module) -> bool:
    """True when expert parallelism was applied to some module of `model`."""
    return any(getattr(module, _EXPERT_PARALLEL, None) is not None for module in model.modules())


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits whose backward sends the gradients back the same way.

    torch.distributed.nn.functional.all_to_all_single does this but is deprecated (for a functional
    collective that is private); this is the same few lines over the public `dist.all_to_all_single`."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        received = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), receive, send, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        returned = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(returned, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return returned, None, None, None


class ExpertParallelForward:
    """The forward of an experts module under expert parallelism (see the module docstring).

    Called with the model's own arguments: `hidden_states` [tokens, hidden], `top_k_index` and
    `top_k_weights` [tokens, k]. The model's own expert code runs through `torch.func.functional_call`
    with this process's slices of the weights (and `num_experts` set to their count for that call), on
    the tokens received, each with weight 1; the router's weights are applied after the tokens return.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.module = module
        self.group = mesh["ep"].get_group()
        self.ep_size = mesh["ep"].size()
        self.inside = False  # set while the model's own forward runs on the local experts

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        module = self.module
        if self.inside:
            return type(module).forward(module, hidden_states, top_k_index, top_k_weights)
        local = {name: p.to_local() for name, p in module.named_parameters(recurse=False)}
        experts = next(iter(module.parameters(recurse=False))).shape[0]
        per_process = experts // self.ep_size
        tokens, k = top_k_index.shape
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # (token, slot) pairs, expert by expert
        token_of = order // k
        counts = torch.bincount(chosen, minlength=experts)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # [source, local expert]
        send = counts.view(self.ep_size, per_process).sum(1).tolist()
        receive = received_counts.view(self.ep_size, per_process).sum(1).tolist()
        arrived = _AllToAll.apply(hidden_states[token_of], send, receive, self.group)
        local_expert = torch.arange(per_process, device=chosen.device).repeat(self.ep_size)
        local_index = local_expert.repeat_interleave(received_counts)[:, None]
        ones = torch.ones(local_index.shape, dtype=top_k_weights.dtype, device=top_k_weights.device)
        computed = self._run_local_experts(local, arrived, local_index, ones, per_process)
        # every process takes part in both backward all-to-alls, and every local weight gets a gradient
        # (zero where no token came), even when no token arrived here
        computed = computed + sum(weight.sum() for weight in local.values()) * 0
        returned = _AllToAll.apply(computed, receive, send, self.group)
        weighted = returned * top_k_weights.reshape(-1)[order, None]
        combined = torch.zeros_like(hidden_states)
        return combined.index_add_(0, token_of, weighted.to(combined.dtype))

    def _run_local_experts(
        self,
        local: dict[str, torch.Tensor],
        tokens: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor,
        count: int,
    ) -> torch.Tensor:
        module = self.module
        had_count = "num_experts" in vars(module)
        saved = vars(module).get("num_experts")
        self.inside = True
        try:
            if had_count:
                module.num_experts = count
            return torch.func.functional_call(module, local, (tokens, index, weights))
        finally:
            self.inside = False
            if had_count:
                module.num_experts = saved

    def __repr__(self) -> str:
        return f"ExpertParallelForward(ep_size={self.ep_size})"
