"""Launched worker: a small run saved after EVERY optimizer step, and resumed from every checkpoint.

The run: the tiny GPT, 3 epochs of 12 samples in micro-batches of 2 per data-parallel process (4 under
tensor or pipeline parallelism, where both processes read the same batch), accumulation 2 (on 2 processes
each epoch is 3 rounds: a window of 2 and a short one), AdamW, a rate that changes every step, clipping;
a checkpoint after every optimizer step, into OUT/CASE-wWORLD/step_<optimizer steps>_<batches>, the
epoch's last step included.

A case is `KIND@LAYOUT[+async]`: how the data is loaded (KINDS below) and the layout (LAYOUTS), saved
synchronously or with async_save=True.

  train OUT CASE...             the uninterrupted runs; each writes OUT/CASE-wWORLD/run.pt: the loss of
                                every micro-step and the final parameters (process 0)
  resume OUT REPORT CASE@WORLD...
                                every checkpoint the WORLD-process run of CASE saved, loaded into a model,
                                optimizer, scheduler and loaders built afresh (a new Accelerator, here in
                                this process) and trained to the end; REPORT gets one record per resume:
                                the largest difference of its losses and final parameters from the
                                uninterrupted run's. The first resume of a launch is a fresh process's: the
                                launch resumes it again at its end (`fresh_again`), proving the in-process
                                resumes equivalent to fresh processes. A CASE saved on another
                                world size also gets `noise`: how far this world size's uninterrupted
                                run with the saved global batch ends from the saving run's (rounding).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_gpt import gpt_model
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, WeightedRandomSampler

from unison import (
    Accelerator,
    AcceleratorState,
    DataLoaderConfiguration,
    GradientState,
    PartialState,
    skip_first_batches,
)

SEED, BLOCK, VOCAB, SAMPLES, MICRO, ACCUMULATION, EPOCHS, MAX_NORM = 3, 8, 32, 12, 2, 2, 3, 0.5
OVERFLOW_AT = 4  # fp16 kind: the 5th optimizer step overflows (an infinite loss) and is skipped
KINDS = (
    "shuffle",  # DataLoader(shuffle=True): PyTorch's order, from the global RNG
    "generator",  # shuffle with a generator of the user's (issue 39's repro)
    "seedable",  # DataLoaderConfiguration(use_seedable_sampler=True)
    "weighted",  # a sampler of the user's own: WeightedRandomSampler drawing from the global RNG
    "iterable",  # an IterableDataset that reshuffles at set_epoch (dispatched on several processes)
    "hf_iterable",  # a Hugging Face datasets IterableDataset, shuffled with a buffer
    "dispatch",  # map-style data with dispatch_batches=True
    "workers",  # 2 worker processes, each augmenting samples from its own seed; dropout in the model
    "two_loaders",  # an evaluation loader (shuffled) run every 2 optimizer steps beside the training one
    "accelerate",  # Accelerate's checkpointing example's loop: skip_first_batches, no set_epoch
    "fp16",  # fp16 with GradScaler; the step before checkpoint 5 overflows and is skipped
)
LAYOUTS = {"ddp": None, "zero3": "zero3", "tp": "tp_size=2", "pp": "pp_size=2", "ep": "ep_size=2"}


@dataclass(frozen=True)
class Case:
    kind: str
    layout: str
    async_save: bool

    @classmethod
    def parse(cls, text: str) -> Case:
        kind, _, rest = text.partition("@")
        layout, _, option = rest.partition("+")
        assert kind in KINDS and layout in LAYOUTS and option in ("", "async"), text
        return cls(kind, layout, option == "async")

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.layout}" + ("+async" if self.async_save else "")


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, BLOCK + 1), generator=torch.Generator().manual_seed(11))


class Augmented(Dataset):
    """Each read replaces a random token (from the reading worker's own RNG, as augmentations do)."""

    def __init__(self):
        self.rows = tokens()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        row = self.rows[index].clone()
        row[torch.randint(0, BLOCK, ())] = torch.randint(0, VOCAB, ())
        return row[:-1], row[1:]


class EpochStream(IterableDataset):
    """A stream in an order of its own per epoch (set_epoch), as a sharded corpus reader gives it."""

    def __init__(self):
        self.rows, self.epoch = tokens(), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return SAMPLES

    def __iter__(self):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch))
        for index in order.tolist():
            yield self.rows[index, :-1], self.rows[index, 1:]


