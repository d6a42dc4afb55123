"""Elements each collective moves in one tensor-parallel training step of the GPT example, by module.

    python benchmarks/tp_traffic.py                 # tp=2 on 2 processes, about 30 s on 2 cores

Launches itself under `unison launch --cpu --nproc-per-node 2`, prepares the GPT example's model with
`Accelerator(parallelism="tp_size=2")` (the built-in plan: fused q|k|v `c_attn` column-parallel,
`c_proj` row-parallel, the tied embedding and head split over the vocabulary) and runs one forward and
one backward under torch's `CommDebugMode`, extended to add up the elements of every collective
(all-gather: the gathered output; reduce-scatter and all-reduce: the input), split into forward and
backward, and into the fused projections (`c_attn`) and the rest of the model.

What matters: tensor parallelism exists to move activations, not weights, so the `c_attn` rows must
read 0 in both passes. Two models: the "toy" GPT the tests train (2 layers x 32 wide, vocabulary 32,
4 sequences of 16) and the benchmark GPT of strategies.py (4 layers x 128, vocabulary 96, 16 x 64).
The main process prints the table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.distributed.tensor.debug import CommDebugMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "gpt"))
sys.path.insert(0, str(HERE))
from machine import describe_machine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from unison import Accelerator  # noqa: E402

MODELS = {  # name -> (config, batch)
    "toy": (dict(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32), 4),
    "benchmark": (dict(block_size=64, vocab_size=96, n_layer=4, n_head=4, n_embd=128), 16),
}


class ElementCounter(CommDebugMode):
    """CommDebugMode that also adds up the elements of each collective, per (pass, part, collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and sum(self.comm_counts.values()) > before:
            inputs = [a.numel() for a in args if isinstance(a, torch.Tensor)]
            name = func._overloadpacket.__name__
            moved = out.numel() if "all_gather" in name and isinstance(out, torch.Tensor) else max(inputs)
            tracker = self.advanced_module_tracker
            where = "c_attn" if tracker.name.endswith("c_attn") else "rest"
            key = f"{'backward' if tracker.is_bw else 'forward'} {where} {name}"
            self.elements[key] += moved
            self.calls[key] += 1
        return out


def measure(name: str) -> dict[str, dict[str, int]]:
    config, batch = MODELS[name]
    accelerator = Accelerator(cpu=True, parallelism="tp_size=2")
    torch.manual_seed(0)
    model = accelerator.prepare(GPT(GPTConfig(**config)))
    tokens = torch.randint(0, config["vocab_size"], (batch, config["block_size"] + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    model(x, y)[1].backward()  # warm-up: lazy initialisation outside the count
    model.zero_grad()
    with ElementCounter() as counter:
        model(x, y)[1].backward()
    return {
        key: {"calls": counter.calls[key], "elements": counter.elements[key]} for key in sorted(counter.calls)
    }


def launch(out: Path) -> dict:
    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", "2", "--cpu", __file__]
    subprocess.run([*command, "--worker", str(out)], check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "tp_traffic.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        results = {name: measure(name) for name in MODELS}
        if Accelerator().is_main_process:
            args.worker.write_text(json.dumps(results))
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = launch(Path(tmp) / "traffic.json")
    print(f"{'model':<10} {'pass':<9} {'part':<7} {'collective':<24} {'calls':>5} {'elements':>10}")
    for name, rows in results.items():
        for key, row in rows.items():
            step, part, collective = key.split(" ")
            print(f"{name:<10} {step:<9} {part:<7} {collective:<24} {row['calls']:>5} {row['elements']:>10,}")
        for step in ("forward", "backward"):
            gathers = {k: v["elements"] for k, v in rows.items() if k.startswith(step) and "all_gather" in k}
            fused = sum(v for k, v in gathers.items() if " c_attn " in k)
            print(f"{name:<10} {step:<9} all-gather elements: {sum(gathers.values()):,}, c_attn's: {fused:,}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": describe_machine(), "tp_size": 2, "models": results}, indent=1)
    )


if __name__ == "__main__":
    main()
