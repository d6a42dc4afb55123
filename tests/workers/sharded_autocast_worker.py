"""Launched worker: ZeRO-2/3 in half precision compute what one process computes under autocast.

For each depth named on the command line it builds the GPT example's model (that many blocks, 32 wide,
tied embedding and head) and trains it 6 steps through the ordinary loop (prepare, accumulate 2 with
gradients reduced once per window, backward) under DDP, ZeRO-2 and ZeRO-3 in bf16, under DDP and ZeRO-3
in fp16 (with the gradient scaler), and under ZeRO-3 in fp32 (for the all-gather bytes). Each run's
consolidated parameters are compared with one process of plain torch under autocast (computed here, on
process 0, whose report is written) and with the DDP run of the same precision; the dtypes that enter
and leave the blocks (the residual stream) and the bytes each collective sends are recorded. Last, a
model whose blocks read their norm's parameters themselves (as a fused add-and-norm kernel does, never
calling the norm) trains and evaluates under DDP and ZeRO-3 in bf16. Process 0 writes a JSON report to
argv[1]; argv[2:] are the depths.

Why no clipping, and sync_each_batch=False: both make FSDP2 add the same fp32 numbers in another order
than DDP (the sharded total norm; reduce-scatters per micro-batch summed afterwards), and in half
precision any fp32-level difference moves some weight across a rounding boundary, which then grows like
any bf16 noise (measured: 2.4e-4 between ZeRO and DDP at 2 blocks, 2.3e-4 with clipping at 12; either
side as often closer to the one-process run). Without them the sharded step is DDP's bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from collective_bytes import CollectiveBytes
from tiny_gpt import gpt_model
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, GradientAccumulationPlugin, PartialState

SEED, BLOCK, SAMPLES, GLOBAL_BATCH, ACCUMULATION = 5, 16, 48, 8, 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}
RUNS = (("ddp", "bf16"), ("zero2", "bf16"), ("zero3", "bf16"), ("ddp", "fp16"), ("zero3", "fp16"))
RUNS += (("zero3", "no"),)


def make_model(depth: int) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = gpt_model.GPTConfig(block_size=BLOCK, vocab_size=32, n_layer=depth, n_head=2, n_embd=32)
    return gpt_model.GPT(config)


def dataset() -> TensorDataset:
    tokens = torch.randint(0, 32, (SAMPLES, BLOCK + 1), generator=torch.Generator().manual_seed(13))
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)  # SGD: rounding noise stays small (engine notes)


def reference(depth: int, precision: str) -> dict[str, torch.Tensor]:
    """One process: each window's samples at once, under autocast, fp16 with torch's gradient scaler."""
    model = make_model(depth)
    optimizer = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    inputs, targets = dataset().tensors
    for start in range(0, SAMPLES, GLOBAL_BATCH):
        window = slice(start, start + GLOBAL_BATCH)
        with torch.autocast("cpu", dtype=DTYPES[precision] or torch.bfloat16, enabled=precision != "no"):
            _, loss = model(inputs[window], targets[window])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return model.state_dict()


def train(depth: int, layout: str, precision: str) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(consolidated parameters, bytes sent per collective kind, dtypes seen entering and leaving blocks)."""
    AcceleratorState._reset_state()  # one precision per Accelerator: a new one for each run
    plugin = GradientAccumulationPlugin(num_steps=ACCUMULATION, sync_each_batch=False)
    accelerator = Accelerator(
        cpu=True, parallelism=layout, mixed_precision=precision, gradient_accumulation_plugin=plugin
    )
    model = make_model(depth)
    stream: set[str] = set()
    for block in model.transformer.h:
        block.register_forward_hook(lambda m, args, out: stream.update({str(args[0].dtype), str(out.dtype)}))
    optimizer = make_optimizer(model.parameters())
    micro_batch = GLOBAL_BATCH // (accelerator.num_processes * ACCUMULATION)
    loader = DataLoader(dataset(), batch_size=micro_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with CollectiveBytes() as counted:
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                _, loss = model(inputs, targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return accelerator.get_state_dict(model), dict(counted.sent), sorted(stream)


class FusedNormBlock(torch.nn.Module):
    """x + fc(layer_norm(x)), the norm's weight and bias read here: its module's forward never runs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.layer_norm(x, x.shape[-1:], self.norm.weight, self.norm.bias)
        return x + self.fc(normed)


def train_fused_norms(layout: str) -> dict[str, torch.Tensor]:
    """3 steps of 3 FusedNormBlocks and a head, then a forward in eval mode without gradients."""
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True, parallelism=layout, mixed_precision="bf16")
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(*[FusedNormBlock(16) for _ in range(3)], torch.nn.Linear(16, 1))
    model, optimizer = accelerator.prepare(model, make_optimizer(model.parameters()))
    inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(accelerator.process_index))
    for _ in range(3):
        accelerator.backward(model(inputs).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        model.eval()(inputs)
    return accelerator.get_state_dict(model)


def distance(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((state[key].float() - expected[key]).abs().max().item() for key in expected)


def main() -> None:
    out, depths = Path(sys.argv[1]), [int(depth) for depth in sys.argv[2:]]
    state = PartialState(cpu=True)
    report: dict = {}
    for depth in depths:
        # the report is process 0's: the others need no reference
        expected = {precision: reference(depth, precision) for precision in DTYPES if state.is_main_process}
        for layout, precision in RUNS:
            parameters, sent, stream = train(depth, layout, precision)
            if layout == "ddp":
                ddp = parameters
            if state.is_main_process:
                report[f"{depth}/{layout}/{precision}"] = {
                    "vs_one_process": distance(parameters, expected[precision]),
                    "vs_ddp": distance(parameters, ddp) if precision != "no" else None,
                    "bytes": sent,
                    "stream": stream,
                    "dtypes": sorted({str(t.dtype) for t in parameters.values()}),
                }
    fused = {layout: train_fused_norms(layout) for layout in ("ddp", "zero3")}
    if state.is_main_process:
        report["fused_norms/zero3/bf16"] = {"vs_ddp": distance(fused["zero3"], fused["ddp"])}
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
