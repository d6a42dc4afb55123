"""LocalSGD's case, run inside tests/workers/accelerate_style_worker.py's launch (no launch of its own), and
its plain-torch reference, which tests/test_accelerate_compat.py computes on one process.

Each process trains on its own micro-batches in Accelerate's by_feature/local_sgd.py loop
(`local_sgd.step()` after every micro-step, inside `accumulate()`); the reference simulates the same
processes one after the other, each with its own model and SGD momentum, averaging their parameters
every `local_sgd_steps` calls and at the end. A ZeRO-3 layout must be refused on every process.
"""

from __future__ import annotations

import torch
from torch import nn

from unison import Accelerator
from unison.local_sgd import LocalSGD

MICRO_BATCH = 3
# name -> (gradient_accumulation_steps, local_sgd_steps, micro-steps, enabled)
CASES = {
    "every_3": (1, 3, 7, True),  # the exit averages after a period cut short (7 = 2 * 3 + 1)
    "accumulating": (2, 4, 10, True),  # Accelerate's example: averages every 2 optimizer steps
    "disabled": (2, 4, 10, False),  # enabled=False: plain DDP, every optimizer step synchronised
}


def make_model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def batch(world: int, rank: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Process `rank`'s micro-batch number `micro_step` (each process a different one)."""
    generator = torch.Generator().manual_seed(1000 * micro_step + 10 * world + rank)
    return torch.randn(MICRO_BATCH, 5, generator=generator), torch.randn(MICRO_BATCH, 2, generator=generator)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def run() -> dict:
    """Every case's final parameters on this process (flattened), and the message of the refusal."""
    record = {}
    for name, (accumulation, local_sgd_steps, micro_steps, enabled) in CASES.items():
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
        world, rank = accelerator.num_processes, accelerator.process_index
        model = make_model()
        model, optimizer = accelerator.prepare(model, make_optimizer(model))
        apart = []  # after each step: do the processes' parameters differ (between two averages)?
        with LocalSGD(accelerator, model, local_sgd_steps=local_sgd_steps, enabled=enabled) as local_sgd:
            for micro_step in range(micro_steps):
                with accelerator.accumulate(model):
                    accelerator.backward(loss_of(model, *batch(world, rank, micro_step)))
                    optimizer.step()
                    optimizer.zero_grad()
                    local_sgd.step()
                flat = torch.cat([p.detach().flatten() for p in model.parameters()])
                apart.append(bool((accelerator.reduce(flat, "max") != accelerator.reduce(flat, "min")).any()))
        record[name] = {
            "parameters": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
            "apart": apart,
        }
    sharded = Accelerator(cpu=True, parallelism="zero3")
    model = sharded.prepare(make_model())
    try:
        LocalSGD(sharded, model, local_sgd_steps=2)
    except NotImplementedError as error:
        record["zero3_refused"] = str(error)
    return record


def reference(world: int, case: str, local: bool = True) -> torch.Tensor:
    """Plain torch on one process: `world` simulated processes, each on its own micro-batches;
    `local=False` synchronises every optimizer step instead (DDP's mean gradient)."""
    accumulation, local_sgd_steps, micro_steps, _ = CASES[case]
    models = [make_model() for _ in range(world)]
    optimizers = [make_optimizer(model) for model in models]

    def average(tensors_of) -> None:
        for tensors in zip(*(tensors_of(model) for model in models)):
            mean = sum(tensors[1:], tensors[0].clone()) / world
            for tensor in tensors:
                tensor.copy_(mean)

    for micro_step in range(micro_steps):
        for rank, model in enumerate(models):
            (loss_of(model, *batch(world, rank, micro_step)) / accumulation).backward()
        if (micro_step + 1) % accumulation == 0:
            if not local:
                with torch.no_grad():
                    average(lambda model: [p.grad for p in model.parameters()])
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        if local and (micro_step + 1) % local_sgd_steps == 0:
            with torch.no_grad():
                average(lambda model: list(model.parameters()))
    if local:
        with torch.no_grad():
            average(lambda model: list(model.parameters()))
    return torch.cat([p.detach().flatten() for p in models[0].parameters()])
