"""How long does save_state block training, synchronous against asynchronous, and what does the write cost?

    python benchmarks/checkpoint_async.py [--nproc 1 2] [--rounds 3] [--steps 3] [--dir FOLDER]

The script launches itself under `unison launch --cpu` with each number of processes. Each run trains
the GPT of examples/gpt/model.py sized to about 100M fp32 parameters (14 layers x 768) with AdamW, under
DDP (process 0 writes the model and the optimizer, as with any replicated layout), so a checkpoint holds
about 1.2 GB. After an untimed warm-up (one step, one save of each kind: the staging buffers are
allocated by the first asynchronous save and reused after), each round measures, in alternating order:

- **sync**: `save_state(dir)`: the seconds the call blocks, which is the whole save (files, fsyncs,
  checksums, manifest, rename);
- **async**: `save_state(dir, async_save=True)`: the seconds the call blocks (the copy into host memory),
  then --steps training steps while the write runs in the background (how many of them overlapped it is
  recorded), then the rest of the write (`wait_for_checkpoint()`);
- **steps alone**: --steps training steps with nothing in flight.

Reported, medians over the rounds (each process's figure is the slowest process's): the blocked time of
each kind and async / sync (target <= 0.10); the step time while a write runs against alone, as
throughput alone / during (target >= 0.90 on these 2 cores); the host memory the staging buffers hold
(bytes of the staged state on process 0, and process 0's RSS growth over the first asynchronous save).
A table is printed and everything is written as JSON to --out (default results/checkpoint_async.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from machine import describe_machine  # noqa: E402  (benchmarks/, the script's own folder)
from model import GPT, GPTConfig  # noqa: E402

from unison import Accelerator  # noqa: E402
from unison.ops import gather_object  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, BLOCK, VOCAB = 2, 64, 96


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="process counts to run")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per process count")
    parser.add_argument("--steps", type=int, default=3, help="training steps timed per measurement")
    parser.add_argument("--layers", type=int, default=14, help="GPT layers (768 wide; 14: ~100M params)")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS / "checkpoint_async.json")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # the launched part
    return parser.parse_args()


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def staged_bytes(accelerator: Accelerator) -> int:
    """Bytes of the host buffers the asynchronous writer keeps between saves (torch's stager cache)."""
    stager = accelerator._checkpoint_writer()._stager  # the benchmark's look inside: no public count
    storages = {id(s): s for s in stager._cached_storage_mapping.values()}
    return sum(s.nbytes() for s in storages.values())


def worker(args: argparse.Namespace) -> None:
    """One launched run: the measurements of this process, gathered to process 0 and written there."""
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    config = GPTConfig(block_size=BLOCK, vocab_size=VOCAB, n_layer=args.layers, n_head=12, n_embd=768)
    model = GPT(config)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    folder = args.dir
    tokens = torch.randint(0, VOCAB, (BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> None:
        _, loss = model(inputs, targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def steps_timed() -> tuple[float, int]:
        """Seconds per step over --steps steps, and how many began with a write in flight."""
        overlapped, started = 0, time.perf_counter()
        for _ in range(args.steps):
            overlapped += accelerator.checkpoint_in_flight is not None
            step()
        return (time.perf_counter() - started) / args.steps, overlapped

    def blocked(name: str, async_save: bool) -> float:
        target = folder / name
        accelerator.wait_for_everyone()
        started = time.perf_counter()
        accelerator.save_state(target, async_save=async_save)
        return time.perf_counter() - started

    step()
    blocked("warmup_sync", False)
    rss_before = rss_bytes()
    blocked("warmup_async", True)
    accelerator.wait_for_checkpoint()
    rss_growth = rss_bytes() - rss_before
    rounds = []
    for index in range(args.rounds):
        record: dict = {}
        for kind in ("sync", "async") if index % 2 == 0 else ("async", "sync"):
            record[f"blocked_{kind}"] = blocked(f"round{index}_{kind}", kind == "async")
            if kind == "async":
                record["step_during_write"], record["steps_overlapping"] = steps_timed()
                started = time.perf_counter()
                accelerator.wait_for_checkpoint()
                record["rest_of_write"] = time.perf_counter() - started
        accelerator.wait_for_everyone()
        record["step_alone"], _ = steps_timed()
        rounds.append(record)
        for kind in ("sync", "async"):  # keep the disk from filling: each round's checkpoints go
            if accelerator.is_main_process:
                shutil.rmtree(folder / f"round{index}_{kind}", ignore_errors=True)
    mine = {"rounds": rounds, "rss_growth": rss_growth}
    if accelerator.is_main_process:
        mine["staged_bytes"] = staged_bytes(accelerator)
        mine["parameters"] = parameters
        mine["checkpoint_bytes"] = sum(
            f.stat().st_size for f in (folder / "warmup_sync").rglob("*") if f.is_file()
        )
    everyone = gather_object([mine])
    accelerator.end_training()
    if accelerator.is_main_process:
        args.worker.write_text(json.dumps({"processes": everyone}))


def summary(nproc: int, run: dict) -> dict:
    """Medians over the rounds of the slowest process's figures."""
    processes = run["processes"]

    def slowest(key: str) -> list[float]:
        return [max(p["rounds"][i][key] for p in processes) for i in range(len(processes[0]["rounds"]))]

    medians = {key: statistics.median(slowest(key)) for key in processes[0]["rounds"][0]}
    main = processes[0]
    return {
        "processes": nproc,
        "parameters": main["parameters"],
        "checkpoint_mb": main["checkpoint_bytes"] / 1e6,
        "staged_mb": main["staged_bytes"] / 1e6,
        "rss_growth_mb": main["rss_growth"] / 1e6,
        **medians,
        "blocked_ratio": medians["blocked_async"] / medians["blocked_sync"],
        "throughput_during_write": medians["step_alone"] / medians["step_during_write"],
    }


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    load_start = os.getloadavg()
    rows, raw = [], {}
    for nproc in args.nproc:
        folder = Path(tempfile.mkdtemp(prefix="unison-async-ckpt-", dir=args.dir))
        out = folder / "report.json"
        try:
            command = [
                sys.executable,
                "-m",
                "unison",
                "launch",
                "--nproc-per-node",
                str(nproc),
                "--cpu",
                __file__,
            ]
            command += ["--worker", str(out), "--dir", str(folder), "--rounds", str(args.rounds)]
            command += ["--steps", str(args.steps), "--layers", str(args.layers)]
            subprocess.run(command, check=True)
            raw[nproc] = json.loads(out.read_text())
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        rows.append(summary(nproc, raw[nproc]))
    info = describe_machine()
    lines = [
        f"save_state blocking, sync vs async, GPT {rows[0]['parameters'] / 1e6:.0f}M + AdamW under DDP on "
        f"{info['cores']} cores ({info['cpu']}), torch {info['torch']}, {info['date']}, load average "
        f"{load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}",
        "| processes | checkpoint MB | blocked sync s | blocked async s | **async / sync** | step alone s "
        "| step during write s | **throughput during / alone** | steps overlapping | staged MB "
        "| RSS growth MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['processes']} | {row['checkpoint_mb']:.0f} | {row['blocked_sync']:.3f} | "
            f"{row['blocked_async']:.3f} | **{row['blocked_ratio']:.3f}** | {row['step_alone']:.3f} | "
            f"{row['step_during_write']:.3f} | **{row['throughput_during_write']:.2f}** | "
            f"{row['steps_overlapping']:.0f} of {args.steps} | {row['staged_mb']:.0f} | "
            f"{row['rss_growth_mb']:.0f} |"
        )
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": info,
                "settings": vars(args) | {"out": str(args.out), "dir": str(args.dir)},
                "summary": rows,
                "raw": raw,
            },
            indent=1,
            default=str,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
