"""Launched by tests/test_numerics.py (2 processes), imported by it in-process (1 process): an
nlp_example-style loop in Accelerate's idioms under unison's numbers and under Accelerate's, each against
a plain PyTorch loop on one process that applies that convention's rules to the same samples.

The loop: a small MLP classifier, 25 batches per process per epoch, gradient accumulation 2 (so every
epoch ends with a one-micro-batch window), 3 epochs, AdamW and a linear schedule with warmup sized as
transformers' *_no_trainer scripts size it (warmup and length times num_processes, because Accelerate
steps it num_processes times per optimizer step).

Beside it, a shuffled loader as nlp_example prepares it (no generator of its own): the batches each
process reads over two passes, under each convention, for the test to compare with `order_reference`.

Usage: unison launch --numerics accelerate numerics_worker.py OUT_DIR. Each rank writes
OUT_DIR/rank{R}.json with, per run, the largest parameter distance to each reference, the final
learning rate and the unison warning lines it logged, and the shuffled batches it read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from unison import Accelerator
from unison.utils import DataLoaderConfiguration, set_seed

GLOBAL_BATCH, BATCHES_PER_EPOCH, ACCUMULATION, EPOCHS, LR, WARMUP = 8, 25, 2, 3, 3e-2, 2
ORDER_ROWS, ORDER_BATCH, ORDER_SEED, ORDER_PASSES = 20, 2, 7, 2


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    rows = GLOBAL_BATCH * BATCHES_PER_EPOCH
    features = torch.randn(rows, 16, generator=generator)
    return TensorDataset(features, (features[:, :4].sum(1) > 0).long())


def make_model() -> nn.Module:
    set_seed(5)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 2))


def linear_with_warmup(optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' get_linear_schedule_with_warmup."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def schedule_size(batches_per_epoch: int, num_processes: int) -> tuple[int, int]:
    """(warmup, length) as run_clm_no_trainer.py sizes them from the prepared loader's length."""
    max_train_steps = EPOCHS * math.ceil(batches_per_epoch / ACCUMULATION)
    return WARMUP * num_processes, max_train_steps * num_processes


