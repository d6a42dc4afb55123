"""Launched by tests/test_uneven_rounds.py at 2 processes: DataLoaderConfiguration(even_batches=False)
with a loader whose last round is short (drop_last=False), under layouts that torch's Join can and
cannot shadow, each against what one process computes.

Usage: uneven_rounds_worker.py OUT_DIR. Each rank writes OUT_DIR/rank{R}.json:
- "refused": layout -> the ValueError prepare(model, optimizer, loader) raised on this rank for 18
  samples in batches of 4 (rank 0 gets 3 batches, rank 1 2), "" if it raised none;
- "wrapped_before_refusal": layout -> models prepared by then (0: refused before any collective);
- "after_refusals": an all_reduce of the rank right after them: the refusals left no collective behind;
- "zero3_short_batch": ZeRO-3 over 14 samples (2 batches each, rank 1's last one of 2 rows) is allowed:
  batches per rank and the parameters' distance to the one-process reference after the epoch;
- "ddp_join": DDP over 2n + 1 batches of 2 inside join_uneven_inputs: steps, and every step's gradient
  and the final parameters against Join's one-process reference, and the warnings logged meanwhile;
- "ddp_outside_join": the warnings logged by a pass over that loader begun outside join_uneven_inputs
  (data only: no model runs, so nothing waits), and by a second pass (said once).
"""

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator
from unison.utils import DataLoaderConfiguration, set_seed

out_dir = Path(sys.argv[1])
UNEVEN = DataLoaderConfiguration(even_batches=False)


class Captured(logging.Handler):
    """The warnings the library logs on this process."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def make_model() -> nn.Module:
    set_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def make_data(rows: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(rows, 6, generator=generator), torch.randn(rows, 2, generator=generator))


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


captured = Captured()
logging.getLogger("unison").addHandler(captured)
record: dict = {}

# -- refused: the data-parallel engine is not plain DDP -----------------------------------------------
refused, wrapped = {}, {}
for layout in ("zero3", "zero1", "zero2"):
    accelerator = Accelerator(cpu=True, parallelism=layout, dataloader_config=UNEVEN)
    model = make_model()
    try:
        accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(make_data(18), batch_size=4)
        )
        refused[layout] = ""
    except ValueError as error:
        refused[layout] = str(error)
    wrapped[layout] = len(accelerator._models)  # models wrapped (collectives issued) before the refusal
record["refused"] = refused
record["wrapped_before_refusal"] = wrapped
rank = torch.tensor([float(dist.get_rank())])
dist.all_reduce(rank)
record["after_refusals"] = rank.item()

# -- ZeRO-3, equal batch counts, a short last batch on rank 1: allowed, and what one process computes --
# Each step's gradient is the mean over the processes of each one's mean loss gradient (as under DDP).
accelerator = Accelerator(cpu=True, parallelism="zero3", dataloader_config=UNEVEN)
data = make_data(14)
model = make_model()
model, optimizer, loader = accelerator.prepare(
    model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4)
)
batches = 0
for x, y in loader:
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    batches += 1
reference = make_model()
x_all, y_all = data.tensors
for step in range(2):
    reference.zero_grad()
    for process in range(2):  # batch 2 * step + process: rows [4b, 4b + 4), the last one [12, 14)
        b = 2 * step + process
        loss = nn.functional.mse_loss(reference(x_all[4 * b : 4 * b + 4]), y_all[4 * b : 4 * b + 4])
        (loss / 2).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
full = [p.detach().full_tensor() for p in model.parameters()]  # FSDP2's shards, gathered
record["zero3_short_batch"] = {
    "batches": batches,
    "max_param_diff": max_diff(full, list(reference.parameters())),
}


# -- DDP inside join_uneven_inputs: Join's one-process reference (tests/workers/accelerate_style_worker) --
def join_reference(x: torch.Tensor, y: torch.Tensor, n: int, lr: float) -> tuple[list, nn.Module]:
    """Each step's gradient is the sum over the processes that still had a batch, divided by n (the
    joined ones all-reduce zeros); every process ends with the parameters of the last to join."""
    model = make_model()
    gradients = []
    for step in range(3):
        model.zero_grad()
        for process in range(n):
            index = step * n + process
            if index * 2 < len(x):
                loss = nn.functional.mse_loss(
                    model(x[index * 2 : index * 2 + 2]), y[index * 2 : index * 2 + 2]
                )
                (loss / n).backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return gradients, model


joiner = Accelerator(cpu=True, dataloader_config=UNEVEN)
n = joiner.num_processes
uneven = make_data(2 * (2 * n) + 1)
net = make_model()
net, opt, rows = joiner.prepare(
    net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(uneven, batch_size=2)
)
captured.messages.clear()
seen = []
with joiner.join_uneven_inputs([net]):
    for x, y in rows:
        joiner.backward(nn.functional.mse_loss(net(x), y))
        seen.append([p.grad.clone() for p in net.parameters()])
        opt.step()
        opt.zero_grad()
expected_gradients, expected = join_reference(*uneven.tensors, n, lr=0.1)
record["ddp_join"] = {
    "steps": len(seen),
    "max_grad_diff": max(max_diff(grads, expected_gradients[step]) for step, grads in enumerate(seen)),
    "max_param_diff": max_diff(list(joiner.unwrap_model(net).parameters()), list(expected.parameters())),
    "warnings": list(captured.messages),
}

# -- DDP outside join_uneven_inputs: the loader says so when its pass begins (data only, nothing waits) --
captured.messages.clear()
first = sum(1 for _ in rows)
said_first = list(captured.messages)
captured.messages.clear()
second = sum(1 for _ in rows)
record["ddp_outside_join"] = {
    "batches": [first, second],
    "first": said_first,
    "second": list(captured.messages),
}

(out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(record, indent=1))
