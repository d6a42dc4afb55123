"""What does a unison checkpoint cost over plain torch.save / torch.load of the same state dicts?

    python benchmarks/checkpoint.py [--reps 5 --dir /a/folder/on/the/disk/to/measure]

One process. The GPT of examples/gpt/model.py, sized to ~25M fp32 parameters (~100 MB), with AdamW
after one step (so its two moment buffers exist: the checkpoint is ~300 MB) and a LambdaLR scheduler,
saved and loaded three ways, each into a fresh directory, in interleaved rounds (one of each per
round, the order reversed every other round, after one untimed round), so whatever else the machine
does hits all three alike:

- **plain**: `torch.save` of the model, optimizer and scheduler state dicts into three files, and
  `torch.load(weights_only=True)` + `load_state_dict` back. No fsync: save returns once the bytes are
  in the page cache, and a crash in the next ~30 s can lose or truncate them.
- **plain+fsync**: the same, plus what durability needs and unison does: each file fsynced, then the
  directory and its parent (so the new names survive a crash too).
- **unison**: `accelerator.save_state(dir)` / `accelerator.load_state(dir)`: the same three files plus
  counters and RNG state, written into `.<dir>.tmp`, every file fsynced and CRC-32-checksummed,
  manifest.json written and fsynced, renamed into place; loading reads every file (weights_only=True)
  while a thread checks every file's size and checksums, and applies them once the check has passed.

Target: unison within 1.2x of the plain call that does the same: for saves plain+fsync (the same
durability; against plain without fsync the ratio is printed too: the price of durability, which
depends mostly on the disk), for loads the plain loads (the same code after either plain save,
pooled). Before every timed save and load, `os.sync()` (untimed) flushes what earlier work left dirty,
so no measurement pays for another's writeback. Each checkpoint is loaded twice: from the page cache
(as right after saving), then from the disk, its pages evicted first (posix_fadvise DONTNEED, on
clean pages), as when a new process resumes from an old checkpoint.

After the rounds, a breakdown of unison's extra cost: the checksum pass, the fsyncs, the verify pass,
torch.load with and without weights_only. A table is printed and everything is written as JSON to --out.

    python benchmarks/checkpoint.py --scaling [--nproc 1 2 4] [--mb-per-rank 32 128 256] [--reps 3]

How save_state / load_state scale: the script launches itself under `unison launch --cpu` with each
number of processes, and saves and loads a ZeRO-3 model with AdamW: 8 square Linear layers, as wide
as it takes for each process to hold about --mb-per-rank MB of parameters and moments (on one process
the same bytes as plain files). The model always has the same 8 tensors (and 16 moments), so what
changes from row to row is the bytes per process and the number of processes, not the number of
tensors, whose per-tensor costs (DCP's planning, one record per tensor) are another matter. Every
process checksums the files it wrote and verifies its share on load, so the times should follow the
bytes per process, not the number of processes. Reported per (processes, MB per process), medians of
--reps rounds after an untimed one: save, load from the page cache, load from the disk (pages evicted
first), and the checksum pass alone both ways: every file verified by process 0 while the others wait
(what unison did before), and each process verifying its own share at the same time (what it does
now); each as the wall seconds of the slowest process and the CPU seconds of the busiest (its own
work, which is its wall time where each process has cores of its own). Written to
results/checkpoint_scaling.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from machine import describe_machine  # noqa: E402  (benchmarks/, the script's own folder)
from model import GPT, GPTConfig  # noqa: E402

from unison import Accelerator, PartialState  # noqa: E402
from unison.checkpoint import files_of_process, read_manifest, verify_checkpoint, verify_files  # noqa: E402
from unison.ops import gather_object  # noqa: E402

TARGET = 1.2  # unison time / plain time, at most: saves against plain+fsync, loads against plain loads
VARIANTS = ("plain", "plain+fsync", "unison")
KINDS = ("save_s", "load_cached_s", "load_disk_s")
MB = 1e6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arg = parser.add_argument
    arg("--reps", type=int, default=5, help="timed rounds (each saves and loads once per variant)")
    arg("--n-layer", type=int, default=8)
    arg("--n-embd", type=int, default=512, help="8 x 512 gives 25.3M parameters, 101 MB in fp32")
    arg("--n-head", type=int, default=8)
    arg("--block-size", type=int, default=256)
    arg("--dir", type=Path, default=None, help="where checkpoints are written (default: a temporary dir)")
    arg("--out", type=Path, default=None, help="JSON output (default: results/checkpoint[_scaling].json)")
    arg("--scaling", action="store_true", help="save/load time against bytes per process and processes")
    arg("--nproc", type=int, nargs="+", default=[1, 2, 4], help="--scaling: numbers of processes")
    arg("--mb-per-rank", type=int, nargs="+", default=[32, 128, 256], help="--scaling: MB per process")
    arg("--scaling-worker", type=Path, help=argparse.SUPPRESS)  # internal: one launch, JSON written here
    args = parser.parse_args()
    if args.out is None:
        name = "checkpoint_scaling.json" if args.scaling else "checkpoint.json"
        args.out = Path(__file__).resolve().parent / "results" / name
    return args


# -- the plain calls ------------------------------------------------------------------------------
def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_save(parts: dict[str, object], directory: Path, fsync: bool) -> None:
    directory.mkdir()
    for name, obj in parts.items():
        with open(directory / name, "wb") as file:
            torch.save(obj.state_dict(), file)
            if fsync:
                file.flush()
                os.fsync(file.fileno())
    if fsync:
        fsync_directory(directory)
        fsync_directory(directory.parent)


def plain_load(parts: dict[str, object], directory: Path, weights_only: bool = True) -> None:
    for name, obj in parts.items():
        obj.load_state_dict(torch.load(directory / name, map_location="cpu", weights_only=weights_only))


# -- measuring ------------------------------------------------------------------------------------
def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def evict(directory: Path) -> None:
    """Drop the (clean, already synced) pages of every file under `directory` from the page cache."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def breakdown(accelerator: Accelerator, parts: dict[str, object], root: Path, reps: int) -> dict:
    """Where unison's extra time goes, each piece timed alone on a fresh unison checkpoint."""
    directory = root / "breakdown"
    os.sync()
    accelerator.save_state(directory)
    os.sync()
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json")
    data = [path.read_bytes() for path in files]
    pieces: dict[str, list[float]] = {
        "crc32 of every file, in memory (1 thread)": [],
        "fsync of every file, after a fresh write": [],
        "verify_checkpoint (size + CRC-32 of every file)": [],
        "torch.load(weights_only=True) + load_state_dict": [],
        "torch.load(weights_only=False) + load_state_dict": [],
    }
    names = list(pieces)
    for _ in range(reps):
        pieces[names[0]].append(timed(lambda: [zlib.crc32(blob) for blob in data]))
        rewrite = root / "rewrite"
        rewrite.mkdir()
        for path, blob in zip(files, data):
            (rewrite / path.name).write_bytes(blob)

        def fsync_all(rewrite: Path = rewrite) -> None:
            for path in files:
                with open(rewrite / path.name, "rb") as file:
                    os.fsync(file.fileno())

        pieces[names[1]].append(timed(fsync_all))
        shutil.rmtree(rewrite)
        os.sync()
        pieces[names[2]].append(timed(lambda: verify_checkpoint(directory)))
        pieces[names[3]].append(timed(lambda: plain_load(parts, directory, weights_only=True)))
        pieces[names[4]].append(timed(lambda: plain_load(parts, directory, weights_only=False)))
    shutil.rmtree(directory)
    return {name: {"median_s": statistics.median(times), "s": times} for name, times in pieces.items()}


