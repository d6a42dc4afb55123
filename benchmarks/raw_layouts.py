"""The GPT example's training step in each parallel layout, written with raw torch APIs only.

benchmarks/strategies.py runs these beside the same step through unison (`Accelerator(parallelism=...)`,
`accumulate`, `forward_backward`) in the same processes, to measure what unison's wrapping costs. Each
builder does what a user without unison would write, torchtitan-style, with the same arithmetic as
unison's layout: the same model and initial weights, the same blocks sharded, the same split, the same
optimizer, the same micro-batches.

- DDP: `DistributedDataParallel(model)`.
- ZeRO-2 / ZeRO-3: `fully_shard` on every block, then on the root, `reshard_after_forward` False / True.
- TP: `parallelize_module` with the Megatron plan (embeddings and head split over the vocabulary,
  column- then row-parallel projections), the tied embedding re-tied after it. The fused q|k|v
  projection has its rows permuted once, before sharding, so that a plain column split gives rank r
  its heads of q, k and v (the model's `chunk(3)` then splits them), as unison's `FusedColwiseParallel`
  does at prepare().
- PP: one stage module per rank holding the model's own blocks (the first with the embeddings, the
  last with the final norm and the head), `PipelineStage` + `Schedule1F1B`; the weight tied between
  the first and the last stage has its gradient all-reduced over those two ranks after each step, as
  Megatron does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""One optimizer step on (inputs, targets); returns the loss (detached, on the ranks that have it)."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _plain_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits, _ = model(x)
        loss = cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def ddp(model: nn.Module) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(model)
    return _plain_step(model, adamw(model))


def zero(model: nn.Module, stage: int) -> Step:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
    return _plain_step(model, adamw(model))


@torch.no_grad()
def _interleave_qkv(linear: nn.Linear, tp: int) -> None:
    """Permute the rows of a fused q|k|v Linear so that its i-th of `tp` row blocks is [q_i; k_i; v_i]."""
    for tensor in (linear.weight, linear.bias):
        if tensor is None:
            continue
        q, k, v = (part.chunk(tp) for part in tensor.chunk(3))
        tensor.copy_(torch.cat([torch.cat((q[i], k[i], v[i])) for i in range(tp)]))


def tensor_parallel(model: nn.Module, tp: int) -> Step:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    for block in model.transformer.h:
        _interleave_qkv(block.attn.c_attn, tp)
    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        "transformer.wpe": RowwiseParallel(input_layouts=Replicate()),
        "transformer.h.*.attn.c_attn": ColwiseParallel(),
        "transformer.h.*.attn.c_proj": RowwiseParallel(),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.transformer.wte.weight  # each style made its own copy: tie them again
    return _plain_step(model, adamw(model))


class _Stage(nn.Module):
    """Blocks [start, end) of the GPT example, with the embeddings on the first stage and the final
    norm and head on the last: the model's own modules, its forward cut where the stage ends."""

    def __init__(self, model: nn.Module, start: int, end: int):
        super().__init__()
        blocks = model.transformer.h
        self.first, self.last = start == 0, end == len(blocks)
        if self.first:
            top = model.transformer
            self.wte, self.wpe, self.drop = top.wte, top.wpe, top.drop
        self.h = nn.ModuleList(blocks[start:end])
        if self.last:
            self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.size(1), dtype=torch.long, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def pipeline(model: nn.Module, starts: list[int], microbatches: int) -> Step:
    """One stage per rank, stage s holding blocks [starts[s], starts[s + 1]); Schedule1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, size = dist.get_rank(), dist.get_world_size()
    ends = [*starts[1:], len(model.transformer.h)]
    stage = _Stage(model, starts[rank], ends[rank])
    tied = model.lm_head.weight  # wte on the first stage, lm_head on the last: one weight on two ranks
    holders = [0, size - 1]
    tie_group = dist.new_group(holders) if size > 2 else None  # every rank creates it, as torch asks
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    device = torch.device("cpu")
    schedule = Schedule1F1B(PipelineStage(stage, rank, size, device), microbatches, loss_fn=cross_entropy)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if stage.first:
            schedule.step(x)
        elif stage.last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if rank in holders:  # the tied weight: the sum of both stages' gradients, as on one device
            dist.all_reduce(tied.grad, group=tie_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean() if losses else torch.full((), float("nan"))

    step.blocks = [f"transformer.h.{i}" for i in range(starts[rank], ends[rank])]  # type: ignore[attr-defined]
    return step
