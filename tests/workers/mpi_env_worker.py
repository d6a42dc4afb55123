"""Started by tests/test_environment.py as a plain `python mpi_env_worker.py OUT_DIR`, N times, with the
variables Open MPI's mpirun gives each rank (OMPI_COMM_WORLD_*, PMIX_NAMESPACE) and no torchrun or SLURM
ones: unison alone must find its peers from them.

Each rank trains a small model through `Accelerator.prepare` (AdamW, 3 steps of 4 samples per process),
computes the one-process reference itself (a plain torch loop over the same samples, 4 x N per step) and
writes what it saw to OUT_DIR/rank<r>.json for the test to judge.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator

STEPS, MICRO_BATCH = 3, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def main() -> dict:
    """Train and describe this rank. In a function, so that the prepared model is freed before exit: written
    at module level, rank 0 (the store's host) was seen to abort at interpreter teardown, after its work,
    in 2 of about 40 runs ("terminate called without an active exception")."""
    accelerator = Accelerator(cpu=True)
    state = accelerator.state
    world = accelerator.num_processes
    generator = torch.Generator().manual_seed(7)
    dataset = TensorDataset(
        torch.randn(STEPS * MICRO_BATCH * world, 6, generator=generator),
        torch.randn(STEPS * MICRO_BATCH * world, 2, generator=generator),
    )

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(dataset, batch_size=MICRO_BATCH)
    )
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    reference = make_model()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for x, y in DataLoader(dataset, batch_size=MICRO_BATCH * world):
        nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()

    trained = accelerator.unwrap_model(model).state_dict()
    ranks = [None] * world
    dist.all_gather_object(ranks, (state.process_index, state.local_process_index))
    return {
        "source": state.layout.source,
        "rank": state.process_index,
        "world": world,
        "local_rank": state.local_process_index,
        "master": [state.layout.master_addr, state.layout.master_port],
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "gathered_ranks": ranks,
        "steps": len(loader),
        "max_diff_from_one_process": max(
            (trained[name] - value).abs().max().item() for name, value in reference.state_dict().items()
        ),
    }


if __name__ == "__main__":
    result = main()
    (Path(sys.argv[1]) / f"rank{result['rank']}.json").write_text(json.dumps(result))