def disk(path: Path) -> dict:
    info = {"path": str(path)}
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError, ValueError):
        out = (
            subprocess.run(
                ["df", "--output=source,fstype,size,avail", str(path)], capture_output=True, text=True
            )
            .stdout.split("\n")[1]
            .split()
        )
        info.update(device=out[0], filesystem=out[1], size_kb=int(out[2]), avail_kb=int(out[3]))
    return info


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    config = GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(model, optimizer, scheduler)
    x = torch.randint(0, config.vocab_size, (2, 32))
    _, loss = prepared[0](x, x)
    accelerator.backward(loss)
    prepared[1].step()  # AdamW's exp_avg / exp_avg_sq now exist: the optimizer state is 2x the model
    prepared[2].step()
    prepared[1].zero_grad()
    parts = {"model_0.pt": model, "optimizer_0.pt": optimizer, "scheduler_0.pt": scheduler}  # unison's names
    model_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())

    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="unison_ckpt_bench_", dir=args.dir))
    counter = iter(range(10**9))

    def one(variant: str) -> dict[str, float]:
        """Save into a fresh directory, load it back from the page cache, then from the disk, remove it."""
        directory = root / f"{variant.replace('+', '_')}_{next(counter)}"
        if variant == "unison":
            save = functools.partial(accelerator.save_state, directory)
            load = functools.partial(accelerator.load_state, directory)
        else:
            save = functools.partial(plain_save, parts, directory, fsync=variant == "plain+fsync")
            load = functools.partial(plain_load, parts, directory)
        os.sync()
        sample = {"save_s": timed(save), "bytes": directory_bytes(directory)}
        os.sync()
        sample["load_cached_s"] = timed(load)
        evict(directory)
        sample["load_disk_s"] = timed(load)
        shutil.rmtree(directory)
        return sample

    try:
        for variant in VARIANTS:  # warm-up: imports, allocator, first-touch of the files
            one(variant)
        samples: dict[str, dict[str, list[float]]] = {v: {kind: [] for kind in KINDS} for v in VARIANTS}
        sizes: dict[str, int] = {}
        for round_index in range(args.reps):
            order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                sample = one(variant)
                sizes[variant] = sample.pop("bytes")
                for kind, seconds in sample.items():
                    samples[variant][kind].append(seconds)
        pieces = breakdown(accelerator, parts, root, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, samples, sizes, model_bytes, pieces, disk(root.parent))


