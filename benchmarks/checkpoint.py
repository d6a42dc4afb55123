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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from machine import describe_machine  # noqa: E402  (benchmarks/, the script's own folder)
from model import GPT, GPTConfig  # noqa: E402

from unison import Accelerator  # noqa: E402
from unison.checkpoint import verify_checkpoint  # noqa: E402

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
    arg("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "checkpoint.json")
    return parser.parse_args()


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


def main() -> None:
    args = parse_args()
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


if __name__ == "__main__":
    main()
