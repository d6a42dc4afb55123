"""What does context parallelism save per rank on CPU? Activation bytes kept for backward, and step time.

    unison launch --nproc-per-node 2 --cpu benchmarks/context_parallel.py [--seq 1024 --reps 5]

The causal SDPA model of tests/workers/context_parallel_worker.py, widened (4 layers x 128, 4 heads), one
sequence of --seq tokens. Process 0 first measures one process with the whole sequence (no distribution),
with CPU's default fused SDPA kernel and with the math kernel (the one the cp path must use on CPU);
then both processes run `cp_size=2` through Accelerator.prepare and maybe_context_parallel. Measured per
rank: the bytes autograd saves for backward in one forward (saved_tensors_hooks, each storage once, a
DTensor's local piece), and the median time of forward + backward over --reps steps after one warm-up (the
two runs are not interleaved: on a shared machine, read the times as rough). Prints a table and writes
JSON to --out.

What to expect from the CPU path (docs/context-parallel.md): everything outside attention is kept for
T / cp tokens; inside attention each rank keeps its T / cp rows of scores against all T keys, and the
gathered keys and values.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from unison import Accelerator

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cp_worker", ROOT / "tests/workers/context_parallel_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for backward while `step()` runs its forward."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(backward=False)
    return sum(seen.values())


def timed(step, reps: int) -> float:
    step(backward=True)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step(backward=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/context_parallel.json"))
    args = parser.parse_args()
    worker.WIDTH, worker.SEQ = 128, args.seq
    torch.manual_seed(0)
    tokens = torch.randint(0, worker.VOCAB, (1, args.seq + 1))
    rows = {}

    accelerator = Accelerator(parallelism="cp_size=2")
    if accelerator.is_main_process:  # one process, the whole sequence
        plain = make_model()

        def plain_step(backward: bool) -> None:
            pos = torch.arange(args.seq)[None]
            loss = worker.loss_of(plain(tokens[:, :-1], pos), tokens[:, 1:])
            if backward:
                loss.backward()

        rows["one process"] = {"saved_bytes": saved_bytes(plain_step), "step_s": timed(plain_step, args.reps)}
        with sdpa_kernel(SDPBackend.MATH):  # the kernel the cp path runs on CPU
            rows["one process, math"] = {
                "saved_bytes": saved_bytes(plain_step),
                "step_s": timed(plain_step, args.reps),
            }
    dist.barrier()

    model = accelerator.prepare(make_model())

    def cp_step(backward: bool) -> None:
        idx, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        pos = torch.arange(args.seq)[None].clone()
        with accelerator.maybe_context_parallel(buffers=[idx, targets, pos], buffer_seq_dims=[1, 1, 1]):
            loss = worker.loss_of(model(idx, pos), targets)
            if backward:
                accelerator.backward(loss)

    measured = {"saved_bytes": saved_bytes(cp_step), "step_s": timed(cp_step, args.reps)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, measured)
    if accelerator.is_main_process:
        for rank, value in enumerate(everyone):
            rows[f"cp_size=2, rank {rank}"] = value
        base = rows["one process"]
        print(f"seq {args.seq}, 4 layers x 128, 4 heads; CPU, gloo, {torch.__version__}")
        print(f"{'run':<22} {'saved MB':>9} {'vs one':>7} {'step s':>8} {'vs one':>7}")
        for name, value in rows.items():
            print(
                f"{name:<22} {value['saved_bytes'] / 2**20:9.1f} "
                f"{value['saved_bytes'] / base['saved_bytes']:7.2f} {value['step_s']:8.3f} "
                f"{value['step_s'] / base['step_s']:7.2f}"
            )
        Path(args.out).write_text(json.dumps({"seq": args.seq, "runs": rows}, indent=1) + "\n")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = worker.TinySdpaModel()
    model.layers.extend(worker.Block() for _ in range(2))  # 4 layers
    return model


if __name__ == "__main__":
    main()