def reference(rule: str, num_processes: int) -> tuple[nn.Module, float]:
    """One process, plain PyTorch, each micro-batch the global batch the processes read together.

    rule "unison": a short window's gradients averaged over its own micro-batches, the schedule stepped
    once per optimizer step; rule "accelerate": every loss divided by ACCUMULATION, the schedule
    stepped num_processes times per optimizer step. The schedule is sized for num_processes either way
    (the script is the same)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = linear_with_warmup(optimizer, *schedule_size(BATCHES_PER_EPOCH, num_processes))
    x, y = make_data().tensors
    for _epoch in range(EPOCHS):
        for index in range(BATCHES_PER_EPOCH):
            rows = slice(index * GLOBAL_BATCH, (index + 1) * GLOBAL_BATCH)
            (nn.functional.cross_entropy(model(x[rows]), y[rows]) / ACCUMULATION).backward()
            in_window = index % ACCUMULATION + 1
            if in_window < ACCUMULATION and index < BATCHES_PER_EPOCH - 1:
                continue
            if rule == "unison" and in_window < ACCUMULATION:
                for parameter in model.parameters():
                    parameter.grad *= ACCUMULATION / in_window
            optimizer.step()
            for _ in range(num_processes if rule == "accelerate" else 1):
                scheduler.step()
            optimizer.zero_grad()
    return model, scheduler.get_last_lr()[0]


class Lines(logging.Handler):
    """The warning lines the "unison" logger gives while attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(epochs: int = EPOCHS, split_batches: bool = False, **accelerator_args) -> dict:
    """The script, as nlp_example writes it; returns its model, last rate and the lines it logged."""
    lines = Lines()
    logging.getLogger("unison").addHandler(lines)
    try:
        accelerator = Accelerator(
            cpu=True,
            gradient_accumulation_steps=ACCUMULATION,
            dataloader_config=DataLoaderConfiguration(split_batches=split_batches),
            **accelerator_args,
        )
        per_process = GLOBAL_BATCH if split_batches else GLOBAL_BATCH // accelerator.num_processes
        train_dataloader = DataLoader(make_data(), batch_size=per_process, shuffle=False)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
        warmup, total = schedule_size(len(train_dataloader), accelerator.num_processes)
        lr_scheduler = accelerator.prepare(linear_with_warmup(optimizer, warmup, total))
        for _epoch in range(epochs):
            model.train()
            for x, y in train_dataloader:
                with accelerator.accumulate(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
        return {
            "model": accelerator.unwrap_model(model),
            "lr": lr_scheduler.get_last_lr()[0],
            "numerics": accelerator.numerics,
            "lines": lines.lines,
        }
    finally:
        logging.getLogger("unison").removeHandler(lines)


def shuffled_batches() -> dict:
    """A shuffled DataLoader with no generator, prepared: this process's batches over ORDER_PASSES
    passes, and the global RNG's next draw after them (what dropout would draw)."""
    accelerator = Accelerator(cpu=True)
    set_seed(ORDER_SEED)
    loader = DataLoader(list(range(ORDER_ROWS)), batch_size=ORDER_BATCH, shuffle=True)
    loader = accelerator.prepare(loader)
    batches = [batch.tolist() for _ in range(ORDER_PASSES) for batch in loader]
    return {"batches": batches, "next_draw": torch.rand(()).item()}


def _draw(generator: torch.Generator | None = None) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def order_reference(rule: str, num_processes: int, process_index: int) -> dict:
    """`shuffled_batches` by hand; step i gives process r the pass's batch num_processes * i + r.

    rule "unison": plain PyTorch's order, each pass drawing the loader's base seed and then the
    permutation's seed from the global RNG. rule "accelerate": Accelerate 1.15's prepare_data_loader on
    more than one process, which gives the sampler a generator seeded by one global draw at prepare()
    and draws every pass's permutation from it (the base seed still comes from the global RNG); on one
    process Accelerate keeps PyTorch's order. Checked against Accelerate 1.15.0 itself (2 processes,
    2026-11-26): the same batches on both ranks and the same next global draw."""
    set_seed(ORDER_SEED)
    shuffle = None
    if rule == "accelerate" and num_processes > 1:
        shuffle = torch.Generator().manual_seed(_draw())
    batches = []
    for _ in range(ORDER_PASSES):
        _draw()  # the loader's base seed
        source = shuffle if shuffle is not None else torch.Generator().manual_seed(_draw())
        order = list(RandomSampler(range(ORDER_ROWS), generator=source))  # its draws, not only randperm's
        pass_batches = [order[i : i + ORDER_BATCH] for i in range(0, ORDER_ROWS, ORDER_BATCH)]
        batches += pass_batches[process_index::num_processes]
    return {"batches": batches, "next_draw": torch.rand(()).item()}


def distance(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def summary(run: dict, num_processes: int) -> dict:
    """The run's distance to both references and each reference's final rate."""
    out = {"lr": run["lr"], "numerics": run["numerics"], "lines": run["lines"]}
    for rule in ("unison", "accelerate"):
        model, lr = reference(rule, num_processes)
        out[f"distance_to_{rule}"] = distance(run["model"], model)
        out[f"reference_lr_{rule}"] = lr
    return out


def main() -> None:
    """Launched with `--numerics accelerate`: the unchanged script under the variable the launcher
    exported (Accelerate's numbers); then, the variable removed, the default (unison's), and
    split_batches=True (one scheduler step per optimizer step in both conventions: no scheduler line)."""
    out_dir = Path(sys.argv[1])
    record = {"exported": os.environ.get("UNISON_NUMERICS")}
    record["env_accelerate"] = summary(train(), 2)
    record["order_accelerate"] = shuffled_batches()
    del os.environ["UNISON_NUMERICS"]
    record["default"] = summary(train(), 2)
    record["order_default"] = shuffled_batches()
    split = train(epochs=1, split_batches=True)
    record["split_batches_lines"] = split["lines"]
    rank = int(os.environ["RANK"])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
