"""Launched worker: DDP with static_graph=True and gradient accumulation against one process.

torch's reducer cannot skip the all-reduce before a synchronised backward under static_graph, so
unison synchronises the first micro-step (parallel/ddp.py); the parameters must still equal one
process stepping on each window's samples at once. Process 0 writes the largest difference to argv[1]
(or to `run(PATH)`'s PATH: tests/workers/accelerate_style_worker.py calls it on 2 processes, after its
own work, with the state reset).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from unison import Accelerator, DistributedDataParallelKwargs

WINDOWS, ACCUMULATION, MICRO_BATCH = 3, 2, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def run(out: Path) -> None:
    handlers = [DistributedDataParallelKwargs(static_graph=True)]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, kwargs_handlers=handlers)
    world, rank = accelerator.num_processes, accelerator.process_index
    data = torch.randn(
        WINDOWS * ACCUMULATION * world * MICRO_BATCH, 4, generator=torch.Generator().manual_seed(1)
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    reference = make_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    per_window = ACCUMULATION * world * MICRO_BATCH
    for window in range(WINDOWS):
        samples = data[window * per_window : (window + 1) * per_window]
        reference(samples).pow(2).mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        for micro in range(ACCUMULATION):
            # micro-step `micro` of this rank: its share of the window's samples, as a sharded loader gives
            start = (micro * world + rank) * MICRO_BATCH
            with accelerator.accumulate(model):
                accelerator.backward(model(samples[start : start + MICRO_BATCH]).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
    trained = accelerator.unwrap_model(model).state_dict()
    difference = max((trained[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    if accelerator.is_main_process:
        out.write_text(str(difference))


if __name__ == "__main__":
    run(Path(sys.argv[1]))
