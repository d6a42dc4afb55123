"""Step time and per-rank memory of every parallel layout on the GPT example, the pipeline bubble, and
what unison's wrapping costs against the same step written with raw torch.

    python benchmarks/strategies.py --parts layouts bubble   # 2 and 4 processes, a few minutes on 2 cores
    python benchmarks/strategies.py --nproc 2 --steps 6 --parts layouts
    python benchmarks/strategies.py --parts raw --ops        # unison vs raw torch, about 10 minutes

For each process count the script launches itself under `unison launch --cpu` and trains the GPT
example's model (4 layers x 128, 64-character context, AdamW) through `Accelerator(parallelism=...)`
and `forward_backward` under each layout, with the same global batch per optimizer step everywhere:

1. Layouts: median step time over --steps steps (after 2 untimed ones), and the bytes per rank of
   parameters + gradients + optimizer state (largest rank), next to design.md §3's formula for it.
   The ratio that matters is memory: what each layout saves per rank. On CPU/gloo the communication
   of the sharded layouts dominates step time; their speed is a GPU question (see docs/).
2. Pipeline bubble (pp=2, 1F1B, the same micro-batch of --bubble-micro-batch sequences): the time
   T(m) of the schedule (forward_backward, without the optimizer step; median of 20 steps) for
   m = 1, 2, 4, 8 micro-batches. m = 1 is naive model parallelism, where the stages run one after
   the other, so one stage's work is t = T(1) / p; the measured bubble is 1 - m t / T(m), the
   share of the step a rank waits, against the schedule's (p - 1) / (m + p - 1).
3. Unison vs raw torch (ddp, zero2, zero3, tp, pp): the same step through unison and through the raw
   torch twin of raw_layouts.py, from the same weights on the same batch, in interleaved rounds of
   --steps-per-round steps; unison/raw of the median step time (slowest rank), of each round, and of
   the CPU seconds of all ranks (the work, blind to waiting for a busy core). The losses of every step
   must agree within RAW_LOSS_TOLERANCE, or the script fails: both sides do the same arithmetic.
   --ops also counts each step's operators with torch.profiler (unison minus raw).

The main process prints the tables and writes everything as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "gpt"))
sys.path.insert(0, str(HERE))
import raw_layouts  # noqa: E402
from machine import describe_machine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from unison import Accelerator, PartialState  # noqa: E402
from unison.parallel.pipeline import PipelineModel, pipeline_bubble_fraction  # noqa: E402
from unison.planning.memory import PRECISIONS, model_state_bytes  # noqa: E402

GLOBAL_BATCH = 16  # sequences per optimizer step, every layout
BLOCK = 64
VOCAB = 96
# layout -> (memory formula, devices it divides by, model split by TP x PP)
LAYOUTS = {
    2: {
        "ddp": ("ddp", 2, 1),
        "zero1": ("zero1", 2, 1),
        "zero2": ("zero2", 2, 1),
        "zero3": ("zero3", 2, 1),
        "tp_size=2": ("single", 1, 2),
        "pp_size=2,pp_microbatches=4": ("single", 1, 2),
    },
    4: {
        "ddp": ("ddp", 4, 1),
        "zero1": ("zero1", 4, 1),
        "zero2": ("zero2", 4, 1),
        "zero3": ("zero3", 4, 1),
        "dp_replicate_size=2,dp_shard_size=2": ("zero3", 2, 1),
        "tp_size=4": ("single", 1, 4),
        "dp_shard_size=2,tp_size=2": ("zero3", 2, 2),
        "pp_size=2,dp_shard_size=2,pp_microbatches=4": ("zero3", 2, 2),
        "pp_size=2,tp_size=2,pp_microbatches=4": ("single", 1, 4),
        "pp_size=4,pp_microbatches=4": ("single", 1, 4),
    },
}
MICROBATCHES = (1, 2, 4, 8)
PP_MICROBATCHES = 4
# unison layout -> its raw torch twin (raw_layouts.py), given a fresh model with the same weights
RAW = {
    2: {
        "ddp": raw_layouts.ddp,
        "zero2": lambda model: raw_layouts.zero(model, 2),
        "zero3": lambda model: raw_layouts.zero(model, 3),
        "tp_size=2": lambda model: raw_layouts.tensor_parallel(model, 2),
        f"pp_size=2,pp_microbatches={PP_MICROBATCHES}": lambda model: raw_layouts.pipeline(
            model, [0, 2], PP_MICROBATCHES
        ),
    },
    4: {
        "ddp": raw_layouts.ddp,
        "zero2": lambda model: raw_layouts.zero(model, 2),
        "zero3": lambda model: raw_layouts.zero(model, 3),
        "tp_size=4": lambda model: raw_layouts.tensor_parallel(model, 4),
        f"pp_size=4,pp_microbatches={PP_MICROBATCHES}": lambda model: raw_layouts.pipeline(
            model, [0, 1, 2, 3], PP_MICROBATCHES
        ),
    },
}
RAW_TARGET = 1.02  # unison step time / raw torch step time, at most
RAW_LOSS_TOLERANCE = 1e-4  # |unison loss - raw loss| at every step: both sides do the same arithmetic
PARTS = ("layouts", "bubble", "raw")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arg = parser.add_argument
    arg("--nproc", type=int, nargs="+", default=[2, 4], choices=sorted(LAYOUTS), help="process counts")
    arg("--steps", type=int, default=8, help="timed optimizer steps per layout")
    arg("--bubble-micro-batch", type=int, default=4, help="sequences per pipeline micro-batch")
    arg("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="which comparisons to run")
    arg("--rounds", type=int, default=40, help="interleaved rounds of the unison vs raw torch comparison")
    arg("--steps-per-round", type=int, default=3, help="steps of each side per round")
    arg("--layout", nargs="+", help="unison vs raw torch: only these layouts (default: all of --nproc)")
    arg("--ops", action="store_true", help="unison vs raw torch: also count the operators of each step")
    arg("--out", type=Path, default=HERE / "results" / "strategies.json")
    arg("--worker", type=Path, help=argparse.SUPPRESS)  # internal: run the layouts, write JSON here
    return parser.parse_args()


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=BLOCK, vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=128))


def next_token_loss(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def held_bytes(model: torch.nn.Module, optimizer) -> int:
    """Parameters + gradients + optimizer state this rank holds (local shards), after a step."""
    params = {id(p): p for p in model.parameters()}.values()
    inner = getattr(optimizer.optimizer, "optim", optimizer.optimizer)  # ZeroRedundancyOptimizer's share
    state = sum(
        local_bytes(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )
    return sum(local_bytes(p) + local_bytes(p.grad) for p in params) + state


def run_layout(layout: str, steps: int, batch_per_rank: int | None = None) -> dict:
    """Train `steps` + 2 steps under `layout`; median step seconds and this rank's bytes."""
    accelerator = Accelerator(cpu=True, parallelism=layout)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    per_rank = batch_per_rank or GLOBAL_BATCH // accelerator.parallelism.dp_size
    tokens = torch.randint(0, VOCAB, (per_rank, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    times, schedule_times = [], []
    for step in range(steps + 2):
        start = time.perf_counter()
        accelerator.forward_backward(model, x, y, next_token_loss)
        accelerator.wait_for_everyone()
        schedule_end = time.perf_counter()
        optimizer.step()
        if step == 0:
            memory = held_bytes(model, optimizer)  # gradients are still there (zero_grad sets None)
        optimizer.zero_grad()
        accelerator.wait_for_everyone()
        if step >= 2:
            times.append(time.perf_counter() - start)
            schedule_times.append(schedule_end - start)
    return {"step_s": statistics.median(times), "fb_s": statistics.median(schedule_times), "bytes": memory}


def compare_with_raw(layout: str, build_raw, args: argparse.Namespace) -> dict:
    """The same training step through unison and through raw torch, in interleaved rounds.

    Both sides start from the same weights and train on the same batch; each round runs
    --steps-per-round steps of one side, then of the other (which side goes first alternates), after
    two untimed steps of each. Per step: seconds on this rank, and the loss (NaN on pipeline ranks
    without the last stage in the raw loop, which gets the loss there only).
    """
    accelerator = Accelerator(cpu=True, parallelism=layout)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    raw_step = build_raw(make_model())
    if isinstance(model, PipelineModel):  # the same split on both sides: this rank's blocks
        held = [path for stage in model.stage_modules for path in stage.pieces if ".h." in path]
        if held != raw_step.blocks:
            raise RuntimeError(f"{layout}: unison's stage holds {held}, the raw one {raw_step.blocks}")
    per_rank = GLOBAL_BATCH // accelerator.parallelism.dp_size
    tokens = torch.randint(0, VOCAB, (per_rank, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def unison_step() -> torch.Tensor:
        with accelerator.accumulate(model):
            loss = accelerator.forward_backward(model, x, y, next_token_loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    sides = {"raw": lambda: raw_step(x, y), "unison": unison_step}
    times: dict[str, list[float]] = {"raw": [], "unison": []}
    cpu: dict[str, list[float]] = {"raw": [], "unison": []}
    losses: dict[str, list[float]] = {"raw": [], "unison": []}
    for name, step in sides.items():
        for _ in range(2):
            losses[name].append(step().item())
    for index in range(args.rounds):
        for name in ("raw", "unison") if index % 2 == 0 else ("unison", "raw"):
            torch.distributed.barrier()
            for _ in range(args.steps_per_round):
                start, start_cpu = time.perf_counter(), time.process_time()
                loss = sides[name]()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)  # all this process's threads
                losses[name].append(loss.item())
    return {"times": times, "cpu": cpu, "losses": losses, "extra_ops": extra_ops(sides) if args.ops else {}}


def extra_ops(sides: dict) -> dict[str, float]:
    """Operators (torch.profiler's names: aten ops, collectives) whose count per step differs between the
    two sides, unison's count minus raw's: a noise-free view of what the wrapping adds (or saves)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    steps, counts = 4, {}
    for name, step in sides.items():
        torch.distributed.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        counts[name] = Counter({event.key: event.count for event in prof.key_averages()})
    raw, unison = counts["raw"], counts["unison"]
    return {op: (unison[op] - raw[op]) / steps for op in sorted(raw | unison) if unison[op] != raw[op]}


def raw_layouts_for(nproc: int, only: list[str] | None) -> dict:
    return {k: v for k, v in RAW[nproc].items() if only is None or k in only}


def worker(out: Path, args: argparse.Namespace) -> None:
    state = PartialState(cpu=True)
    torch.set_num_threads(1)
    results: dict = {"layouts": {}, "bubble": [], "raw": {}}
    if "layouts" in args.parts:
        for layout in LAYOUTS[state.num_processes]:
            result = run_layout(layout, args.steps)
            gathered = [None] * state.num_processes
            torch.distributed.all_gather_object(gathered, result["bytes"])
            results["layouts"][layout] = {"step_s": result["step_s"], "bytes_per_rank": gathered}
    if state.num_processes == 2 and "bubble" in args.parts:
        for m in MICROBATCHES:
            layout = f"pp_size=2,pp_microbatches={m},pp_schedule=1f1b"
            timing = run_layout(layout, max(args.steps, 20), batch_per_rank=m * args.bubble_micro_batch)
            results["bubble"].append({"p": 2, "m": m, "step_s": timing["fb_s"]})
    if "raw" in args.parts:
        for name, build_raw in raw_layouts_for(state.num_processes, args.layout).items():
            gathered = [None] * state.num_processes
            torch.distributed.all_gather_object(gathered, compare_with_raw(name, build_raw, args))
            results["raw"][name] = gathered
    if state.is_main_process:
        out.write_text(json.dumps(results))


def launch(nproc: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", str(nproc), "--cpu"]
        command += [__file__]
        command += ["--worker", str(out), "--steps", str(args.steps), "--parts", *args.parts]
        command += ["--bubble-micro-batch", str(args.bubble_micro_batch), "--rounds", str(args.rounds)]
        command += ["--steps-per-round", str(args.steps_per_round)] + (["--ops"] if args.ops else [])
        if args.layout:
            command += ["--layout", *args.layout]
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def summarise_raw(nproc: int, name: str, ranks: list[dict], steps_per_round: int) -> dict:
    """unison/raw of one layout: the step time is the slowest rank's, step by step."""
    times = {
        side: [max(r["times"][side][i] for r in ranks) for i in range(len(ranks[0]["times"][side]))]
        for side in ("raw", "unison")
    }
    n = steps_per_round
    round_ratios = [
        statistics.median(times["unison"][i : i + n]) / statistics.median(times["raw"][i : i + n])
        for i in range(0, len(times["raw"]), n)
    ]
    # the loss where both sides have it (a raw pipeline has it on its last stage only)
    differences = [
        abs(u - r)
        for rank in ranks
        for u, r in zip(rank["losses"]["unison"], rank["losses"]["raw"], strict=True)
        if not math.isnan(r)
    ]
    raw_s, unison_s = statistics.median(times["raw"]), statistics.median(times["unison"])
    # the work: CPU seconds of all ranks together per step (waiting for a peer or for a core costs none)
    cpu = {side: [sum(r["cpu"][side][i] for r in ranks) for i in range(len(times[side]))] for side in times}
    raw_cpu, unison_cpu = statistics.median(cpu["raw"]), statistics.median(cpu["unison"])
    return {
        "processes": nproc,
        "layout": name,
        "raw_ms": 1000 * raw_s,
        "unison_ms": 1000 * unison_s,
        "ratio": unison_s / raw_s,
        "median_round_ratio": statistics.median(round_ratios),
        "round_ratio_quartiles": statistics.quantiles(round_ratios, n=4) if len(round_ratios) > 1 else None,
        "round_ratios": round_ratios,
        "raw_cpu_ms": 1000 * raw_cpu,
        "unison_cpu_ms": 1000 * unison_cpu,
        "cpu_ratio": unison_cpu / raw_cpu,
        "max_loss_difference": max(differences),
        "first_loss": ranks[-1]["losses"]["unison"][0],
        "last_loss": ranks[-1]["losses"]["unison"][-1],
        "raw_s": times["raw"],
        "unison_s": times["unison"],
        "extra_ops_per_step": [rank["extra_ops"] for rank in ranks],
        "raw_cpu_s": cpu["raw"],
        "unison_cpu_s": cpu["unison"],
    }


def describe_ops(difference: dict[str, float]) -> str:
    """'gloo:all_gather +16, ...; other ops +1,200 -4' from an operator -> count difference."""
    collective = {op: n for op, n in difference.items() if op.startswith(("gloo:", "c10d::"))}
    others = [n for op, n in difference.items() if op not in collective]
    said = ", ".join(f"{op} {n:+g}" for op, n in collective.items())
    more, fewer = sum(n for n in others if n > 0), sum(n for n in others if n < 0)
    return f"{said or 'same collectives'}; other ops {more:+g} {fewer:+g}"


def report(args: argparse.Namespace) -> None:
    fp32 = next(p for p in PRECISIONS if p.name == "fp32")
    psi = make_model().num_parameters()
    rows, bubble, raw = [], [], []
    for nproc in args.nproc:
        measured = launch(nproc, args)
        for name, ranks in measured["raw"].items():
            raw.append(summarise_raw(nproc, name, ranks, args.steps_per_round))
        if "layouts" not in args.parts:
            measured["layouts"] = {}
        ddp_time = measured["layouts"].get("ddp", {}).get("step_s")
        for layout, (strategy, devices, split) in LAYOUTS[nproc].items():
            if layout not in measured["layouts"]:
                continue
            entry = measured["layouts"][layout]
            part = math.ceil(psi / split)
            formula = sum(model_state_bytes(strategy, fp32, part, part, devices))
            most = max(entry["bytes_per_rank"])
            rows.append(
                {
                    "processes": nproc,
                    "layout": layout,
                    "step_ms": 1000 * entry["step_s"],
                    "step_vs_ddp": entry["step_s"] / ddp_time,
                    "bytes_per_rank_max": most,
                    "formula_bytes": formula,
                    "measured_vs_formula": most / formula,
                    "bytes_vs_ddp": most / (16 * psi),
                }
            )
        for point in measured["bubble"]:
            bubble.append(point)
    if bubble:
        stage_time = bubble[0]["step_s"] / bubble[0]["p"]  # m = 1: the stages run one after the other
        for point in bubble:
            point["measured_bubble"] = 1 - point["m"] * stage_time / point["step_s"]
            point["formula_bubble"] = pipeline_bubble_fraction(point["p"], point["m"])
    print(f"GPT example, {psi:,} parameters, fp32 AdamW, {GLOBAL_BATCH} x {BLOCK} tokens per step")
    if raw:
        print(
            f"\nunison vs raw torch, {args.rounds} interleaved rounds x {args.steps_per_round} steps "
            f"(target unison/raw <= {RAW_TARGET})"
        )
        header = ("procs", "layout", "raw ms", "unison ms", "ratio", "rounds", "IQR", "cpu", "loss diff")
        print("{:>5} {:<40} {:>8} {:>9} {:>6} {:>6} {:>11} {:>6} {:>9}".format(*header))
        for r in raw:
            low, _, high = r["round_ratio_quartiles"] or (math.nan,) * 3
            print(
                f"{r['processes']:>5} {r['layout']:<40} {r['raw_ms']:8.1f} {r['unison_ms']:9.1f} "
                f"{r['ratio']:6.3f} {r['median_round_ratio']:6.3f} {low:5.3f}-{high:5.3f} "
                f"{r['cpu_ratio']:6.3f} {r['max_loss_difference']:9.1e}"
            )
    if args.ops and raw:
        print("\noperators per step, unison minus raw torch (first rank | last rank)")
        for r in raw:
            ends = (r["extra_ops_per_step"][0], r["extra_ops_per_step"][-1])
            print(f"{r['processes']:>5} {r['layout']:<40} {' | '.join(describe_ops(d) for d in ends)}")
    header = ("procs", "layout", "step ms", "/ddp", "bytes/rank", "formula", "/16Psi")
    if rows:
        print("\n{:>5} {:<46} {:>8} {:>6} {:>11} {:>9} {:>7}".format(*header))
    for r in rows:
        print(
            f"{r['processes']:>5} {r['layout']:<46} {r['step_ms']:8.1f} {r['step_vs_ddp']:6.2f} "
            f"{r['bytes_per_rank_max']:11,} {r['measured_vs_formula']:9.3f} {r['bytes_vs_ddp']:7.3f}"
        )
    if bubble:
        print(f"\npipeline bubble, p=2, 1F1B, {args.bubble_micro_batch} sequences per micro-batch")
        print(f"{'m':>3} {'step ms':>8} {'measured':>9} {'(p-1)/(m+p-1)':>14}")
        for point in bubble:
            print(
                f"{point['m']:>3} {1000 * point['step_s']:8.1f} {point['measured_bubble']:9.3f} "
                f"{point['formula_bubble']:14.3f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "steps": args.steps,
        "global_batch": GLOBAL_BATCH,
        "block": BLOCK,
        "parameters": psi,
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "pp_microbatches": PP_MICROBATCHES,
    }
    result = {"machine": describe_machine(), "settings": settings, "layouts": rows, "bubble": bubble}
    args.out.write_text(json.dumps({**result, "versus_raw": raw}, indent=1))
    print(f"\nwritten to {args.out}")
    unfair = [r["layout"] for r in raw if not r["max_loss_difference"] <= RAW_LOSS_TOLERANCE]
    if unfair:
        raise SystemExit(f"unison and raw torch computed different losses in {unfair}: not the same step")


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args.worker, args)
    else:
        report(args)


if __name__ == "__main__":
    main()
