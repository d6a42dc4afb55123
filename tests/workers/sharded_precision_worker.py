"""Launched worker: mixed precision under the sharded layouts, bytes on the wire and fidelity.

For each layout named on the command line and each precision (fp32, bf16) it trains the tiny GPT
through the ordinary loop (prepare, accumulate 2, backward, clipping, a rate that changes every step,
a loader whose last window is short), counting the bytes each collective kind sends
(collective_bytes.py), and compares the consolidated parameters with one process of plain torch,
fp32 or under bf16 autocast (computed here, on every rank). The last layout also runs in fp32 with
sync_each_batch=False (gradients reduced once per window instead of every micro-batch, the default
under FSDP2). Process 0 writes a JSON report to argv[1].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from collective_bytes import CollectiveBytes
from tiny_gpt import make_tiny_gpt
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, GradientAccumulationPlugin, PartialState

SEED, BLOCK, SAMPLES, GLOBAL_BATCH, ACCUMULATION, MAX_NORM = 3, 16, 44, 8, 2, 0.6


def dataset() -> TensorDataset:
    tokens = torch.randint(0, 32, (SAMPLES, BLOCK + 1), generator=torch.Generator().manual_seed(11))
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def optimizer_and_scheduler(params):
    optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)


def reference(precision: str) -> dict[str, torch.Tensor]:
    """One process: each window's samples at once (the last window holds 4), autocast for bf16."""
    model = make_tiny_gpt(SEED, BLOCK)
    optimizer, scheduler = optimizer_and_scheduler(model.parameters())
    inputs, targets = dataset().tensors
    for start in range(0, SAMPLES, GLOBAL_BATCH):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            _, loss = model(inputs[start : start + GLOBAL_BATCH], targets[start : start + GLOBAL_BATCH])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model.state_dict()


def train(
    layout: str, precision: str, sync_each_batch: bool | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, int], int]:
    AcceleratorState._reset_state()  # one precision per Accelerator: a new one for each run
    plugin = GradientAccumulationPlugin(num_steps=ACCUMULATION, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(
        cpu=True, parallelism=layout, mixed_precision=precision, gradient_accumulation_plugin=plugin
    )
    model = make_tiny_gpt(SEED, BLOCK)
    optimizer, scheduler = optimizer_and_scheduler(model.parameters())
    micro_batch = GLOBAL_BATCH // (accelerator.num_processes * ACCUMULATION)
    loader = DataLoader(dataset(), batch_size=micro_batch)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    steps = 0
    with CollectiveBytes() as counted:
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                _, loss = model(inputs, targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    steps += 1
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return accelerator.get_state_dict(model), dict(counted.sent), steps


def max_difference(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((state[key].float() - expected[key]).abs().max().item() for key in expected)


def main() -> None:
    out, layouts = Path(sys.argv[1]), sys.argv[2:]
    state = PartialState(cpu=True)
    expected = {precision: reference(precision) for precision in ("no", "bf16")}
    report: dict = {"bf16_vs_fp32_one_process": max_difference(expected["bf16"], expected["no"])}
    runs = [(layout, precision, None) for layout in layouts for precision in ("no", "bf16")]
    for layout, precision, sync_each_batch in [*runs, (layouts[-1], "no", False)]:
        parameters, sent, steps = train(layout, precision, sync_each_batch)
        entry = {"bytes": sent, "steps": steps}
        if state.is_main_process:
            entry["dtypes"] = sorted({str(t.dtype) for t in parameters.values()})
            entry["vs_same_precision"] = max_difference(parameters, expected[precision])
            entry["vs_fp32"] = max_difference(parameters, expected["no"])
        name = f"{layout}/{precision}" + ("" if sync_each_batch is None else "/sync_each_batch=False")
        report[name] = entry
    if state.is_main_process:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