def report(args, samples, sizes, model_bytes, pieces, disk_info) -> None:
    info = describe_machine()
    medians = {v: {kind: statistics.median(samples[v][kind]) for kind in KINDS} for v in VARIANTS}
    # what unison is held to: a save with the same durability (plain+fsync); for loads, which are the
    # same code after either plain save, every plain load (both variants pooled)
    baseline = {"save_s": medians["plain+fsync"]["save_s"]}
    for kind in KINDS[1:]:
        baseline[kind] = statistics.median(samples["plain"][kind] + samples["plain+fsync"][kind])
    ratios = {v: {kind: medians[v][kind] / baseline[kind] for kind in KINDS} for v in VARIANTS}
    unfsynced = medians["unison"]["save_s"] / medians["plain"]["save_s"]
    rates = {v: {kind: sizes[v] / MB / medians[v][kind] for kind in KINDS} for v in VARIANTS}
    lines = [
        f"checkpoint save/load: 1 process on {info['cores']} cores ({info['cpu']}), torch {info['torch']}, "
        f"{info['date']}",
        f"GPT {args.n_layer}x{args.n_embd} + AdamW (one step) + LambdaLR: model {model_bytes / MB:.1f} MB, "
        f"checkpoint {sizes['unison'] / MB:.1f} MB (plain: {sizes['plain'] / MB:.1f} MB)",
        f"disk: {disk_info.get('device', '?')} ({disk_info.get('filesystem', '?')}) under "
        f"{disk_info['path']}; medians of {args.reps} interleaved rounds",
        "each cell: seconds (MB/s), ratio to the baseline (saves: plain+fsync; loads: all plain loads)",
        f"{'':13}{'save':>22}{'load, page cache':>22}{'load, from disk':>22}",
    ]
    for v in VARIANTS:
        lines.append(
            f"{v:13}"
            + "".join(f"{medians[v][k]:8.3f} ({rates[v][k]:4.0f}) {ratios[v][k]:5.2f}x" for k in KINDS)
        )
    lines.append(
        f"target: unison / baseline <= {TARGET}: "
        + ", ".join(f"{kind[:-2]} {ratios['unison'][kind]:.2f}x" for kind in KINDS)
        + f"; unison save / plain save without fsync: {unfsynced:.2f}x"
    )
    lines.append("breakdown (medians, s):")
    lines += [f"  {name:52}{piece['median_s']:8.3f}" for name, piece in pieces.items()]
    print("\n".join(lines))
    result = {
        "benchmark": "checkpoint",
        "machine": info,
        "disk": disk_info,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_mb": model_bytes / MB,
        "checkpoint_mb": {v: sizes[v] / MB for v in VARIANTS},
        "median_s": medians,
        "mb_per_s": rates,
        "baseline_s": baseline,
        "ratio_to_baseline": ratios,
        "unison_save_to_plain_save_without_fsync": unfsynced,
        "target_max": TARGET,
        "meets_target": {kind: ratios["unison"][kind] <= TARGET for kind in KINDS},
        "samples": samples,
        "breakdown": pieces,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


# -- scaling with bytes per process and the number of processes ----------------------------------------
SCALING_KINDS = ("save", "load_cached", "load_disk", "verify_process_0_all", "verify_each_own")
DEPTH = 8


class LayerStack(nn.Module):
    """DEPTH square Linear layers in a ModuleList: ZeRO-3 shards each layer's rows over the processes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def slowest(action: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds of `action` on the slowest process, CPU seconds of the busiest one: all its threads),
    every process starting together after an untimed os.sync().

    The CPU seconds are each process's own work: what its wall time would be with cores of its own, as
    on a cluster, whereas processes that share this machine's cores also wait for each other's turn.
    """
    state = PartialState()
    if state.is_main_process:
        os.sync()
    state.wait_for_everyone()
    cpu = time.process_time()
    wall = timed(action)
    cpu = time.process_time() - cpu
    everyone = gather_object([(wall, cpu)])
    return max(w for w, _ in everyone), max(c for _, c in everyone)


def scaling_worker(args: argparse.Namespace) -> None:
    """One launch: for each size, train one step, then --reps rounds (after an untimed one) of save, load
    twice, and the checksum pass both ways; process 0 writes the medians and samples as JSON."""
    nproc, root = int(os.environ["WORLD_SIZE"]), args.dir  # a folder of the launching process
    results = []
    for mb in args.mb_per_rank:
        # parameters + AdamW's two moments: 12 bytes per parameter, 1/nproc of them on each process
        width = 64 * max(1, round((mb * MB * nproc / 12 / DEPTH) ** 0.5 / 64))
        accelerator = Accelerator(cpu=True, parallelism="zero3" if nproc > 1 else None)
        torch.manual_seed(0)
        model = LayerStack(width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.backward(model(torch.randn(2, width)).square().mean())
        optimizer.step()  # the moments exist now
        optimizer.zero_grad()
        rank = accelerator.process_index
        samples: dict[str, dict[str, list[float]]] = {kind: {"s": [], "cpu_s": []} for kind in SCALING_KINDS}
        for round_index in range(args.reps + 1):
            directory = root / f"mb{mb}_{round_index}"
            save = functools.partial(accelerator.save_state, directory)
            load = functools.partial(accelerator.load_state, directory)
            sample = {"save": slowest(save), "load_cached": slowest(load)}
            if accelerator.is_main_process:
                evict(directory)
            sample["load_disk"] = slowest(load)
            manifest = read_manifest(directory)
            own = files_of_process(manifest, rank, nproc)
            everything = sorted(manifest["files"]) if rank == 0 else []  # the others wait, as they did
            sample["verify_process_0_all"] = slowest(
                functools.partial(verify_files, directory, manifest, everything)
            )
            sample["verify_each_own"] = slowest(functools.partial(verify_files, directory, manifest, own))
            if round_index > 0:
                for kind, (wall, cpu) in sample.items():
                    samples[kind]["s"].append(wall)
                    samples[kind]["cpu_s"].append(cpu)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                shutil.rmtree(directory)
        per_rank = [
            sum(manifest["files"][name]["size"] for name in files_of_process(manifest, r, nproc))
            for r in range(nproc)
        ]
        results.append(
            {
                "processes": nproc,
                "mb_per_rank_asked": mb,
                "width": width,
                "parameters": DEPTH * width * width,
                "checkpoint_bytes": sum(entry["size"] for entry in manifest["files"].values()),
                "bytes_per_rank": per_rank,
                "median": {
                    kind: {unit: statistics.median(values) for unit, values in times.items()}
                    for kind, times in samples.items()
                },
                "samples": samples,
            }
        )
        accelerator.end_training()
    if PartialState().is_main_process:
        args.scaling_worker.write_text(json.dumps(results))


def scaling(args: argparse.Namespace) -> None:
    rows, load_average = [], {"start": os.getloadavg()}
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    for nproc in args.nproc:
        with tempfile.TemporaryDirectory(prefix="unison_ckpt_scaling_", dir=args.dir) as folder:
            out = Path(folder) / "result.json"
            command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", str(nproc), "--cpu"]
            command += [__file__, "--scaling-worker", str(out), "--dir", folder, "--reps", str(args.reps)]
            command += ["--mb-per-rank", *map(str, args.mb_per_rank)]
            subprocess.run(command, check=True)
            rows += json.loads(out.read_text())
    load_average["end"] = os.getloadavg()
    info = describe_machine()
    disk_info = disk(args.dir or Path(tempfile.gettempdir()))
    lines = [
        f"save_state / load_state of ZeRO-3 + AdamW (1 process: plain files) on {info['cores']} cores "
        f"({info['cpu']}), torch {info['torch']}, {info['date']}, load average "
        f"{load_average['start'][0]:.1f} -> {load_average['end'][0]:.1f}",
        f"disk: {disk_info.get('device', '?')} ({disk_info.get('filesystem', '?')}) under "
        f"{disk_info['path']}; medians of {args.reps} rounds; each cell: wall seconds of the slowest "
        "process (CPU seconds of the busiest)",
        f"{'procs':>5} {'MB/proc':>8} {'total MB':>9} {'save':>14} {'load, cache':>14} {'load, disk':>14} "
        f"{'verify: proc 0 all':>19} {'verify: each own':>17}",
    ]
    for row in rows:
        cells = [
            f"{row['median'][kind]['s']:.3f} ({row['median'][kind]['cpu_s']:.3f})" for kind in SCALING_KINDS
        ]
        per_rank, total = max(row["bytes_per_rank"]) / MB, row["checkpoint_bytes"] / MB
        widths = (14, 14, 14, 19, 17)
        lines.append(
            f"{row['processes']:>5} {per_rank:>8.1f} {total:>9.1f} "
            + " ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths))
        )
    print("\n".join(lines))
    result = {
        "benchmark": "checkpoint_scaling",
        "machine": info,
        "disk": disk_info,
        "load_average": load_average,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.scaling_worker is not None:
        scaling_worker(arguments)
    elif arguments.scaling:
        scaling(arguments)
    else:
        main(arguments)
