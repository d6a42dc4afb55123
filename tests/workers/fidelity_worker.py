"""Launched worker (also run in-process for one process): the same training on any split of the batch.

Per optimizer step the run consumes GLOBAL_MICRO_BATCHES micro-batches of MICRO_BATCH samples from a
shuffled loader: with N processes each process takes GLOBAL_MICRO_BATCHES / N of them as accumulation
steps (N=1: 4, N=2: 2, N=4: 1). Three trainings of a tiny GPT (examples/gpt/model.py) run here:

- "mean_sgd", "mean_adamw": the model's own mean cross-entropy, `accelerator.backward(loss)`;
- "items_sgd": sequences padded to BLOCK with a variable number of valid tokens, the loss summed over
  the valid ones and `accelerator.backward(loss, num_items=valid_count)`.

Every run clips with `accelerator.clip_grad_norm_` at a norm that some steps' gradients exceed and
others do not, so both a clip that saw unnormalised gradients and a wrongly scaled gradient change
the parameters (clipping every step would hide a wrong scale: it rescales to the same norm). The main process
writes each run's final state_dict to OUT/<run>.pt (torch.save) and, in OUT/<run>.json, the sample
ids each optimizer step consumed and the gradient norms clip_grad_norm_ returned; the test compares
them across process counts and with the single-process reference `reference_items`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_gpt import make_optimizer, make_tiny_gpt
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState, set_seed

GLOBAL_MICRO_BATCHES = 4  # num_processes x gradient_accumulation_steps
MICRO_BATCH = 2  # samples per process per micro-step
STEPS = 5
BLOCK = 16
SEED = 1234
MAX_NORM = 0.8  # between the runs' gradient norms (0.75 to 1.8): some steps clip, some do not
IGNORE = -100  # label of padding positions (cross_entropy's ignore_index)


def make_model() -> torch.nn.Module:
    return make_tiny_gpt(SEED, BLOCK)


def make_dataset(padded: bool) -> TensorDataset:
    """ids, input tokens, targets; padded: each sequence has 1..BLOCK valid tokens, targets IGNORE after."""
    num_samples = STEPS * GLOBAL_MICRO_BATCHES * MICRO_BATCH
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 32, (num_samples, BLOCK + 1), generator=generator)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if padded:
        lengths = torch.randint(1, BLOCK + 1, (num_samples,), generator=generator)
        padding = torch.arange(BLOCK) >= lengths[:, None]
        inputs[padding] = 0
        targets[padding] = IGNORE
    return TensorDataset(torch.arange(num_samples), inputs, targets)


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of the valid tokens' cross-entropies, and how many valid tokens there are."""
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss, (targets != IGNORE).sum()


def train(run: str, optimizer_name: str, use_items: bool) -> dict:
    """One training through unison on however many processes this script runs in."""
    num_processes = PartialState(cpu=True).num_processes
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GLOBAL_MICRO_BATCHES // num_processes)
    set_seed(SEED)
    model = make_model()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    loader = DataLoader(make_dataset(padded=use_items), batch_size=MICRO_BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step_ids, window_ids, grad_norms = [], [], []
    for ids, inputs, targets in loader:
        with accelerator.accumulate(model):
            if use_items:
                logits, _ = model(inputs)
                loss, valid = summed_token_loss(logits, targets)
                accelerator.backward(loss, num_items=valid)
            else:
                _, loss = model(inputs, targets)
                accelerator.backward(loss)
            window_ids.extend(accelerator.gather(ids).tolist())
            if accelerator.sync_gradients:
                grad_norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
                step_ids.append(sorted(window_ids))
                window_ids = []
            optimizer.step()
            optimizer.zero_grad()
    return {
        "run": run,
        "state_dict": accelerator.unwrap_model(model).state_dict(),
        "step_ids": step_ids,
        "grad_norms": grad_norms,
        "is_main_process": accelerator.is_main_process,
    }


def reference_items(
    step_ids: list[list[int]], micro_batch: int, normalisation: str = "global"
) -> tuple[dict, list[float]]:
    """One process, plain torch, each step's samples (given by id) at once or in micro-batches.

    normalisation "global": the mean over all valid tokens of the step (what num_items must give);
    "per_micro_batch": each micro-batch's own token mean, averaged over the micro-batches (the
    naive loss peers use). Returns the final state_dict and the gradient norm before each clip.
    """
    _, inputs, targets = make_dataset(padded=True).tensors
    model = make_model()
    optimizer = make_optimizer("sgd", model.parameters())
    grad_norms = []
    for ids in step_ids:
        chunks = torch.tensor(ids).split(micro_batch)
        total_valid = (targets[ids] != IGNORE).sum()
        for chunk in chunks:
            logits, _ = model(inputs[chunk])
            loss, valid = summed_token_loss(logits, targets[chunk])
            loss = loss / total_valid if normalisation == "global" else loss / valid / len(chunks)
            loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), grad_norms


def run_all(out_dir: Path) -> None:
    """The three trainings; the main process writes OUT/<run>.pt and OUT/<run>.json."""
    for run, optimizer_name, use_items in (
        ("mean_sgd", "sgd", False),
        ("mean_adamw", "adamw", False),
        ("items_sgd", "sgd", True),
    ):
        result = train(run, optimizer_name, use_items)
        if result.pop("is_main_process"):
            torch.save(result.pop("state_dict"), out_dir / f"{run}.pt")
            (out_dir / f"{run}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_all(Path(sys.argv[1]))
