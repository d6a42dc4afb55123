"""Device memory on one GPU, on the real allocator: what each memory feature holds and costs.

    python benchmarks/gpu_memory.py activations   # activation checkpointing modes: peak vs estimate-memory
    python benchmarks/gpu_memory.py offload       # ZeRO-3 + CPU offload (pinned) vs the state on the device
    python benchmarks/gpu_memory.py meta          # a model over half the device's memory: meta init, ZeRO-3
    python benchmarks/gpu_memory.py batch         # find_executable_batch_size from a batch that does not fit
    python benchmarks/gpu_memory.py all --smoke   # CPU: tiny configs, checks every part runs

Each part runs in a process of its own (one Accelerator per process, and a peak that no earlier part
left behind) and appends its figures to --out (JSON, one key per part); a table is printed. All on the
GPT example's model (examples/gpt/model.py), bf16 mixed precision, AdamW, clipping at 1.0:

- **activations**: GPT-2 124M, micro-batch --batch x 1,024 tokens, for each mode (none, full,
  selective:2, selective op-level): the peak of torch.cuda.max_memory_allocated over a training step
  (after the first, so Adam's moments exist), above what was allocated before the model was built,
  against the single-device bf16-mixed total that `unison estimate-memory --activation-checkpointing
  MODE` prints for the same shape (target: within 10%), and the median step time relative to none.
- **offload**: GPT-2 124M trained under `parallelism="zero3,offload=true"` (FSDP2's CPUOffloadPolicy,
  pinned host memory; on one process a one-rank group) against the same model with its state on the
  device: median step time and peak device memory of each.
- **meta**: a GPT whose fp32 parameters take --meta-share of the device's memory, built inside
  `unison.init_empty_weights()` (no memory) and prepared under zero3,offload=true: the seconds prepare()
  takes, the device's peak while it runs and during one forward pass, the process's peak resident
  memory, and a forward pass's loss as a check that real weights came out.
- **batch**: `find_executable_batch_size` from --start-batch sequences of 1,024 tokens on GPT-2 124M:
  the real CUDA out-of-memory errors it caught, the batch size it settled on, and whether the memory of
  the failed attempts was released (allocated bytes after vs before).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "gpt"))
sys.path.insert(0, str(HERE))
from machine import describe_machine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

PARTS = ("activations", "offload", "meta", "batch")
MODES = ("none", "full", "selective:2", "selective:op")
GIB = 2**30


def gpt2_small(smoke: bool, seq: int = 1024) -> GPTConfig:
    if smoke:
        return GPTConfig(block_size=64, vocab_size=96, n_layer=2, n_head=2, n_embd=32)
    return GPTConfig(block_size=seq, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak() -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def batch_of(config: GPTConfig, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, config.vocab_size, (batch, config.block_size + 1), generator=torch.Generator().manual_seed(seed)
    ).to(device())
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_step(accelerator, model, optimizer, inputs, targets) -> float:
    _, loss = model(inputs, targets)  # the model's own loss, as the GPT example trains
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def timed(function) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


# -- the parts: each returns its figures and prints its lines ------------------------------------------
def activations(args: argparse.Namespace) -> dict:
    from unison import Accelerator
    from unison.planning import memory, memory_table

    config = gpt2_small(args.smoke)
    inputs, targets = batch_of(config, args.batch)
    runs = {}
    for mode in MODES:
        before = allocated()
        torch.manual_seed(0)
        model = GPT(config)
        shape = memory.inspect_model(model)
        estimate = memory_table.estimate(
            shape, 1, args.batch, config.block_size, activation_checkpointing=None if mode == "none" else mode
        )
        row = next(r for r in estimate.rows if r.precision == "bf16-mixed" and r.strategy == "single")
        accelerator = Accelerator(
            mixed_precision="bf16", activation_checkpointing=None if mode == "none" else mode
        )
        model = accelerator.prepare(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.cuda.is_available())
        optimizer = accelerator.prepare(optimizer)
        train_step(accelerator, model, optimizer, inputs, targets)  # Adam's moments exist from here on
        reset_peak()
        train_step(accelerator, model, optimizer, inputs, targets)
        measured = peak() - before
        runs[mode] = {
            "model": model,
            "optimizer": optimizer,
            "accelerator": accelerator,
            "peak_bytes": measured,
            "estimated_bytes": row.total,
            "estimated_activation_bytes": row.activations,
        }
    for run in runs.values():  # warm-up done above; now interleaved rounds, every mode alive
        run["seconds"] = []
    for _ in range(args.rounds):
        for run in runs.values():
            run["seconds"].append(
                timed(lambda r=run: train_step(r["accelerator"], r["model"], r["optimizer"], inputs, targets))
            )
    none = statistics.median(runs["none"]["seconds"])
    rows = []
    print(f"activation checkpointing, GPT-2 124M, bf16, micro-batch {args.batch} x {config.block_size}")
    print(f"{'mode':>14}{'peak GiB':>10}{'est. GiB':>10}{'meas/est':>10}{'step ms':>10}{'time/none':>10}")
    for mode, run in runs.items():
        step = statistics.median(run["seconds"])
        ratio = run["peak_bytes"] / run["estimated_bytes"] if run["estimated_bytes"] else float("nan")
        rows.append(
            {
                "mode": mode,
                "peak_bytes": run["peak_bytes"],
                "estimated_bytes": run["estimated_bytes"],
                "estimated_activation_bytes": run["estimated_activation_bytes"],
                "measured_over_estimate": ratio,
                "step_s_median": step,
                "time_over_none": step / none,
            }
        )
        print(
            f"{mode:>14}{run['peak_bytes'] / GIB:10.2f}{run['estimated_bytes'] / GIB:10.2f}{ratio:10.3f}"
            f"{step * 1e3:10.1f}{step / none:10.3f}"
        )
    return {"batch": args.batch, "seq_len": config.block_size, "rows": rows}


def offload(args: argparse.Namespace) -> dict:
    """One layout per process: this runs itself once per layout and puts the two together."""
    results = {}
    for layout in ("on the device", "zero3,offload=true"):
        out = subprocess.run(
            [sys.executable, __file__, "offload-one", "--layout", layout, "--rounds", str(args.rounds)]
            + ["--batch", str(args.batch)]
            + (["--smoke"] if args.smoke else []),
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            sys.stderr.write(out.stdout + out.stderr)
            raise SystemExit(f"offload under {layout!r} failed (exit {out.returncode})")
        results[layout] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["on the device"]
    print(f"ZeRO-3 + CPU offload on one device, GPT-2 124M, bf16, micro-batch {args.batch}")
    print(f"{'layout':>22}{'step ms':>10}{'peak GiB':>10}{'time/dev':>10}{'peak/dev':>10}")
    for layout, r in results.items():
        print(
            f"{layout:>22}{r['step_s_median'] * 1e3:10.1f}{r['peak_bytes'] / GIB:10.2f}"
            f"{r['step_s_median'] / base['step_s_median']:10.2f}"
            f"{r['peak_bytes'] / max(base['peak_bytes'], 1):10.3f}"
        )
    return {"batch": args.batch, "layouts": results}


def offload_one(args: argparse.Namespace) -> None:
    from unison import Accelerator

    config = gpt2_small(args.smoke)
    inputs, targets = batch_of(config, args.batch)
    before = allocated()
    reset_peak()
    parallelism = None if args.layout == "on the device" else args.layout
    accelerator = Accelerator(mixed_precision="bf16", parallelism=parallelism)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    losses = [train_step(accelerator, model, optimizer, inputs, targets)]
    seconds = []
    for _ in range(args.rounds):
        seconds.append(
            timed(lambda: losses.append(train_step(accelerator, model, optimizer, inputs, targets)))
        )
    figures = {
        "step_s_median": statistics.median(seconds),
        "peak_bytes": peak() - before,
        "parameters_are_dtensors": sharded,
        "losses": losses,
    }
    print(json.dumps(figures))


def meta(args: argparse.Namespace) -> dict:
    import unison
    from unison import Accelerator

    total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 64 * 2**20
    width = 4096 if torch.cuda.is_available() else 64
    per_layer = 12 * width * width * 4  # fp32 bytes of one block's weights (biases aside)
    layers = max(1, round(args.meta_share * total / per_layer))
    config = GPTConfig(
        block_size=256, vocab_size=50304, n_layer=layers, n_head=32 if width == 4096 else 4, n_embd=width
    )
    import logging

    began = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")

    def phase(what: str) -> None:  # where the time goes, printed as it happens (a killed run still tells)
        print(f"  [{time.perf_counter() - began:7.1f} s] {what}", flush=True)

    accelerator = Accelerator(mixed_precision="bf16", parallelism="zero3,offload=true")
    phase(f"building {layers} blocks x {width} on meta")
    with unison.init_empty_weights():
        torch.manual_seed(0)
        model = GPT(config)
    parameter_bytes = sum(p.numel() * 4 for p in model.parameters())
    reset_peak()
    phase(f"built ({parameter_bytes / GIB:.1f} GiB of fp32 parameters); prepare()")
    start = time.perf_counter()
    model = accelerator.prepare(model)
    prepare_s = time.perf_counter() - start
    prepare_peak = peak()
    phase("prepared; one forward")
    inputs, targets = batch_of(config, 1)
    reset_peak()
    with torch.no_grad():
        loss = model(inputs, targets)[1].item()
    forward_peak = peak()
    phase("forward done")
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    figures = {
        "layers": layers,
        "width": width,
        "parameter_bytes": parameter_bytes,
        "device_bytes": total,
        "model_over_device": parameter_bytes / total,
        "prepare_s": prepare_s,
        "prepare_peak_device_bytes": prepare_peak,
        "forward_peak_device_bytes": forward_peak,
        "host_peak_rss_bytes": host_peak,
        "forward_loss": loss,
    }
    print(
        f"meta init + zero3,offload=true: {layers} blocks x {width}, {parameter_bytes / GIB:.1f} GiB of fp32 "
        f"parameters = {parameter_bytes / total:.2f} x the device's {total / GIB:.1f} GiB\n"
        f"  prepare() {prepare_s:.1f} s, device peak {prepare_peak / GIB:.2f} GiB; "
        f"one forward (1 x 256 tokens): "
        f"device peak {forward_peak / GIB:.2f} GiB, loss {loss:.4f} (ln vocab = 10.83); host peak RSS "
        f"{host_peak / GIB:.1f} GiB"
    )
    return figures


def batch(args: argparse.Namespace) -> dict:
    from unison import Accelerator, find_executable_batch_size

    config = gpt2_small(args.smoke)
    accelerator = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    tried: list[tuple[int, str]] = []
    before = allocated()

    @find_executable_batch_size(starting_batch_size=args.start_batch)
    def fit(batch_size: int) -> int:
        tried.append((batch_size, "started"))
        inputs, targets = batch_of(config, batch_size)
        train_step(accelerator, model, optimizer, inputs, targets)
        tried[-1] = (batch_size, "ran")
        return batch_size

    start = time.perf_counter()
    found = fit()
    seconds = time.perf_counter() - start
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    after = allocated()
    failed = [size for size, outcome in tried if outcome == "started"]
    print(
        f"find_executable_batch_size from {args.start_batch} x {config.block_size} tokens: {len(failed)} "
        f"out-of-memory attempts ({', '.join(map(str, failed[:3]))}{', ...' if len(failed) > 3 else ''}), "
        f"settled on {found} in {seconds:.1f} s; allocated {before / GIB:.2f} GiB before, "
        f"{after / GIB:.2f} GiB after (Adam's moments appear with the first step that ran)"
    )
    return {
        "start_batch": args.start_batch,
        "out_of_memory_attempts": failed,
        "found": found,
        "seconds": seconds,
        "allocated_before_bytes": before,
        "allocated_after_bytes": after,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=(*PARTS, "all", "offload-one"))
    parser.add_argument("--smoke", action="store_true", help="tiny configs on the CPU: check the script runs")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch (sequences of 1,024 tokens)")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps (interleaved where it can)")
    parser.add_argument(
        "--meta-share", type=float, default=0.52, help="meta part: model size / device memory"
    )
    parser.add_argument("--start-batch", type=int, default=512, help="batch part: the size tried first")
    parser.add_argument("--layout", help=argparse.SUPPRESS)  # offload-one: the layout this process runs
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu_memory.json")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.rounds, args.start_batch = 2, 2, 4
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("no CUDA device: this benchmark measures a GPU; run with --smoke to check it on CPU")
    if args.part == "offload-one":
        offload_one(args)
        return
    if args.part == "all":
        for part in PARTS:
            command = [sys.executable, __file__, part, *sys.argv[2:]]
            if subprocess.run(command).returncode != 0:
                raise SystemExit(f"part {part!r} failed")
        return
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
    figures = {"activations": activations, "offload": offload, "meta": meta, "batch": batch}[args.part](args)
    if args.smoke:
        return  # a check that the script runs, no figure
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.part] = {
        "machine": {**describe_machine(), "device": torch.cuda.get_device_name(0)},
        **figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out} [{args.part}]")


if __name__ == "__main__":
    main()
