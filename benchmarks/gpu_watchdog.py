"""Does unison's hang watchdog cost a GPU step anything? One rank, NCCL, the watchdog on and off.

    python benchmarks/gpu_watchdog.py            # CUDA: GPT-2 124M, bf16, DDP over a one-rank NCCL group
    python benchmarks/gpu_watchdog.py --smoke    # CPU: a tiny config over gloo, checks the script runs

NCCL allows one process per GPU, so on a one-GPU machine the watchdog can only be checked beside one
rank. This forms a one-rank NCCL process group as a launched job does (a TCPStore rendezvous; NCCL's own
watchdog and heartbeat monitor run as torch starts them), wraps the GPT example's model at GPT-2 small's
size in DDP (one all-reduce per step, so the watchdog samples a real NCCL sequence number), and times the
training step in interleaved rounds: with unison's watchdog thread running (`health.watchdog.Watchdog`,
connected to the store exactly as `PartialState` connects it: one tick a second, which reads the main
thread's frames and the group's sequence number and polls the store) and with it stopped. Reported: the
median step of each and their ratio (no measurable difference expected: the thread wakes once a second
and never synchronises the device), and whether the thread was alive at the end of every round it ran.
Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "gpt"))
sys.path.insert(0, str(HERE))
from machine import describe_machine  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from unison.health.watchdog import Watchdog  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arg = parser.add_argument
    arg("--smoke", action="store_true", help="tiny config over gloo on the CPU: check the script runs")
    arg("--batch-size", type=int, default=16)
    arg("--rounds", type=int, default=6)
    arg("--steps-per-round", type=int, default=30, help="a round should span several watchdog ticks (1 s)")
    arg("--warmup-steps", type=int, default=5)
    arg("--out", type=Path, default=HERE / "results" / "gpu_watchdog.json")
    args = parser.parse_args()
    if args.smoke:
        args.batch_size, args.rounds, args.steps_per_round, args.warmup_steps = 2, 4, 2, 1
    return args


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: this benchmark measures a GPU; run with --smoke to check it on CPU")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    host, port = "127.0.0.1", int(os.environ.get("MASTER_PORT", "29517"))
    store = dist.TCPStore(host, port, world_size=1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=0,
        world_size=1,
        **({"device_id": device} if cuda else {}),
    )
    config = (
        GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
        if cuda
        else GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=32)
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(config).to(device), device_ids=[0] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=cuda)
    windows = [
        torch.randint(0, config.vocab_size, (args.batch_size, config.block_size + 1), device=device)
        for _ in range(4)
    ]
    batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    def step(index: int) -> float:
        inputs, targets = batches[index % len(batches)]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast():
            _, loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # a logged loss waits for the step, as a training loop's does
        return time.perf_counter() - start

    def start_watchdog() -> Watchdog:
        # PartialState's own connection (a separate store client), without its atexit and signal hooks:
        # the thread is started and stopped round by round here
        watchdog = Watchdog.connect(host, port, "bench/", 0, 1, timeout=600.0, first_timeout=600.0)
        watchdog._thread.start()
        return watchdog

    def stop_watchdog(watchdog: Watchdog) -> bool:
        alive = watchdog._thread.is_alive()
        watchdog._stop.set()
        watchdog._thread.join()
        return alive

    done = 0
    for _ in range(args.warmup_steps):
        step(done)
        done += 1
    seconds: dict[str, list[float]] = {"watchdog on": [], "watchdog off": []}
    alive_at_end = []
    for index in range(args.rounds):
        for name in ("watchdog on", "watchdog off") if index % 2 == 0 else ("watchdog off", "watchdog on"):
            watchdog = start_watchdog() if name == "watchdog on" else None
            for _ in range(args.steps_per_round):
                seconds[name].append(step(done))
                done += 1
            if watchdog is not None:
                alive_at_end.append(stop_watchdog(watchdog))
    median = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = median["watchdog on"] / median["watchdog off"]
    info = describe_machine()
    info["device"] = torch.cuda.get_device_name(device) if cuda else "cpu"
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    print(
        f"GPT {config.n_layer}x{config.n_embd}, micro-batch {args.batch_size}x{config.block_size}, "
        f"{'bf16' if cuda else 'fp32'}, DDP over one {'NCCL' if cuda else 'gloo'} rank, on {info['device']}; "
        f"{args.rounds} interleaved rounds of {args.steps_per_round} steps\n"
        + "".join(f"{name:14}{median[name] * 1e3:10.2f} ms median step\n" for name in median)
        + f"on / off {ratio:.4f}; watchdog thread alive at the end of {sum(alive_at_end)} of "
        f"{len(alive_at_end)} rounds it ran"
    )
    result = {
        "benchmark": "gpu_watchdog",
        "machine": info,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "median_step_s": median,
        "ratio_on_over_off": ratio,
        "watchdog_alive_every_round": all(alive_at_end),
        "seconds": seconds,
    }
    dist.destroy_process_group()
    if not args.smoke:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    if not all(alive_at_end):
        raise SystemExit("the watchdog thread ended during a round: it failed beside this process group")


if __name__ == "__main__":
    main()