def hf_stream():
    import datasets

    rows = tokens()
    table = datasets.Dataset.from_dict({"x": rows[:, :-1].tolist(), "y": rows[:, 1:].tolist()})
    return table.to_iterable_dataset(num_shards=2).shuffle(seed=7, buffer_size=8).with_format("torch")


def train_loader(kind: str, layout: str) -> DataLoader:
    batch_size = MICRO * 2 if layout in ("tp", "pp") else MICRO
    rows = tokens()
    pairs = TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
    if kind == "weighted":
        weights = torch.linspace(1, 3, SAMPLES)
        return DataLoader(pairs, batch_size=batch_size, sampler=WeightedRandomSampler(weights, SAMPLES))
    if kind == "generator":
        return DataLoader(
            pairs, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(2)
        )
    if kind == "iterable":
        return DataLoader(EpochStream(), batch_size=batch_size)
    if kind == "hf_iterable":
        return DataLoader(hf_stream(), batch_size=batch_size)
    if kind == "workers":
        return DataLoader(Augmented(), batch_size=batch_size, shuffle=True, num_workers=2)
    return DataLoader(pairs, batch_size=batch_size, shuffle=True)


def build(case: Case, accumulation: int = ACCUMULATION) -> tuple[Accelerator, tuple]:
    """The script's set-up, as a fresh process runs it: a new Accelerator, model, optimizer, scheduler and
    loaders, seeded as the script seeds them."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True,
        parallelism=LAYOUTS[case.layout],
        mixed_precision="fp16" if case.kind == "fp16" else "no",
        gradient_accumulation_steps=accumulation,
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=case.kind == "seedable", dispatch_batches=case.kind == "dispatch" or None
        ),
    )
    torch.manual_seed(SEED)
    config = gpt_model.GPTConfig(
        block_size=BLOCK,
        vocab_size=VOCAB,
        n_layer=2,
        n_head=2,
        n_embd=32,
        dropout=0.1 if case.kind in ("workers", "two_loaders") else 0.0,
        n_experts=4 if case.layout == "ep" else 0,
    )
    model = gpt_model.GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
    loaders = [train_loader(case.kind, case.layout)]
    if case.kind == "two_loaders":
        rows = tokens()[:12]
        loaders.append(DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=4, shuffle=True))
    return accelerator, accelerator.prepare(model, optimizer, scheduler, *loaders)


def next_token_loss(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def as_pair(batch) -> tuple[torch.Tensor, torch.Tensor]:
    return (batch["x"], batch["y"]) if isinstance(batch, dict) else tuple(batch)


def evaluate(accelerator: Accelerator, model, loader) -> float:
    model.eval()
    total = torch.zeros(())
    with torch.no_grad():
        for batch in loader:
            inputs, targets = as_pair(batch)
            logits = model(inputs)
            logits = logits[0] if isinstance(logits, tuple) else logits
            per_sample = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
            total += accelerator.gather_for_metrics(per_sample).sum()
    model.train()
    return float(total)


def train(case: Case, accelerator: Accelerator, objects, steps: int, batches: int, save_to: Path | None):
    """The user's loop from `steps` optimizer steps and `batches` batches done: every micro-step's loss,
    every evaluation; a checkpoint after each optimizer step when `save_to` is given."""
    model, optimizer, scheduler, loader, *others = objects
    losses, evaluations = [], []

    def epochs():
        if case.kind == "accelerate":  # the epoch and the batches to skip computed from the batches done
            first, skip = divmod(batches, len(loader))
            for epoch in range(first, EPOCHS):
                yield skip_first_batches(loader, skip) if epoch == first and skip else loader
        else:
            for epoch in range(loader.epoch, EPOCHS):
                loader.set_epoch(epoch)
                yield loader

    for active in epochs():
        for batch in active:
            batches += 1
            inputs, targets = as_pair(batch)

            def loss_fn(output, targets, overflow=case.kind == "fp16" and steps == OVERFLOW_AT):
                loss = next_token_loss(output, targets)
                return loss * float("inf") if overflow else loss

            with accelerator.accumulate(model):
                losses.append(accelerator.forward_backward(model, (inputs,), targets, loss_fn))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps += 1
                if others and steps % 2 == 0:
                    evaluations.append(evaluate(accelerator, model, others[0]))
                if save_to is not None:
                    accelerator.save_state(save_to / f"step_{steps}_{batches}", async_save=case.async_save)
    accelerator.wait_for_checkpoint()
    parameters = accelerator.get_state_dict(model)
    losses = torch.stack(losses).float() if losses else torch.zeros(0)
    return {"losses": losses, "evaluations": evaluations, "parameters": parameters}


def train_mode(out: Path, cases: list[str]) -> None:
    world = PartialState(cpu=True).num_processes
    for text in cases:
        case = Case.parse(text)
        print(f"train {case.name} on {world}", flush=True)
        folder = out / f"{case.name}-w{world}"
        accelerator, objects = build(case)
        run = train(case, accelerator, objects, 0, 0, save_to=folder)
        if accelerator.is_main_process:
            torch.save(run, folder / "run.pt")
        accelerator.wait_for_everyone()


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    both_infinite = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    return float(torch.where(both_infinite, 0.0, (a.double() - b.double()).abs()).max()) if a.numel() else 0.0


def resume_one(case: Case, checkpoint: Path, uninterrupted: dict, same_world: bool) -> tuple[dict, dict]:
    """The record of one resume (process 0's; empty elsewhere) and the resumed run."""
    steps, batches = (int(part) for part in checkpoint.name.split("_")[1:])
    accelerator, objects = build(case)
    accelerator.load_state(checkpoint)
    run = train(case, accelerator, objects, steps, batches, save_to=None)
    if not accelerator.is_main_process:
        return {}, run
    record = {"case": case.name, "checkpoint": checkpoint.name, "steps": steps, "batches": batches}
    expected = uninterrupted["parameters"]
    record["parameters"] = max(largest_difference(run["parameters"][k], v) for k, v in expected.items())
    evaluations_before = len(uninterrupted["evaluations"]) - len(run["evaluations"])
    record["evaluations"] = run["evaluations"] == uninterrupted["evaluations"][evaluations_before:]
    if same_world:  # every micro-step after the resume, on this process
        done = len(uninterrupted["losses"]) - len(run["losses"])
        record["losses"] = largest_difference(run["losses"], uninterrupted["losses"][done:])
    return record, run


def same_bits(a: dict, b: dict) -> bool:
    return torch.equal(a["losses"], b["losses"]) and all(
        torch.equal(a["parameters"][k], v) for k, v in b["parameters"].items()
    )


def resume_mode(out: Path, report: Path, sources: list[str]) -> None:
    world = PartialState(cpu=True).num_processes
    records, first = [], None
    for source in sources:
        text, saved_world = source.rsplit("@", 1)
        case = Case.parse(text)
        folder = out / f"{case.name}-w{saved_world}"
        uninterrupted = torch.load(folder / "run.pt", weights_only=True)
        for checkpoint in sorted(folder.glob("step_*"), key=lambda p: int(p.name.split("_")[1])):
            print(f"resume {case.name} from {checkpoint.name} of {saved_world} on {world}", flush=True)
            record, run = resume_one(case, checkpoint, uninterrupted, int(saved_world) == world)
            records.append({**record, "saved_world": int(saved_world), "world": world})
            first = first or (case, checkpoint, uninterrupted, int(saved_world) == world, run)
        if int(saved_world) != world:
            accelerator, objects = build(case, ACCUMULATION * int(saved_world) // world)
            run = train(case, accelerator, objects, 0, 0, save_to=None)
            if accelerator.is_main_process:
                expected = uninterrupted["parameters"]
                noise = max(largest_difference(run["parameters"][k], v) for k, v in expected.items())
                for record in records:
                    if (record["case"], record["saved_world"]) == (case.name, int(saved_world)):
                        record["noise"] = noise
    case, checkpoint, uninterrupted, same_world, fresh = first
    _, again = resume_one(case, checkpoint, uninterrupted, same_world)
    if PartialState().is_main_process:
        fresh_again = {"checkpoint": f"{case.name}/{checkpoint.name}", "equal": same_bits(fresh, again)}
        report.write_text(json.dumps({"records": records, "fresh_again": fresh_again}, indent=1))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "train":
        train_mode(out, sys.argv[3:])
    else:
        resume_mode(out, Path(sys.argv[3]), sys.argv[4:])


if __name__ == "__main__":
    main()
