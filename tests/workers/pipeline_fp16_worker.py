"""Launched worker: fp16 with its loss scaler under pipeline parallelism (2 processes, pp_size=2).

Each run goes through the ordinary unison loop (`accumulate`, `forward_backward`, `clip_grad_norm_`,
`optimizer.step`, a LambdaLR that changes the lr every step) with mixed_precision="fp16", and is
compared with one process of plain torch doing the same arithmetic: `torch.autocast(fp16)` and
`torch.amp.GradScaler("cpu")` with the same options, on the same micro-batches (the pipeline's), the
scheduler stepped only after steps the scaler took (unison's rule), and with the same loop in fp32
that skips the same windows (what fp16 alone changes one process: the tolerance).

Per window and rank it records whether this rank's own gradients overflowed (checked after unscaling,
before clipping), whether its optimizer skipped, its scale after the step, and whether its parameters
changed: an overflow in one stage must skip the step on both. It also checks the scaler's agreement
directly: gradients that overflow on rank 1 only skip the step on both ranks.

argv[1]: JSON report path (written by process 0); argv[2:]: run names (RUNS).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_gpt import gpt_model
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState
from unison.precision import LayoutGroupedGradScaler
from unison.utils import GradScalerKwargs

BATCH = 4
BLOCK = 8
SEED = 1234
CLIP = 1.3
ACCUMULATION = 2

# name: (parallelism, micro-batches, layers, samples, GradScalerKwargs' options)
RUNS = {
    # 1.75 * 2**18 overflows the first window's c_proj biases of the first stage only (the second stage's
    # gradients are finite); growth_interval=2 brings the scale back to where later windows overflow
    # (the tied embedding's head copy, summed into both stages' copies)
    "1f1b_overflow": (
        "pp_size=2,pp_microbatches=2",
        2,
        2,
        64,
        {"init_scale": 7 * 2.0**16, "growth_interval": 2},
    ),
    "gpipe": ("pp_size=2,pp_microbatches=2,pp_schedule=gpipe", 2, 2, 32, {}),
    "interleaved": ("pp_size=2,pp_microbatches=2,pp_schedule=interleaved", 2, 4, 32, {}),
}


def make_model(n_layer: int) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = gpt_model.GPTConfig(block_size=BLOCK, vocab_size=32, n_layer=n_layer, n_head=2, n_embd=32)
    return gpt_model.GPT(config)


def make_dataset(samples: int) -> TensorDataset:
    tokens = torch.randint(0, 32, (samples, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def mean_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0].float().flatten(0, 1), target.flatten())


def make_optimizer(model: torch.nn.Module):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


def reference(name: str, skipped: list[bool] | None = None) -> dict:
    """One process, plain torch. skipped=None: fp16 with GradScaler; else fp32, skipping those windows."""
    _, microbatches, n_layer, samples, scaler_options = RUNS[name]
    fp16 = skipped is None
    model = make_model(n_layer)
    optimizer, scheduler = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", **scaler_options, enabled=fp16)
    x, y = make_dataset(samples).tensors
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, samples, BATCH)]
    rows = BATCH // microbatches
    result = {"skipped": [], "scales": [], "losses": []}
    for window_index, start in enumerate(range(0, len(batches), ACCUMULATION)):
        for bx, by in batches[start : start + ACCUMULATION]:
            parts = []
            for i in range(0, BATCH, rows):
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    output = model(bx[i : i + rows])
                loss = mean_loss(output, by[i : i + rows])
                scaler.scale(loss / (microbatches * ACCUMULATION)).backward()
                parts.append(loss.item())
            result["losses"].append(sum(parts) / len(parts))
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if fp16:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skip = scaler.get_scale() < before
            result["scales"].append(scaler.get_scale())
        else:
            skip = skipped[window_index]
            if not skip:
                optimizer.step()
        if not skip:
            scheduler.step()
        result["skipped"].append(skip)
        optimizer.zero_grad()
    result["state"] = model.state_dict()
    result["lr"] = scheduler.get_last_lr()[0]
    return result


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (comparing DTensors would be a collective), or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_overflow(parameters: list[torch.Tensor]) -> bool:
    """Whether this rank's own gradients hold an inf or a NaN, before the processes agree."""
    return any(not torch.isfinite(local(p.grad)).all() for p in parameters if p.grad is not None)


