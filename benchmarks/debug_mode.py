"""What do unison's safety checks cost per collective, by default and in debug mode?

    unison launch --nproc-per-node 2 --cpu benchmarks/debug_mode.py [--rounds 30 --calls 200]

Issue 13 asks that a mismatch between ranks be caught without slowing the default path. Compared, in
interleaved rounds inside the same processes (so the machine's noise hits all alike), the median time
of one call of:

- bare:          dist.all_reduce of a 4-element tensor (the floor);
- reduce:        unison's ops.reduce of it in the default mode (local checks only);
- reduce debug:  ops.reduce with the cross-rank shape check (UNISON_DEBUG=1: one more all_reduce and a
                 .tolist() per call);
- torch DETAIL:  dist.all_reduce on a group created under TORCH_DISTRIBUTED_DEBUG=DETAIL, which --debug
                 turns on (torch checks every collective's op and shapes across ranks first);
and the hang watchdog's own cost: one check (sampling the main thread's stack and one store request),
which it makes once a second, as a share of that second.

The main process prints a table and writes everything as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from unison import PartialState, ops  # noqa: E402
from unison.health import position


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds of every variant")
    parser.add_argument("--calls", type=int, default=200, help="calls of one variant per round")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "debug_mode.json"))
    return parser.parse_args()


def per_call_ms(function: Callable[[], object], calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls * 1e3


def reduce_in(mode: str, tensor: torch.Tensor) -> Callable[[], object]:
    def call():
        os.environ["UNISON_DEBUG"] = "1" if mode == "debug" else "0"  # read by ops on every call
        return ops.reduce(tensor)

    return call


def main() -> None:
    args = parse_args()
    state = PartialState(cpu=True)
    tensor = torch.ones(4)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    checked_group = dist.new_group(list(range(state.num_processes)))  # wrapped by torch's checker
    dist.set_debug_level(dist.DebugLevel.OFF)
    variants = {
        "bare": lambda: dist.all_reduce(tensor),
        "reduce": reduce_in("default", tensor),
        "reduce debug": reduce_in("debug", tensor),
        "torch DETAIL": lambda: dist.all_reduce(tensor, group=checked_group),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for function in variants.values():  # warm-up
        per_call_ms(function, 20)
    for _ in range(args.rounds):
        for name, function in variants.items():
            samples[name].append(per_call_ms(function, args.calls))
    os.environ.pop("UNISON_DEBUG", None)
    check_ms = [per_call_ms(lambda: position.main_thread_position(), 50) for _ in range(args.rounds)]
    store = dist.TCPStore(  # a client of the rendezvous store, as the watchdog has
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
    )
    store_ms = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(50):
            store.add("benchmark/ask", 0)
        store_ms.append((time.perf_counter() - start) / 50 * 1e3)
    if state.is_main_process:
        report(args, state, samples, check_ms, store_ms)


def report(args, state, samples, check_ms, store_ms) -> None:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    bare = medians["bare"]
    print(f"{'variant':<14} {'ms per call':>12} {'x bare':>8}")
    for name, value in medians.items():
        print(f"{name:<14} {value:>12.3f} {value / bare:>8.2f}")
    check = statistics.median(check_ms) + statistics.median(store_ms)
    print(f"watchdog check (once a second): {check:.3f} ms = {check / 10:.4f}% of each second")
    result = {
        "machine": describe_machine(),
        "date": time.strftime("%Y-%m-%d"),
        "processes": state.num_processes,
        "settings": vars(args),
        "median_ms": medians,
        "samples_ms": samples,
        "watchdog_check_ms": {"stack": check_ms, "store_request": store_ms, "median_total": check},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
