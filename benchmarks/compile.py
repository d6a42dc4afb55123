"""What does torch.compile at prepare() buy here? The GPT example's training step, eager and compiled.

    python benchmarks/compile.py [--rounds 10 --steps-per-round 3 --threads 1]

One process, three copies of the same model (examples/gpt, 4 layers x 256 wide by default, ~3.2M
parameters) prepared by three Accelerators: "eager" (no dynamo_backend), "blocks" (dynamo_backend=
"inductor": each transformer block compiled in place, unison's default) and "whole"
(TorchDynamoPlugin(backend="inductor", use_regional_compilation=False): the whole model compiled, as
Accelerate does). Each trains on the same batches (AdamW, fp32).

- Cold compile: the first step of each compiled copy, minus a median eager step, with an empty inductor
  cache (a fresh TORCHINDUCTOR_CACHE_DIR): what a user waits before the first step of a new run.
- Step time: interleaved rounds (eager, blocks, whole, with the order rotating each round), so whatever
  else the machine does hits all alike; median ms per optimizer step and eager/compiled (the speed-up),
  in wall-clock time and in this process's CPU time (steadier on a shared machine: time spent waiting
  for a core does not count; with one thread it is the step's compute).
- Fidelity: max |parameter difference| of each compiled copy from the eager one after the same steps
  (inductor fuses and reorders floating-point work: not bit-identical).

Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# an empty inductor cache, before torch is imported: the first compile is a cold one
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="unison-compile-bench-"))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from machine import describe_machine  # noqa: E402  (benchmarks/, the script's own folder)
from model import GPT, GPTConfig  # noqa: E402

from unison import Accelerator  # noqa: E402
from unison.utils import TorchDynamoPlugin  # noqa: E402

VARIANTS = {
    "eager": None,
    "blocks": TorchDynamoPlugin(backend="inductor"),
    "whole": TorchDynamoPlugin(backend="inductor", use_regional_compilation=False),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arg = parser.add_argument
    arg("--rounds", type=int, default=10, help="interleaved rounds of the three copies")
    arg("--steps-per-round", type=int, default=3, help="optimizer steps of each copy per round")
    arg("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    arg("--batch-size", type=int, default=16)
    arg("--block-size", type=int, default=128)
    arg("--n-layer", type=int, default=4)
    arg("--n-head", type=int, default=4)
    arg("--n-embd", type=int, default=256)
    arg("--vocab-size", type=int, default=96, help="the example's character vocabulary is about this size")
    arg("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "compile.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = GPTConfig(
        block_size=args.block_size,
        vocab_size=args.vocab_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    copies = {}
    for name, plugin in VARIANTS.items():
        torch.manual_seed(0)  # the same weights in every copy
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        accelerator = Accelerator(cpu=True, dynamo_plugin=plugin)
        model, optimizer = accelerator.prepare(model, optimizer)
        # each copy its own stream of the same batches
        copies[name] = (accelerator, model, optimizer, torch.Generator().manual_seed(1))
    parameters = sum(p.numel() for p in copies["eager"][1].parameters())

    cpu_times: dict[str, list[float]] = {name: [] for name in VARIANTS}  # this process's CPU seconds

    def step(name: str) -> float:
        accelerator, model, optimizer, generator = copies[name]
        tokens = torch.randint(
            0, args.vocab_size, (args.batch_size, args.block_size + 1), generator=generator
        )
        start, cpu_start = time.perf_counter(), time.process_time()
        _, loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        cpu_times[name].append(time.process_time() - cpu_start)
        return time.perf_counter() - start

    load_before = os.getloadavg()
    first = {name: step(name) for name in VARIANTS}  # the compiled copies compile here
    second = {name: step(name) for name in VARIANTS}  # e.g. a recompile for a changed guard
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            times[name] += [step(name) for _ in range(args.steps_per_round)]
    median = {name: statistics.median(values) for name, values in times.items()}
    cpu_median = {name: statistics.median(values[2:]) for name, values in cpu_times.items()}  # timed steps
    eager_state = copies["eager"][1].state_dict()
    results = {}
    for name in VARIANTS:
        state = copies[name][1].state_dict()
        results[name] = {
            "first_step_s": first[name],
            "second_step_s": second[name],
            "cold_compile_s": None if name == "eager" else first[name] + second[name] - 2 * median["eager"],
            "median_step_ms": 1000 * median[name],
            "step_ms_all": [1000 * t for t in times[name]],
            "speedup_vs_eager": median["eager"] / median[name],
            "median_step_cpu_ms": 1000 * cpu_median[name],
            "speedup_vs_eager_cpu_time": cpu_median["eager"] / cpu_median[name],
            "max_abs_param_diff_vs_eager": max((state[k] - eager_state[k]).abs().max().item() for k in state),
        }
    report = {
        "benchmark": "compile",
        "what": "GPT example training step (AdamW, fp32), one process, eager vs torch.compile(inductor) "
        "at prepare(): per block (unison's default) and whole model",
        "machine": describe_machine(),
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "config": {**vars(args), "out": str(args.out), "parameters": parameters},
        "results": results,
    }
    print(
        f"GPT {args.n_layer} layers x {args.n_embd}, {parameters / 1e6:.2f}M parameters, batch "
        f"{args.batch_size} x {args.block_size} tokens, {args.threads} thread(s), torch {torch.__version__}"
    )
    print(
        f"{'variant':<8} {'cold compile s':>15} {'step ms (median)':>17} {'eager/compiled':>15} "
        f"{'CPU ms (median)':>16} {'eager/compiled':>15} {'max |dp|':>10}"
    )
    for name, r in results.items():
        cold = "-" if r["cold_compile_s"] is None else f"{r['cold_compile_s']:.1f}"
        print(
            f"{name:<8} {cold:>15} {r['median_step_ms']:>17.1f} {r['speedup_vs_eager']:>15.3f} "
            f"{r['median_step_cpu_ms']:>16.1f} {r['speedup_vs_eager_cpu_time']:>15.3f} "
            f"{r['max_abs_param_diff_vs_eager']:>10.1e}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
