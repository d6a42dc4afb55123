"""Launched worker: DDP training through unison against single-process references.

Each rank trains a small MLP through `Accelerator.prepare` for several (accumulation, optimizer)
settings and compares its parameters with two plain-torch references it computes itself: one
process with the global batch, and one process with the same samples fed as accumulated micro-batches.
It also records whether gradients differ across ranks inside an accumulation window (no_sync) and
agree at its end, how often the scheduler stepped, which micro-steps synchronised at the end of a
loader, what gather_for_metrics returns per batch and once after the loop, and the errors that bad
input raises. Results go to OUT_DIR/rank<r>.json for the test to judge.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from unison import Accelerator, DistributedDataParallelKwargs
from unison.data import prepare_data_loader
from unison.ops import gather

STEPS = 5
MICRO_BATCH = 4  # per process
FEATURES, HIDDEN, OUTPUTS = 8, 16, 4


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)


def make_data(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(99)
    x = torch.randn(num_samples, FEATURES, generator=generator)
    y = torch.randn(num_samples, OUTPUTS, generator=generator)
    return TensorDataset(x, y)


def reference(
    dataset: TensorDataset, optimizer_name: str, step_size: int, micro_batch: int
) -> list[torch.Tensor]:
    """One process: each optimizer step sees `step_size` consecutive samples in micro-batches."""
    model = make_model()
    optimizer = make_optimizer(optimizer_name, model)
    scheduler = make_scheduler(optimizer)
    x, y = dataset.tensors
    accumulation = step_size // micro_batch
    for step in range(STEPS):
        for micro in range(accumulation):
            start = step * step_size + micro * micro_batch
            loss = nn.functional.mse_loss(
                model(x[start : start + micro_batch]), y[start : start + micro_batch]
            )
            (loss / accumulation).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def grads_agree_across_ranks(model: nn.Module) -> bool:
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    everyone = gather(flat.unsqueeze(0))
    return bool(all(torch.equal(everyone[0], row) for row in everyone))


def train_through_unison(accumulation: int, optimizer_name: str) -> dict:
    accelerator = Accelerator(gradient_accumulation_steps=accumulation, cpu=True)
    n = accelerator.num_processes
    step_size = MICRO_BATCH * n * accumulation
    dataset = make_data(STEPS * step_size)
    model = make_model()
    optimizer = make_optimizer(optimizer_name, model)
    scheduler = make_scheduler(optimizer)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    optimizer_steps, grads_agree_inside_window, grads_agree_at_sync = 0, [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            agree = grads_agree_across_ranks(model)
            (grads_agree_at_sync if accelerator.sync_gradients else grads_agree_inside_window).append(agree)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        optimizer_steps += accelerator.sync_gradients
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return {
        "accumulation": accumulation,
        "optimizer": optimizer_name,
        "optimizer_steps": optimizer_steps,
        "scheduler_last_epoch": scheduler.last_epoch,
        "lr": scheduler.get_last_lr()[0],
        "diff_vs_global_batch": max_diff(params, reference(dataset, optimizer_name, step_size, step_size)),
        "diff_vs_accumulation": max_diff(params, reference(dataset, optimizer_name, step_size, MICRO_BATCH)),
        "grads_agree_inside_window": grads_agree_inside_window,
        "grads_agree_at_sync": grads_agree_at_sync,
    }


def sync_pattern_at_end_of_loader() -> list[bool]:
    """Three rounds with accumulation 2: the third micro-step ends the loader and must sync."""
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = accelerator.prepare(make_model())
    loader = accelerator.prepare(
        DataLoader(make_data(3 * MICRO_BATCH * accelerator.num_processes), batch_size=MICRO_BATCH)
    )
    pattern = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            pattern.append(accelerator.sync_gradients)
    return pattern


def short_final_window() -> dict:
    """Accumulation 3 over 5 rounds of micro-batches: windows of 3 and 2. Each update must be the mean
    gradient of its own window's samples (one process, plain torch, computes the reference), so the
    short window is divided by its 2 micro-batches, not by 3."""
    accumulation, rounds = 3, 5
    accelerator = Accelerator(gradient_accumulation_steps=accumulation, cpu=True)
    round_size = MICRO_BATCH * accelerator.num_processes
    dataset = make_data(rounds * round_size)
    model = make_model()
    optimizer = make_optimizer("sgd", model)
    scheduler = make_scheduler(optimizer)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    reference_model = make_model()
    reference_optimizer = make_optimizer("sgd", reference_model)
    reference_scheduler = make_scheduler(reference_optimizer)
    x, y = dataset.tensors
    for first, end in ((0, accumulation), (accumulation, rounds)):  # each window's samples in one batch
        rows = slice(first * round_size, end * round_size)
        nn.functional.mse_loss(reference_model(x[rows]), y[rows]).backward()
        reference_optimizer.step()
        reference_scheduler.step()
        reference_optimizer.zero_grad()
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return {"diff": max_diff(params, [p.detach() for p in reference_model.parameters()])}


def gather_for_metrics_rows() -> dict:
    """Evaluation over 13 samples: the gathered rows must be exactly the dataset, in order, once."""
    accelerator = Accelerator(cpu=True)
    dataset = TensorDataset(torch.arange(13 * 2, dtype=torch.float32).reshape(13, 2))
    loader = accelerator.prepare(DataLoader(dataset, batch_size=2))
    tensors, objects, pairs = [], [], []
    for (x,) in loader:
        tensors.append(accelerator.gather_for_metrics(x))
        objects.extend(accelerator.gather_for_metrics(x[:, 0].int().tolist()))
        pairs.append(accelerator.gather_for_metrics([x[:, 0], x[:, 1]]))  # e.g. [predictions, labels]
    return {
        "tensor_rows_equal_dataset": torch.equal(torch.cat(tensors), dataset.tensors[0]),
        "object_rows": objects,
        "list_of_tensors": [torch.cat([pair[i] for pair in pairs]).tolist() for i in range(2)]
        if all(len(pair) == 2 for pair in pairs)
        else [len(pair) for pair in pairs],
    }


class Stream(IterableDataset):
    """Rows 0..size-1 as a stream with a length (dispatched by process 0, or read in shards)."""

    def __init__(self, size: int):
        self.size = size

    def __iter__(self):
        return (torch.tensor([float(i)]) for i in range(self.size))

    def __len__(self) -> int:
        return self.size


def gather_after_the_loop() -> dict:
    """gather_for_metrics once after the loop on each process's concatenated results, whose last rows
    repeat the epoch's start (13 rows, batches of 2): the single-process truth is the dataset itself.
    Every way of dealing the data, per-batch calls (a pass of their own), lengths that fit no pass, a loop
    nested in another, and two loaders whose passes held as many rows per process (one warning)."""
    accelerator = Accelerator(cpu=True)
    n = accelerator.num_processes
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("unison").addHandler(handler)
    gather_rows = accelerator.gather_for_metrics

    def evaluate(loader, each_batch: bool = False) -> tuple[torch.Tensor, list[int]]:
        """This process's rows concatenated; with `each_batch`, the per-batch gather_for_metrics rows, in
        order (a pass gathered so leaves nothing for a gather after the loop to drop)."""
        local, per_batch = [], []
        for batch in loader:
            rows = batch[0] if isinstance(batch, list) else batch
            local.append(rows)
            if each_batch:
                per_batch += gather_rows(rows)[:, 0].int().tolist()
        return torch.cat(local), per_batch

    def ints(rows: torch.Tensor) -> list[int]:
        return sorted(rows[:, 0].int().tolist())

    thirteen = TensorDataset(torch.arange(13.0)[:, None])
    loaders = {
        "shard": accelerator.prepare(DataLoader(thirteen, batch_size=2)),
        "split": prepare_data_loader(DataLoader(thirteen, batch_size=2 * n), split_batches=True),
        "dispatched": prepare_data_loader(DataLoader(Stream(13), batch_size=2)),
        "iterable_shard": prepare_data_loader(DataLoader(Stream(13), batch_size=2), dispatch_batches=False),
    }
    result: dict = {}
    for name, loader in loaders.items():
        local, _ = evaluate(loader)
        after = ints(gather_rows(local))
        result[name] = {"rows_here": len(local), "after": after, "per_batch": evaluate(loader, True)[1]}
    # Accelerate's by_feature/cross_validation.py: an unprepared loader, each process reading every row,
    # gathered per batch after a prepared loader's pass gathered per batch: batches of as many rows as
    # that pass held per process are not its repeats (they lost rows before: 2 processes, 32 of 64)
    rows = result["shard"]["rows_here"]
    unprepared = DataLoader(TensorDataset(torch.arange(2.0 * rows)[:, None]), batch_size=rows)
    result["unprepared_after_per_batch"] = [gather_rows(batch).shape[0] for (batch,) in unprepared]
    local, _ = evaluate(loaders["shard"])
    result["shapes"] = {  # a structure, a list of objects, then lengths that fit no pass: gathered whole
        "structure": {k: ints(v) for k, v in gather_rows({"pred": local, "label": local + 100}).items()},
        "objects": sorted(gather_rows(local[:, 0].int().tolist())),
        "scalar": gather_rows(local.sum()).shape[0],
        "one_row_short": gather_rows(local[:-1]).shape[0],
    }
    outer = accelerator.prepare(DataLoader(TensorDataset(torch.zeros(4 * n, 1)), batch_size=2))
    for step, _ in enumerate(outer):  # evaluation inside a training loop that goes on
        if step == 0:
            local, _ = evaluate(loaders["shard"])
            result["nested"] = ints(gather_rows(local))
    sixteen = accelerator.prepare(DataLoader(TensorDataset(torch.arange(16.0)[:, None]), batch_size=2))
    first, _ = evaluate(loaders["shard"])
    result["one_after_the_other"] = [ints(gather_rows(first))]
    second, _ = evaluate(sixteen)  # as many rows per process as the 13's pass, other repeats
    result["one_after_the_other"].append(ints(gather_rows(second)))
    first, _ = evaluate(loaders["shard"])
    second, _ = evaluate(sixteen)
    result["both_loops_first"] = {"first": gather_rows(first).shape[0], "rows_here": len(first)}
    logging.getLogger("unison").removeHandler(handler)
    result["warnings"] = warnings
    return result


def error_of(function) -> str | None:
    try:
        function()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def state_dict_keys() -> dict:
    """get_state_dict's keys: the user's module's, or with unwrap=False the DDP wrapper's own."""
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(make_model())
    unwrapped, wrapped = accelerator.get_state_dict(model), accelerator.get_state_dict(model, unwrap=False)
    return {
        "unwrapped": sorted(unwrapped),
        "wrapped": sorted(wrapped),
        "wrapper_state_dict": sorted(model.state_dict()),
        "same_values": all(
            torch.equal(unwrapped[key.removeprefix("module.")], wrapped[key]) for key in wrapped
        ),
    }


def bad_inputs() -> dict:
    accelerator = Accelerator(cpu=True)
    model = make_model()
    accelerator.prepare(model)
    ddp_options = [DistributedDataParallelKwargs(find_unused_parameters=True)]
    return {
        "ddp_kwargs_under_fsdp": error_of(
            lambda: Accelerator(cpu=True, parallelism="zero3", kwargs_handlers=ddp_options).prepare(
                make_model()
            )
        ),
        "ddp_kwargs_under_tp": error_of(  # one model split over every process: no replicas for DDP
            lambda: Accelerator(
                cpu=True, parallelism=f"tp_size={accelerator.num_processes}", kwargs_handlers=ddp_options
            ).prepare(make_model())
        ),
        "accumulation_zero": error_of(lambda: Accelerator(gradient_accumulation_steps=0)),
        "unknown_precision": error_of(lambda: Accelerator(mixed_precision="fp8")),
        "conflicting_precision": error_of(lambda: Accelerator(mixed_precision="bf16")),
        "unsupported_object": error_of(lambda: accelerator.prepare("not a model")),
        "prepared_twice": error_of(lambda: accelerator.prepare(model)),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    runs = [train_through_unison(k, name) for k in (1, 2) for name in ("sgd", "adamw")]
    accelerator = Accelerator(cpu=True)
    result = {
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "runs": runs,
        "end_of_loader_sync": sync_pattern_at_end_of_loader(),
        "gather_for_metrics": gather_for_metrics_rows(),
        "gather_after_the_loop": gather_after_the_loop(),
        "short_final_window": short_final_window(),
        "state_dict_keys": state_dict_keys(),
        "errors": bad_inputs(),
    }
    (out_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
