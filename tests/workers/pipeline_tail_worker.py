"""Launched worker: a pipeline trains and evaluates through an epoch whose last batch is short.

A loader of N samples in batches of 4 with drop_last=False (PyTorch's default) ends on a batch of
N % 4. Every run goes through the ordinary unison loop (`accumulate`, `forward_backward`,
`clip_grad_norm_`, `optimizer.step`, a scheduler that changes the lr every step, `forward_loss` over an
evaluation loader with the same short tail) and is compared with the same loop done by hand in this
process on one model: each accumulation window the mean of its micro-batches' mean losses (the
epoch's last window may hold fewer micro-batches: the mean over those), clipped, stepped.

argv[1]: JSON report path (written by process 0); argv[2:]: run names (RUNS).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_gpt import gpt_model
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState

BATCH = 4
BLOCK = 8
SEED = 1234
CLIP = 1.3  # the first window's gradient norm exceeds it, the second's not, the last's in some runs
ACCUMULATION = 2

# name: (parallelism, samples in the epoch, layers, summed loss with num_items)
RUNS = {
    "1f1b_m2_tail2": ("pp_size=2,pp_microbatches=2", 18, 2, False),  # 1 micro-batch of 2 for the tail
    "1f1b_m2_tail2_in_window": ("pp_size=2,pp_microbatches=2", 14, 2, False),  # windows (4, 4), (4, 2)
    "1f1b_m4_tail2": ("pp_size=2,pp_microbatches=4", 18, 2, False),  # 2 samples, 4 micro-batches
    "gpipe_m2_tail3": ("pp_size=2,pp_microbatches=2,pp_schedule=gpipe", 19, 2, False),  # 3 samples, 2 mb
    "1f1b_m2_tail3_items": ("pp_size=2,pp_microbatches=2", 19, 2, True),  # summed loss, num_items
    "interleaved_m2_tail2": ("pp_size=2,pp_microbatches=2,pp_schedule=interleaved", 18, 4, False),
}


def make_model(n_layer: int) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = gpt_model.GPTConfig(block_size=BLOCK, vocab_size=32, n_layer=n_layer, n_head=2, n_embd=32)
    return gpt_model.GPT(config)


def make_dataset(samples: int, seed: int) -> TensorDataset:
    tokens = torch.randint(0, 32, (samples, BLOCK + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def mean_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0].flatten(0, 1), target.flatten())


def summed_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0].flatten(0, 1), target.flatten(), reduction="sum")


def make_optimizer(model: torch.nn.Module):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


def reference(samples: int, n_layer: int, summed: bool) -> dict:
    """One process, plain torch: the loop's arithmetic written out."""
    model = make_model(n_layer)
    optimizer, scheduler = make_optimizer(model)
    x, y = make_dataset(samples, 0).tensors
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, samples, BATCH)]
    losses, norms = [], []
    for start in range(0, len(batches), ACCUMULATION):
        window = batches[start : start + ACCUMULATION]
        if summed:  # the mean over every token of the window
            tokens = sum(wy.numel() for _, wy in window)
            loss = sum(summed_loss(model(wx), wy) for wx, wy in window) / tokens
            losses.extend(summed_loss(model(wx), wy).item() for wx, wy in window)
        else:  # the mean of the window's micro-batch means
            parts = [mean_loss(model(wx), wy) for wx, wy in window]
            loss = sum(parts) / len(parts)
            losses.extend(p.item() for p in parts)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    ex, ey = make_dataset(samples, 1).tensors
    model.eval()
    with torch.no_grad():
        eval_losses = [
            mean_loss(model(ex[i : i + BATCH]), ey[i : i + BATCH]).item() for i in range(0, samples, BATCH)
        ]
    return {"state": model.state_dict(), "losses": losses, "norms": norms, "eval_losses": eval_losses}


def run(name: str) -> dict:
    layout, samples, n_layer, summed = RUNS[name]
    accelerator = Accelerator(cpu=True, parallelism=layout, gradient_accumulation_steps=ACCUMULATION)
    model = make_model(n_layer)
    optimizer, scheduler = make_optimizer(model)
    train_dl = DataLoader(make_dataset(samples, 0), batch_size=BATCH)
    eval_dl = DataLoader(make_dataset(samples, 1), batch_size=BATCH)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    losses, norms = [], []
    for x, y in train_dl:
        with accelerator.accumulate(model):
            if summed:
                loss = accelerator.forward_backward(model, x, y, summed_loss, num_items=y.numel())
            else:
                loss = accelerator.forward_backward(model, x, y, mean_loss)
            losses.append(loss.item())
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    model.eval()
    eval_losses = [accelerator.forward_loss(model, x, y, mean_loss).item() for x, y in eval_dl]
    full = accelerator.get_state_dict(model)
    expected = reference(samples, n_layer, summed)
    result = {
        "batches": len(losses),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, expected["losses"], strict=True)),
        "norm_diff": max(abs(a - b) for a, b in zip(norms, expected["norms"], strict=True)),
        "clipped": sum(n > CLIP for n in expected["norms"]),
        "eval_diff": max(abs(a - b) for a, b in zip(eval_losses, expected["eval_losses"], strict=True)),
        "lr": scheduler.get_last_lr()[0],
    }
    if accelerator.is_main_process:
        result["max_abs_diff"] = max((full[k] - v).abs().max().item() for k, v in expected["state"].items())
    return result


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    state = PartialState(cpu=True)
    report = {}
    for name in names:
        try:
            report[name] = run(name)
        except (ValueError, RuntimeError) as error:  # the same on every rank: reported, not hung
            report[name] = {"error": f"{type(error).__name__}: {error}"}
    if state.is_main_process:
        out.write_text(json.dumps({"world": state.num_processes, "runs": report}))


if __name__ == "__main__":
    main()
