"""Expert parallelism (`ep_size`): each mixture-of-experts layer's experts divided over the processes of
the data-parallel dimension, tokens sent to their experts and back by all-to-all.

What is recognised as experts is the module transformers 5 gives every mixture of experts it ships
(Mixtral, Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V3, ...) and unison's example GPT: one module holding every
expert's weights as 3-D tensors (`[experts, out, in]`) whose forward takes `(hidden_states, top_k_index,
top_k_weights)`, the router's choice for each token. The router, the shared experts and everything else
stay with the data-parallel engine (ZeRO-2/3 over dp_shard); only the experts module changes:

1. Its parameters become DTensors sharded by expert over `ep` (process j of an EP group holds experts
   [j E/ep, (j+1) E/ep)), then FSDP2 shards each process's experts over `ep_replicate` (the dp / ep EP
   groups side by side, which hold the same experts: torchtitan's placement), as ZeRO-2/3 shards the
   rest over dp_shard. Their names and global shapes are the model's: a checkpoint saved under EP loads
   on one process and back (DCP reshards).
2. Its forward is replaced on the instance (not the class) by `ExpertParallelForward`: each process sorts
   its own tokens' (token, expert) pairs by expert, sends each pair to the process holding that expert
   (`all_to_all_single` with uneven splits: capacity-free, no token dropped), runs the model's own expert
   code on what it received with its local experts only, sends the results back and combines them with
   the router's weights in the order the model's own loop adds them (expert by expert).
3. Gradients: an expert's gradient on its process sums the contributions of its EP group's tokens;
   FSDP2 sums it over `ep_replicate` and divides by the whole data-parallel degree (its gradient divide
   factor), so every parameter gets what one process over the whole batch computes, and accumulation
   skips that reduction as it skips the others'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from .expert_modules import check_expert_parallel


def expert_mesh(ep_size: int, device_type: str) -> DeviceMesh:
    """The (ep_replicate, ep) mesh: consecutive data-parallel ranks form an EP group, the groups side by
    side replicate each other. Collective: every process calls it (it forms process groups)."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("ep_replicate", "ep"))
    # the whole mesh as one dimension too: a norm over the experts' gradients (clipping) then reduces in
    # one all-reduce instead of one per dimension (private, as in mesh.py; tests/test_torch_private_apis.py)
    mesh._flatten("ep_all")
    return mesh


def apply_expert_parallel(
    model: nn.Module, mesh: DeviceMesh, dp_size: int, reshard_after_forward: bool
) -> None:
    """Divide every experts module of `model` over `mesh["ep"]` and shard each process's experts with
    FSDP2 over `mesh["ep_replicate"]`; run before the data-parallel engine, which then leaves them alone.

    `dp_size`: the processes whose gradients are averaged (the experts' gradients are divided by it);
    `reshard_after_forward`: ZeRO-3's (True) or ZeRO-2's (False) handling of the experts' shards.
    """
    ep_mesh = mesh["ep"]
    ep_size = ep_mesh.size()
    for _, module in check_expert_parallel(model, ep_size):
        for name, parameter in list(module.named_parameters(recurse=False)):
            local = parameter.detach().chunk(ep_size, dim=0)[ep_mesh.get_local_rank()].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=parameter.requires_grad))
        module.forward = ExpertParallelForward(module, ep_mesh)
        fully_shard(module, mesh=mesh["ep_replicate"], reshard_after_forward=reshard_after_forward)
        # FSDP2 sums over the EP groups that hold these experts; each group's gradient already sums its
        # processes' tokens, so dividing by the whole data-parallel degree gives the average over all
        module.set_gradient_divide_factor(float(dp_size))
        if ep_mesh.device_type == "cpu" and mesh["ep_replicate"].size() > 1:
            # gloo has no pre-multiplied sum: sum, then divide. Only where the sum runs: over one process
            # torch 2.13's FSDP2 then divides twice (the copy that stands in for the collective divides,
            # and so does the division after it), which put gradients 2x too small at ep_size = dp
            module.set_force_sum_reduction_for_comms(True)


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


class _ClassForward(nn.Module):
    """Runs an experts module's class forward without the module's own __call__: FSDP2's hooks on it have
    run already for the call being served, and `torch.func.functional_call` swaps the weights through
    this holder ("experts.<name>") for the local slices."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, *args: Any) -> torch.Tensor:
        return type(self.experts).forward(self.experts, *args)


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
        self.holder = _ClassForward(module)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        module = self.module
        local = {name: p.to_local() for name, p in module.named_parameters(recurse=False)}
        experts = next(iter(module.parameters(recurse=False))).shape[0]
        per_process = experts // self.ep_size
        k = top_k_index.shape[1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # (token, slot) pairs, expert by expert
        token_of = order // k
        counts = torch.bincount(chosen, minlength=experts)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # [source, local expert]
        # rows to and from each process of the group, read to the host in one sync
        per_peer = torch.stack((counts, received_counts)).view(2, self.ep_size, per_process).sum(2)
        send, receive = per_peer.tolist()
        arrived = _AllToAll.apply(hidden_states[token_of], send, receive, self.group)
        local_expert = torch.arange(per_process, device=chosen.device).repeat(self.ep_size)
        local_index = local_expert.repeat_interleave(received_counts)[:, None]
        ones = torch.ones(local_index.shape, dtype=top_k_weights.dtype, device=top_k_weights.device)
        computed = self._run_local_experts(local, arrived, local_index, ones, per_process)
        if not len(arrived):
            # no token came (a model's loop that visits only the experts with tokens computes nothing):
            # tie the empty result to the empty arrival and to the weights all the same, so this process
            # takes part in both backward all-to-alls and its weights get a (zero) gradient, as FSDP2's
            # reduce-scatter over the EP groups needs on every process
            computed = computed + (arrived.sum() + sum(weight.sum() for weight in local.values())) * 0
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
        try:
            if had_count:
                module.num_experts = count
            weights_of = {f"experts.{name}": tensor for name, tensor in local.items()}
            return torch.func.functional_call(self.holder, weights_of, (tokens, index, weights))
        finally:
            if had_count:
                module.num_experts = saved

    def __repr__(self) -> str:
        return f"ExpertParallelForward(ep_size={self.ep_size})"
