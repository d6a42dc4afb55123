"""What does gathering a ZeRO-3 model as autocast computes cost per step, against one bf16 unit per block?

    unison launch --nproc-per-node 2 --cpu benchmarks/sharded_precision.py [--layers 12 --rounds 10]

Under `mixed_precision="bf16"` unison gathers only the projections in bf16 (parallel/precision_units.py):
the norms of all blocks (what autocast reads in fp32) are one more FSDP2 unit, gathered in fp32 once per
step, and the root keeps the embeddings in fp32. That adds one all-gather and one reduce-scatter per step,
and the residual stream is fp32. Compared, on the GPT example's model (--layers x --width, tied
embedding and head), in interleaved rounds inside the same processes:

- **uniform**: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` on every unit, torch's plain
  policy and unison's before: every parameter gathered in bf16, the residual stream bf16;
- **autocast units**: `apply_zero(..., compute_dtype=bf16)`, unison's now.

Both train under `torch.autocast(bfloat16)` with SGD from the same weights on the same batches. Reported:
median step time of each, autocast units / uniform (the ratio that matters: the price of the fp32
residual stream and fp32 norms), also as the median of each round's own ratio and in CPU time of the
process (less sensitive to the rest of a shared machine than wall time), and the all-gathers per
step (torch's CommDebugMode) and their bytes (counted at the c10d op, tests/workers/collective_bytes.py).
The main process prints a table and writes JSON (machine, date, settings, every sample) to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.debug import CommDebugMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "gpt"))
sys.path.insert(0, str(HERE))
from machine import describe_machine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from unison import PartialState  # noqa: E402
from unison.parallel.zero import apply_zero  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "collective_bytes", HERE.parent / "tests/workers/collective_bytes.py"
)
collective_bytes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(collective_bytes)

VARIANTS = ("uniform", "autocast units")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64, help="sequence length")
    parser.add_argument("--batch", type=int, default=8, help="sequences per process and step")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds of every variant")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of one variant per round")
    parser.add_argument("--out", default=str(HERE / "results" / "sharded_precision.json"))
    return parser.parse_args()


def build(variant: str, config: GPTConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(config)
    if variant == "uniform":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        apply_zero(model, 3, mixed_precision_policy=policy)
    else:
        apply_zero(model, 3, compute_dtype=torch.bfloat16)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main() -> None:
    args = parse_args()
    state = PartialState(cpu=True)
    config = GPTConfig(
        block_size=args.tokens, vocab_size=96, n_layer=args.layers, n_head=4, n_embd=args.width
    )
    generator = torch.Generator().manual_seed(1 + state.process_index)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.tokens + 1), generator=generator)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    runs = {variant: build(variant, config) for variant in VARIANTS}
    facts = {}
    for variant, (model, optimizer) in runs.items():
        step(model, optimizer, batch)  # untimed: first-step allocations
        with collective_bytes.CollectiveBytes() as counted, CommDebugMode() as calls:
            step(model, optimizer, batch)
        facts[variant] = {
            "all_gathers_per_step": sum(
                n for op, n in calls.get_comm_counts().items() if "gather" in str(op)
            ),
            "all_gather_bytes_per_step": counted.sent["all_gather"],
        }
    samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    cpu_samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(args.rounds):
        order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            model, optimizer = runs[variant]
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step(model, optimizer, batch)
            samples[variant].append((time.perf_counter() - start) / args.steps * 1e3)
            cpu_samples[variant].append((time.process_time() - cpu_start) / args.steps * 1e3)
    median = {variant: statistics.median(samples[variant]) for variant in VARIANTS}
    # CPU time of this process (all its threads): what a step costs it, less sensitive than wall time to
    # what else runs on a shared machine
    cpu = {variant: statistics.median(cpu_samples[variant]) for variant in VARIANTS}
    ratio = median["autocast units"] / median["uniform"]
    # each round's own ratio: noise from the rest of the machine hits a round's two variants alike
    per_round = statistics.median(a / u for a, u in zip(samples["autocast units"], samples["uniform"]))
    if state.is_main_process:
        print(f"ZeRO-3, bf16, {args.layers} layers x {args.width}, {state.num_processes} processes")
        print("| variant | all-gathers / step | all-gather bytes / step / rank | step (ms) | CPU time (ms) |")
        print("| --- | --- | --- | --- | --- |")
        for variant in VARIANTS:
            fact = facts[variant]
            gathers, sent = fact["all_gathers_per_step"], fact["all_gather_bytes_per_step"]
            print(f"| {variant} | {gathers} | {sent:,} | {median[variant]:.1f} | {cpu[variant]:.1f} |")
        print(f"autocast units / uniform: {ratio:.3f} (median of the rounds' own ratios: {per_round:.3f})")
        print(f"CPU time, autocast units / uniform: {cpu['autocast units'] / cpu['uniform']:.3f}")
        result = {
            "machine": describe_machine(),
            "settings": {**vars(args), "processes": state.num_processes},
            "facts": facts,
            "median_ms": median,
            "ratio": ratio,
            "per_round_ratio": per_round,
            "median_cpu_ms": cpu,
            "cpu_ratio": cpu["autocast units"] / cpu["uniform"],
            "samples_ms": samples,
            "cpu_samples_ms": cpu_samples,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
