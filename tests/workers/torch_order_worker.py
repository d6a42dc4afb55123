"""Launched by tests/test_torch_order.py: prepared loaders keep the plain PyTorch loader's order.

Usage: torch_order_worker.py OUT_DIR. Process 0 is seeded as the plain one-process reference is (the
test computes it); the others on purpose differently, so agreement must come from unison. For each
seeding (the global seed, the user's generator, a generator re-seeded after prepare()), with and
without split_batches, under accumulation over 2 micro-batches, every process records what
gather_for_metrics returns at each step over two epochs. Then a plain training loop (SGD, one global
batch of 8 per step) runs prepared, for the final parameters. OUT_DIR/rank{r}.json holds it.
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator

SIZE, PER_PROCESS, GLOBAL, EPOCHS = 45, 3, 12, 2


def seed_for(rank: int) -> int:
    return 0 if rank == 0 else 1000 + rank


def order_run(accelerator: Accelerator, seeding: str, rank: int) -> list:
    """Each step's gathered samples (the samples of all processes, top-up dropped), over EPOCHS."""
    torch.manual_seed(seed_for(rank))
    generator = None
    if seeding == "generator":
        generator = torch.Generator().manual_seed(5 if rank == 0 else 50 + rank)
    elif seeding == "reseeded":
        generator = torch.Generator().manual_seed(1 + rank)
    batch_size = GLOBAL if accelerator.split_batches else PER_PROCESS
    loader = DataLoader(torch.arange(SIZE), batch_size=batch_size, shuffle=True, generator=generator)
    model = torch.nn.Linear(1, 1)
    prepared_model, loader = accelerator.prepare(model, loader)
    if seeding == "reseeded":
        generator.manual_seed(7)  # after prepare(), as Accelerate's own training check does
    steps = []
    for _ in range(EPOCHS):
        for batch in loader:
            with accelerator.accumulate(prepared_model):
                steps.append(accelerator.gather_for_metrics(batch).tolist())
    accelerator.free_memory(prepared_model)
    return steps


def training_run(accelerator: Accelerator, rank: int) -> list:
    torch.manual_seed(seed_for(rank))
    model = torch.nn.Linear(4, 1)
    data = torch.arange(48 * 5, dtype=torch.float32).reshape(48, 5).sin()
    loader = DataLoader(TensorDataset(data[:, :4], data[:, 4:]), batch_size=8, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(EPOCHS):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]


out: dict = {"orders": {}}
for split in (False, True):
    accelerator = Accelerator(cpu=True, split_batches=split, gradient_accumulation_steps=2)
    rank = accelerator.process_index
    for seeding in ("global", "generator", "reseeded"):
        out["orders"][f"{seeding}-split{int(split)}"] = order_run(accelerator, seeding, rank)
if accelerator.num_processes != 3:  # a global batch of 8 splits evenly over 1, 2 and 4 processes
    out["parameters"] = training_run(Accelerator(cpu=True, split_batches=True), rank)
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(out))
