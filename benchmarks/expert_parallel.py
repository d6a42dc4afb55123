"""Expert parallelism against ZeRO-3 on the GPT example's mixture of experts: memory, bytes, step time.

    python benchmarks/expert_parallel.py            # 2 and 4 processes, about 3 minutes on 2 cores
    python benchmarks/expert_parallel.py --rounds 1 --steps 4

The model is the GPT example with `n_experts=8` (4 blocks x 128 wide, 2 experts per token, 64-character
context, AdamW), 16 sequences per optimizer step over all processes. For each process count N (2, 4)
it launches itself under `unison launch --cpu` once per layout and round, the layouts interleaved
(ZeRO-3 over N, then `ep_size=N`, then at 4 also `ep_size=2` beside dp_shard 4), and measures on each
process:

- expert bytes stored: the local shards of the experts' parameters after prepare() (fp32), against
  the formula: all experts' parameters / N under both layouts (EP divides by ep, ZeRO by N/ep more);
- expert bytes gathered per layer: what the experts module holds when its forward starts (ZeRO-3: the
  whole layer's experts, gathered with the block; EP: its own E/ep), against the formula;
- bytes each collective moves per step, counted at the c10d op (tests/workers/collective_bytes.py): the
  all-to-all's (the mean over the processes: each sends back what the router sent it) against the
  formula 4 x layers x tokens x k x hidden x 4 bytes (each token's hidden state
  sent to each of its k experts and back, in forward and in backward; every assignment is sent, also
  to this process itself) plus the expert counts exchanged each forward (layers x E x 8 bytes);
- the median step time (after 2 untimed steps), slowest process; the ratio EP / ZeRO-3 per round.

On CPU with gloo the all-gathers dominate, and EP's smaller gathers are what it saves; the all-to-all is
a GPU-and-NVLink question. The main process prints the tables and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "gpt"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "workers"))
import collective_bytes  # noqa: E402  (bytes counted at the c10d op)
from machine import describe_machine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from unison import Accelerator  # noqa: E402

CONFIG = dict(block_size=64, vocab_size=96, n_layer=4, n_head=4, n_embd=128, n_experts=8, experts_per_token=2)
GLOBAL_BATCH = 16
LAYOUTS = {2: ["zero3", "ep_size=2"], 4: ["zero3", "ep_size=4", "ep_size=2,dp_shard_size=4"]}


def formula(layout: str, world: int) -> dict[str, float]:
    """What each process should store, gather and send for the experts under `layout` on `world`."""
    config = GPTConfig(**CONFIG)
    per_layer = config.n_experts * 2 * 4 * config.n_embd * config.n_embd  # c_fc and c_proj of each expert
    ep = int(layout.split("ep_size=")[1].split(",")[0]) if "ep_size" in layout else 1
    tokens = GLOBAL_BATCH // world * config.block_size
    routed = tokens * config.experts_per_token * config.n_embd * 4  # fp32 hidden states, one way
    all_to_all = config.n_layer * (4 * routed + config.n_experts * 8) if ep > 1 else 0
    return {
        "expert_bytes_stored": config.n_layer * per_layer * 4 / world,
        "expert_bytes_gathered": per_layer * 4 / ep,
        "all_to_all_bytes": all_to_all,
    }


def cross_entropy(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def measure(layout: str, steps: int) -> dict:
    accelerator = Accelerator(cpu=True, parallelism=layout)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]

    def local_bytes(module: torch.nn.Module) -> int:
        tensors = (p.to_local() if hasattr(p, "placements") else p for p in module.parameters(recurse=False))
        return sum(t.numel() * t.element_size() for t in tensors)

    stored = sum(local_bytes(m) for m in experts)
    gathered: list[int] = []
    experts[0].register_forward_pre_hook(lambda module, args: gathered.append(local_bytes(module)))
    rows = GLOBAL_BATCH // accelerator.num_processes
    generator = torch.Generator().manual_seed(accelerator.process_index)
    tokens = torch.randint(0, CONFIG["vocab_size"], (rows, CONFIG["block_size"] + 1), generator=generator)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> None:
        accelerator.forward_backward(model, x, y, cross_entropy)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step()
    with collective_bytes.CollectiveBytes() as counted:
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(statistics.median(times))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    # a process sends back as many rows as the router sent it, which varies with the routing: the mean
    # over the processes is what the formula counts
    all_to_all = torch.tensor(float(counted.sent["all_to_all"]), dtype=torch.float64)
    dist.all_reduce(all_to_all)
    return {
        "expert_bytes_stored": stored,
        "expert_bytes_gathered": gathered[0],
        "all_to_all_bytes": all_to_all.item() / dist.get_world_size(),
        "all_gather_bytes": counted.sent["all_gather"],
        "reduce_scatter_bytes": counted.sent["reduce_scatter"],
        "step_seconds": slowest.item(),
    }


def launch(world: int, layout: str, steps: int, out: Path) -> dict:
    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", str(world), "--cpu", __file__]
    subprocess.run([*command, "--worker", str(out), "--layout", layout, "--steps", str(steps)], check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every layout")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per launch")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "expert_parallel.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = measure(args.layout, args.steps)
        if dist.get_rank() == 0:
            args.worker.write_text(json.dumps(result))
        return
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for world, layouts in LAYOUTS.items():
                for layout in layouts:
                    run = launch(world, layout, args.steps, Path(tmp) / "run.json")
                    runs.setdefault(f"{world} {layout}", []).append(run)
    table = []
    print(
        f"{'N':>2} {'layout':<28}{'stored MiB':>11}{'(formula)':>10}{'gathered MiB':>13}{'(formula)':>10}"
        f"{'all-to-all MiB':>15}{'(formula)':>10}{'gather+scatter MiB':>19}{'step s':>8}{'vs zero3':>9}"
    )
    for key, measured in runs.items():
        world, layout = int(key.split()[0]), key.split()[1]
        expected = formula(layout, world)
        zero3 = runs[f"{world} zero3"]
        ratios = [run["step_seconds"] / base["step_seconds"] for run, base in zip(measured, zero3)]
        first = measured[0]
        row = {
            "processes": world,
            "layout": layout,
            **{k: first[k] for k in first if k != "step_seconds"},
            "formula": expected,
            "step_seconds": [run["step_seconds"] for run in measured],
            "step_ratio_to_zero3": ratios,
        }
        table.append(row)
        mib = 2**20
        print(
            f"{world:>2} {layout:<28}{first['expert_bytes_stored'] / mib:>11.2f}"
            f"{expected['expert_bytes_stored'] / mib:>10.2f}{first['expert_bytes_gathered'] / mib:>13.2f}"
            f"{expected['expert_bytes_gathered'] / mib:>10.2f}{first['all_to_all_bytes'] / mib:>15.2f}"
            f"{expected['all_to_all_bytes'] / mib:>10.2f}"
            f"{(first['all_gather_bytes'] + first['reduce_scatter_bytes']) / mib:>19.2f}"
            f"{statistics.median(row['step_seconds']):>8.3f}{statistics.median(ratios):>9.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"machine": describe_machine(), "model": CONFIG, "global_batch": GLOBAL_BATCH, "rows": table},
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
