"""How much memory does each rank hold while a model is prepared (and resumed) under a sharded layout?

    python benchmarks/big_models.py [--mb 256] [--nproc 2]

The script launches itself under `unison launch --cpu --nproc-per-node NPROC`. The model: 8 blocks of
two square Linear layers, as wide as it takes to hold about --mb MB of fp32 parameters. For each
layout (ZeRO-3, TP 2, PP 2 at 2 processes) every rank measures its peak resident memory while the
model is built and prepared, three ways:

- **built normally**: every process builds the model with real weights, then prepare() (today's
  path for a model that fits: the whole model exists on every process before it is sharded);
- **meta, own init**: every process builds it inside `unison.init_empty_weights()`; prepare() shards
  it, allocates this rank's shards and replays the model's own init one module at a time, each
  process keeping its part of each whole tensor (unison/parallel/init_replay.py);
- **meta, from process 0**: process 0 builds it with real weights (as a script that loads a file on
  process 0 does), the others on meta; prepare() broadcasts process 0's weights one tensor at a time.

and, for ZeRO-3, resuming a DDP run's checkpoint (the whole model and its SGD momentum, in two files)
with load_state.

Peak: Linux's VmHWM, reset before each phase ("5" into /proc/self/clear_refs, after gc and
malloc_trim), minus the resident set at the reset; reported as a multiple of the model's size. The
workers run with MALLOC_MMAP_THRESHOLD_=1 MB, so that every tensor of 1 MB or more is its own mapping,
returned when freed, and the peak follows the live tensors rather than glibc's heap reuse.
Process 0 under "from process 0" holds the weights it sends (in CPU memory, which is what lets a
model bigger than one device start). The target: every rank that builds on meta near 1/N of the
model (its shard) plus one tensor in flight. A table is printed and JSON written to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
from peak_memory import Peak, on_every_process  # noqa: E402  (shared with the test worker)

BLOCKS = 8
RESULTS = Path(__file__).resolve().parent / "results" / "big_models.json"
LAYOUTS = ("zero3", "tp_size=2", "pp_size=2")


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}


def worker(args: argparse.Namespace) -> None:
    from unison import Accelerator, ParallelismConfig, PartialState, init_empty_weights

    PartialState(cpu=True)
    rank = dist.get_rank()
    width = int((args.mb * 2**20 / (BLOCKS * 2 * 4)) ** 0.5)
    size = BLOCKS * 2 * (width * width + width) * 4
    report: dict = {"model_bytes": size, "width": width, "nproc": dist.get_world_size(), "layouts": {}}

    def layout(name: str):
        if name.startswith("tp"):
            return ParallelismConfig(tp_size=2, tp_plan=tp_plan())
        return name

    def build(real: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        if real:
            return Stack(width)
        with init_empty_weights():
            return Stack(width)

    for name in LAYOUTS:
        row = {}
        for how, real_on in (
            ("built normally", (0, 1)),
            ("meta, own init", ()),
            ("meta, from process 0", (0,)),
        ):
            with Peak() as peak:
                model = Accelerator(cpu=True, parallelism=layout(name)).prepare(build(rank in real_on))
                del model
            row[how] = [b / size for b in on_every_process(peak.bytes)]
        report["layouts"][name] = row
    with tempfile.TemporaryDirectory() as tmp:
        shared = [str(Path(tmp) / "ckpt")]
        dist.broadcast_object_list(shared, src=0)
        ddp = Accelerator(cpu=True, parallelism="ddp")
        model = build(real=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = ddp.prepare(model, optimizer)
        model(torch.ones(2, width)).sum().backward()
        optimizer.step()
        ddp.save_state(shared[0])
        del model, optimizer, ddp
        zero3 = Accelerator(cpu=True, parallelism="zero3")
        model = zero3.prepare(build(real=False))
        zero3.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))  # its momentum resumes
        with Peak() as peak:
            zero3.load_state(shared[0])
        report["resume DDP checkpoint into zero3"] = [b / size for b in on_every_process(peak.bytes)]
        dist.barrier()
    if rank == 0:
        args.worker.write_text(json.dumps(report))


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", str(args.nproc), "--cpu"]
        command += [__file__, "--mb", str(args.mb), "--worker", str(out)]
        # MALLOC_MMAP_THRESHOLD_: glibc maps each allocation of 1 MB or more on its own and unmaps it
        # when freed, so the resident peak follows the live tensors, not how its heap was reused
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
        subprocess.run(command, check=True, env=env)
        report = json.loads(out.read_text())
    print(
        f"model: {report['model_bytes'] / 2**20:.0f} MB fp32, {report['nproc']} processes; "
        "peak per rank / model size"
    )
    print(f"{'layout':<12}{'built normally':>20}{'meta, own init':>20}{'meta, from process 0':>24}")
    for name, row in report["layouts"].items():
        cells = ["/".join(f"{x:.2f}" for x in row[how]) for how in row]
        print(f"{name:<12}{cells[0]:>20}{cells[1]:>20}{cells[2]:>24}")
    resume = "/".join(f"{x:.2f}" for x in report["resume DDP checkpoint into zero3"])
    print(f"resume a DDP checkpoint (model + momentum) into zero3: {resume}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="model size in MB of fp32 parameters")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: one launch's report
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
