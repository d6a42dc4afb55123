"""The ordinary unison training loop under each parallel layout, against one process.

For every layout named on the command line (a `parallelism=` string) the script trains a tiny GPT
(examples/gpt/model.py) for STEPS optimizer steps through `Accelerator(parallelism=...)`, `prepare`,
`accumulate`, `backward` and the prepared optimizer, exactly as a user's script would, in four runs:
SGD+momentum without and with accumulation, AdamW, and summed token losses with
`backward(loss, num_items=...)` with accumulation. Each step consumes the next GLOBAL_BATCH samples
of an unshuffled loader whatever the layout, so every rank also computes the single-process
reference (plain torch, the whole step's samples at once) and compares `accelerator.get_state_dict`
with it.

Memory (the AdamW run, fp32): per-rank bytes of parameters + gradients + optimizer state held by this
rank, read from the local shards; parameters are counted between the last forward and its backward
(what ZeRO-2 holds gathered), gradients and optimizer state after the step.

`run_layouts` is called by tests/workers/layouts_worker.py, in the launch it shares with the combination
matrix; process 0 writes a JSON report.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_gpt import (
    gpt_model,
    local_bytes,
    make_optimizer,
    make_tiny_gpt,
    optimizer_state_bytes,
    unique_params,
)
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState

STEPS = 3  # a changing rate, momentum carried twice, the first step clipped and the others not
GLOBAL_BATCH = 8  # samples per optimizer step, whatever the layout
BLOCK = 16
SEED = 1234
IGNORE = -100
MAX_NORM = 0.6  # gradient norms of these runs are ~0.5-1.0: some steps clip, some do not
RUNS = {  # name: (optimizer, accumulation steps, summed token loss with num_items)
    "sgd": ("sgd", 1, False),
    "sgd_acc2": ("sgd", 2, False),
    "adamw": ("adamw", 1, False),
    "items_acc2": ("sgd", 2, True),
}


def make_dataset(padded: bool) -> TensorDataset:
    """Input tokens and targets; padded: each sequence has 1..BLOCK valid targets (IGNORE after).

    Mean-loss runs use unpadded data, where the mean of equal micro-batches' means is the global mean;
    padded data is what `num_items` is for.
    """
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 32, (STEPS * GLOBAL_BATCH, BLOCK + 1), generator=generator)
    lengths = torch.randint(1, BLOCK + 1, (STEPS * GLOBAL_BATCH,), generator=generator)
    targets = tokens[:, 1:].clone()
    if padded:
        targets[torch.arange(BLOCK) >= lengths[:, None]] = IGNORE
    return TensorDataset(tokens[:, :-1].contiguous(), targets)


def token_loss(
    logits: torch.Tensor, targets: torch.Tensor, summed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    reduction = "sum" if summed else "mean"
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction=reduction)
    return loss, (targets != IGNORE).sum()


def summed_loss(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    """The model's output without targets is (logits, None): the sum over the valid tokens."""
    return token_loss(output[0], targets, summed=True)[0]