def run(name: str) -> dict:
    layout, _, n_layer, samples, scaler_options = RUNS[name]
    accelerator = Accelerator(
        cpu=True,
        mixed_precision="fp16",
        parallelism=layout,
        gradient_accumulation_steps=ACCUMULATION,
        kwargs_handlers=[GradScalerKwargs(**scaler_options)],
    )
    model = make_model(n_layer)
    optimizer, scheduler = make_optimizer(model)
    loader = DataLoader(make_dataset(samples), batch_size=BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    parameters = list(model.parameters())
    losses, windows = [], []  # per window: [own overflow, skipped, scale after, parameters changed]
    for x, y in loader:
        with accelerator.accumulate(model):
            losses.append(accelerator.forward_backward(model, x, y, mean_loss).item())
            if accelerator.sync_gradients:
                accelerator.unscale_gradients()
                overflow = local_overflow(parameters)
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
                before = [local(p).detach().clone() for p in parameters]
            optimizer.step()
            scheduler.step()
            if accelerator.sync_gradients:
                changed = any(not torch.equal(a, local(p)) for a, p in zip(before, parameters))
                skipped = accelerator.optimizer_step_was_skipped
                windows.append([overflow, skipped, accelerator.scaler.get_scale(), changed])
            optimizer.zero_grad()
    per_rank = every_rank(torch.tensor(windows, dtype=torch.float64))  # [rank, window, field]
    full = accelerator.get_state_dict(model)
    expected = reference(name)
    fp32 = reference(name, expected["skipped"])
    result = {
        "own_overflow": per_rank[:, :, 0].bool().tolist(),
        "skipped": per_rank[:, :, 1].bool().tolist(),
        "scales": per_rank[:, :, 2].tolist(),
        "changed": per_rank[:, :, 3].bool().tolist(),
        "expected_skipped": expected["skipped"],
        "expected_scales": expected["scales"],
        "loss_diff": max(abs(a - b) for a, b in zip(losses, expected["losses"], strict=True)),
        "lr": scheduler.get_last_lr()[0],
        "expected_lr": expected["lr"],
    }
    if accelerator.is_main_process:
        result["vs_fp16"] = max_difference(full, expected["state"])
        result["vs_fp32"] = max_difference(full, fp32["state"])
        result["fp16_vs_fp32_one_process"] = max_difference(expected["state"], fp32["state"])
    return result


def max_difference(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((state[key].float() - value).abs().max().item() for key, value in expected.items())


def one_sided_overflow() -> dict:
    """The scaler's agreement alone: rank 1's gradient overflows, rank 0's does not; both must skip."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = LayoutGroupedGradScaler("cpu", init_scale=4.0)
    scaler.agree_across_processes()
    scaler.scale(weight.sum()).backward()
    if dist.get_rank() == 1:
        weight.grad[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    verdict = every_rank(
        torch.tensor([float(torch.equal(weight.detach(), torch.ones(3))), scaler.get_scale()])
    )
    return {"unchanged": verdict[:, 0].bool().tolist(), "scales": verdict[:, 1].tolist()}


def every_rank(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` of every rank, stacked in rank order (accelerator.gather covers the data-parallel ranks
    only; here each pipeline rank reports its own stages)."""
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered)


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    state = PartialState(cpu=True)
    report = {"one_sided_overflow": one_sided_overflow(), "runs": {}}
    for name in names:
        try:
            report["runs"][name] = run(name)
        except (ValueError, RuntimeError) as error:  # the same on every rank: reported, not hung
            report["runs"][name] = {"error": f"{type(error).__name__}: {error}"}
    if state.is_main_process:
        out.write_text(json.dumps({"world": state.num_processes, **report}))


if __name__ == "__main__":
    main()
