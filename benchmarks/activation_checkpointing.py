"""What does activation checkpointing save, and what does it cost? The GPT example, one process.

    OMP_NUM_THREADS=1 python benchmarks/activation_checkpointing.py \\
        [--rounds 15 --layers 6 --width 256 --seq 256 --batch 8]

For each mode (none, full, selective:2, selective op-level) the same model (examples/gpt/model.py,
same seed) is prepared by `Accelerator(activation_checkpointing=MODE)`, and:

1. Memory: the bytes one forward leaves saved for backward, measured exactly with
   torch.autograd.graph.saved_tensors_hooks (planning.activation_memory.measure_saved_activations), beside
   the estimate of `unison estimate-memory --activation-checkpointing MODE` split as activation_parts
   gives it (kept after forward; rebuilt at once in backward). Reported: measured/estimated kept, and
   saved/none (the fraction of the activations kept).
2. Time: the median of one training step (forward, backward, SGD step), the modes in interleaved rounds
   (none, full, selective:2, op, none, ...) so the machine's other load hits all alike. Reported:
   time/none (wall clock) and cpu/none (this process's CPU time, which a shared machine's other load
   disturbs far less: the cost of the recomputation itself). Run with OMP_NUM_THREADS=1 for the CPU
   time to be the work of one thread.

Prints a table and writes JSON to --out (default benchmarks/results/activation_checkpointing.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from machine import describe_machine  # noqa: E402  (benchmarks/, the script's own folder)
from model import GPT, GPTConfig  # noqa: E402

from unison import Accelerator  # noqa: E402
from unison.parallel.blocks import find_blocks  # noqa: E402
from unison.planning.activation_memory import activation_parts, measure_saved_activations  # noqa: E402
from unison.planning.memory import inspect_model  # noqa: E402

MODES = ("none", "full", "selective:2", "selective:op")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arg = parser.add_argument
    arg("--rounds", type=int, default=15, help="interleaved rounds; each times one step of every mode")
    arg("--warmup", type=int, default=2, help="untimed steps of each mode first")
    arg("--layers", type=int, default=6)
    arg("--width", type=int, default=256)
    arg("--heads", type=int, default=4)
    arg("--seq", type=int, default=256)
    arg("--batch", type=int, default=8)
    arg("--vocab", type=int, default=96)
    arg("--out", default=str(Path(__file__).resolve().parent / "results" / "activation_checkpointing.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = GPTConfig(
        block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, n_embd=args.width
    )
    tokens = torch.randint(
        0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        logits, _ = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    runs = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = GPT(config)
        shape = inspect_model(model)
        accelerator = Accelerator(cpu=True, activation_checkpointing=None if mode == "none" else mode)
        model = accelerator.prepare(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        blocks = list(find_blocks(model)[1]) if mode == "selective:op" else ()
        saved, loss = measure_saved_activations(model, lambda m=model: loss_of(m), blocks)
        loss.backward()
        optimizer.zero_grad()
        kept, rebuilt = activation_parts(shape, args.batch, args.seq, 4, None if mode == "none" else mode)
        runs[mode] = {
            "model": model,
            "optimizer": optimizer,
            "saved": saved,
            "kept": kept,
            "rebuilt": rebuilt,
        }

    def step(run: dict) -> tuple[float, float]:
        start, start_cpu = time.perf_counter(), time.process_time()
        loss_of(run["model"]).backward()
        run["optimizer"].step()
        run["optimizer"].zero_grad()
        return time.perf_counter() - start, time.process_time() - start_cpu

    for run in runs.values():
        for _ in range(args.warmup):
            step(run)
    times = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode].append(step(runs[mode]))
    wall = {mode: statistics.median(t for t, _ in times[mode]) for mode in MODES}
    cpu = {mode: statistics.median(c for _, c in times[mode]) for mode in MODES}
    none_saved = runs["none"]["saved"]
    rows = []
    for mode in MODES:
        run = runs[mode]
        rows.append(
            {
                "mode": mode,
                "saved_bytes": run["saved"],
                "estimated_kept_bytes": run["kept"],
                "estimated_rebuilt_bytes": run["rebuilt"],
                "measured_over_estimate": run["saved"] / run["kept"],
                "saved_over_none": run["saved"] / none_saved,
                "step_s_median": wall[mode],
                "time_over_none": wall[mode] / wall["none"],
                "cpu_s_median": cpu[mode],
                "cpu_over_none": cpu[mode] / cpu["none"],
            }
        )
    print(
        f"GPT {args.layers} layers x {args.width} wide, {args.heads} heads, micro-batch {args.batch} x "
        f"{args.seq} tokens, fp32, 1 process; {args.rounds} interleaved rounds"
    )
    header = (
        "mode",
        "saved MiB",
        "est. kept",
        "meas/est",
        "est. rebuilt",
        "saved/none",
        "step ms",
        "time/none",
        "cpu/none",
    )
    print("".join(f"{h:>14}" for h in header))
    mib = 2**20
    for row in rows:
        cells = (
            f"{row['saved_bytes'] / mib:.2f}",
            f"{row['estimated_kept_bytes'] / mib:.2f}",
            f"{row['measured_over_estimate']:.3f}",
            f"{row['estimated_rebuilt_bytes'] / mib:.2f}",
            f"{row['saved_over_none']:.3f}",
            f"{row['step_s_median'] * 1e3:.1f}",
            f"{row['time_over_none']:.3f}",
            f"{row['cpu_over_none']:.3f}",
        )
        print(f"{row['mode']:>14}" + "".join(f"{cell:>14}" for cell in cells))
    result = {"machine": describe_machine(), "args": vars(args), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