def mean_loss(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    return token_loss(output[0], targets, summed=False)[0]


def count(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE).sum()


def make_model(layout: str) -> torch.nn.Module:
    """The tiny GPT; with 4 blocks for the interleaved pipeline, which runs 2 stages on each rank."""
    if "interleaved" not in layout:
        return make_tiny_gpt(SEED, BLOCK)
    torch.manual_seed(SEED)
    config = gpt_model.GPTConfig(block_size=BLOCK, vocab_size=32, n_layer=4, n_head=2, n_embd=32)
    return gpt_model.GPT(config)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A rate that changes at every optimizer step, so a layout that loses the schedule shows it."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)


def reference(layout: str, optimizer_name: str, summed: bool) -> dict[str, torch.Tensor]:
    """One process, plain torch: each step's GLOBAL_BATCH samples in one batch, the mean over its tokens."""
    model = make_model(layout)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    scheduler = make_scheduler(optimizer)
    inputs, targets = make_dataset(padded=summed).tensors
    norms = []
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        logits, _ = model(inputs[rows])
        loss, valid = token_loss(logits, targets[rows], summed)
        (loss / valid if summed else loss).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


def evaluation_ids(accelerator: Accelerator) -> dict[str, list[int]]:
    """gather_for_metrics over a prepared loader of 11 samples (uneven over the data-parallel ranks):
    the ids it returns as tensors and as objects; each sample must appear once in every layout."""
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(11)), batch_size=2))
    tensors, objects = [], []
    for (ids,) in loader:
        tensors += accelerator.gather_for_metrics(ids).tolist()
        objects += accelerator.gather_for_metrics(ids.tolist(), use_gather_object=True)
    # reduce and gather count each data-parallel rank once too (its TP/PP peers hold copies)
    dp_rank = torch.tensor([float(accelerator.data_parallel_index)])
    return {
        "tensors": tensors,
        "objects": objects,
        "gathered_dp_ranks": accelerator.gather(dp_rank).tolist(),
        "reduced": {
            reduction: accelerator.reduce(dp_rank + 1, reduction).item()
            for reduction in ("sum", "mean", "max")
        },
        "dp_size": accelerator.parallelism.dp_size,
    }


def train(layout: str, optimizer_name: str, accumulation: int, summed: bool) -> dict:
    accelerator = Accelerator(cpu=True, parallelism=layout, gradient_accumulation_steps=accumulation)
    model = make_model(layout)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    scheduler = make_scheduler(optimizer)  # built on the user's optimizer, before prepare(), as users do
    micro_batch = GLOBAL_BATCH // (accelerator.parallelism.dp_size * accumulation)
    loader = DataLoader(make_dataset(padded=summed), batch_size=micro_batch)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    rates: list[float] = []
    memory: dict[str, int] = {}
    result: dict = {}
    norms: list[float] = []
    pipeline = accelerator.parallelism.pp_size > 1
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            if summed:  # the one-call form, which also runs pipelines
                valid = count(targets)
                loss = accelerator.forward_backward(model, inputs, targets, summed_loss, num_items=valid)
            elif pipeline:  # no rank holds the whole model: the one call runs the schedule
                loss = accelerator.forward_backward(model, inputs, targets, mean_loss)
                memory["params"] = sum(local_bytes(p) for p in unique_params(model))
            else:  # the ordinary loop: the model computes its mean loss
                _, loss = model(inputs, targets)
                memory["params"] = sum(local_bytes(p) for p in unique_params(model))
                accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            if accelerator.sync_gradients:  # the rate of the optimizer that steps (ZeRO-1: the rebuilt one)
                rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
            if accelerator.sync_gradients:
                memory["grads"] = sum(local_bytes(p.grad) for p in unique_params(model))
                memory["optimizer"] = optimizer_state_bytes(optimizer)
            optimizer.zero_grad()
    if optimizer_name == "sgd" and accumulation == 1 and not summed:
        result["eval"] = evaluation_ids(accelerator)
    full = accelerator.get_state_dict(model)
    result |= {"rates": rates, "memory": memory, "engine": type(model).__name__, "norms": norms}
    if accelerator.is_main_process:  # the report is process 0's: the others need no reference
        expected, result["expected_norms"] = reference(layout, optimizer_name, summed)
        result["keys_match"] = sorted(full) == sorted(expected)
        result["max_abs_diff"] = max((full[k] - expected[k]).abs().max().item() for k in expected)
    return result


def run_layouts(out: Path, layouts: list[str]) -> None:
    """Every layout's four runs; process 0 writes the report to `out`."""
    state = PartialState(cpu=True)
    report: dict = {"world": state.num_processes, "steps": STEPS, "layouts": {}}
    for layout in layouts:
        runs = {name: train(layout, *spec) for name, spec in RUNS.items()}
        memories = [None] * state.num_processes
        dist.all_gather_object(memories, runs["adamw"]["memory"])
        parameters = sum(p.numel() for p in unique_params(make_model(layout)))
        report["layouts"][layout] = {"runs": runs, "memory_per_rank": memories, "parameters": parameters}
    if state.is_main_process:
        out.write_text(json.dumps(report, indent=1))
