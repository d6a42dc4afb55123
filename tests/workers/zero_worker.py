"""Launched worker: ZeRO-1/2/3 (unison.parallel.zero) against a single-process reference, and memory.

Each run trains a tiny GPT (examples/gpt/model.py) for STEPS steps on a global batch of GLOBAL_BATCH
sequences split evenly over the processes, with `accumulation` micro-steps per step (the non-final
ones under `skip_gradient_sync`). Every process also trains the same model alone on the whole global
batch (the reference) and compares `full_state_dict(model, all_ranks=True)` with it.

Memory (AdamW runs, fp32): per-rank bytes of parameters + gradients + optimizer state, from the local
shards (DTensor.to_local(), ZeroRedundancyOptimizer's local optimizer state). For ZeRO-2 the
parameters counted are the gathered ones that forward leaves in place for backward (what the formula's
4Ψ counts); the persistent 4Ψ/N shards FSDP2 keeps beside them are reported as `param_shard_bytes`.

Process 0 writes a JSON report to the path given as the first argument.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_gpt import local_bytes, make_optimizer, make_tiny_gpt, optimizer_state_bytes, unique_params
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from unison import Accelerator, PartialState
from unison.parallel.ddp import skip_gradient_sync
from unison.parallel.zero import apply_zero, full_state_dict, shard_optimizer_state

STEPS = 5
GLOBAL_BATCH = 4
BLOCK = 16
SEED = 1234


def make_model() -> torch.nn.Module:
    return make_tiny_gpt(SEED, BLOCK)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 32, (STEPS, GLOBAL_BATCH, BLOCK + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def reference(optimizer_name: str) -> dict[str, torch.Tensor]:
    model = make_model()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    for x, y in batches():
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def sync_was_skipped(model: torch.nn.Module) -> bool:
    """After a backward under skip_gradient_sync: did no gradient communication happen?

    FSDP2 leaves the sharded `.grad` unset until a synchronised backward reduce-scatters; under DDP's
    no_sync each rank's gradient is its own micro-batch's, so the ranks' gradients differ.
    """
    if isinstance(model, DistributedDataParallel):
        grad = next(model.parameters()).grad
        grads = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(grads, grad)
        return not torch.equal(grads[0], grads[1])
    return all(p.grad is None for p in model.parameters())


def run(stage: int, optimizer_name: str, accumulation: int, rank: int, world: int) -> dict:
    model = apply_zero(make_model(), stage)
    if stage == 1:
        optimizer = shard_optimizer_state(make_optimizer(optimizer_name, model.parameters()))
    else:
        optimizer = make_optimizer(optimizer_name, model.parameters())
    per_rank = GLOBAL_BATCH // world
    micro = per_rank // accumulation
    gathered_param_bytes = 0
    skipped_sync = None  # only runs with accumulation > 1 have a skipped micro-step
    for x, y in batches():
        x = x[rank * per_rank : (rank + 1) * per_rank]
        y = y[rank * per_rank : (rank + 1) * per_rank]
        for k in range(accumulation):
            rows = slice(k * micro, (k + 1) * micro)
            final = k == accumulation - 1
            with contextlib.nullcontext() if final else skip_gradient_sync(model):
                loss = model(x[rows], y[rows])[1] / accumulation
                if final:  # parameters held between this forward and its backward
                    gathered_param_bytes = sum(local_bytes(p) for p in unique_params(model))
                loss.backward()
            if not final and skipped_sync is None:
                skipped_sync = sync_was_skipped(model)
        optimizer.step()
        memory = {
            "params_gathered": gathered_param_bytes,
            "param_shard_bytes": sum(local_bytes(p) for p in unique_params(model)),
            "grads": sum(local_bytes(p.grad) for p in unique_params(model)),
            "optimizer": optimizer_state_bytes(optimizer),
        }
        optimizer.zero_grad()
    expected = reference(optimizer_name)
    full = full_state_dict(model, all_ranks=True)
    rank0_only = full_state_dict(model)
    diff = max((full[k] - expected[k]).abs().max().item() for k in expected)
    return {
        "keys_match": sorted(full) == sorted(expected),
        "max_abs_diff": diff,
        "rank0_only_keys": len(rank0_only),
        "is_dtensor": any(isinstance(p, DTensor) for p in model.parameters()),
        "memory": memory,
        "skipped_sync": skipped_sync,
    }


def frozen_teacher() -> dict:
    """A model with no trainable parameters (a teacher, a reference model) prepared under ZeRO-3: its
    parameters are sharded like a trained model's, and its forward is the plain model's."""
    accelerator = Accelerator(cpu=True, parallelism="zero3")
    plain = make_model().requires_grad_(False)
    teacher = accelerator.prepare(make_model().requires_grad_(False))
    tokens = torch.randint(0, 32, (2, BLOCK), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        difference = (teacher(tokens)[0] - plain(tokens)[0]).abs().max().item()
    return {
        "all_dtensor": all(isinstance(p, DTensor) for p in teacher.parameters()),
        "local_fraction": sum(local_bytes(p) for p in unique_params(teacher))
        / sum(local_bytes(p) for p in unique_params(plain)),
        "max_abs_diff": difference,
    }


def main() -> None:
    state = PartialState()
    rank, world = state.process_index, state.num_processes
    runs = {}
    for stage in (1, 2, 3):
        for accumulation in (1, 2):
            runs[f"zero{stage}_sgd_acc{accumulation}"] = run(stage, "sgd", accumulation, rank, world)
        runs[f"zero{stage}_adamw_acc1"] = run(stage, "adamw", 1, rank, world)
    runs["frozen_teacher"] = frozen_teacher()
    everyone = [None] * world
    dist.all_gather_object(everyone, runs)
    if rank == 0:
        parameters = sum(p.numel() for p in unique_params(make_model()))
        Path(sys.argv[1]).write_text(
            json.dumps({"world": world, "parameters": parameters, "ranks": everyone})
        )


if __name__ == "__main__":
    main()
