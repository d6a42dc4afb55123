"""Does a long run leak? Memory, file descriptors, threads and disk over 2,000 steps with checkpoints.

    python benchmarks/soak.py                       # 2 processes x 2,000 steps, about 40 s on 2 cores
    python benchmarks/soak.py --steps 200 --save-every 20

A leak that costs a few kB or one file descriptor per step or per checkpoint is invisible in a test of
ten steps and ends a week-long job (the OOM killer, EMFILE, a full disk). The script launches itself
under `unison launch --nproc-per-node 2 --cpu` and trains a small MLP the way the checkpointing guide
writes a loop: a shuffled DataLoader, AdamW, the loss averaged over processes every step
(`accelerator.reduce`), an evaluation with `gather_for_metrics` and `save_state()` every --save-every
steps into a project with ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2).

Every --sample-every steps (and right after each save) each process records its resident memory (RSS,
/proc/self/status), open file descriptors (/proc/self/fd), threads (/proc/self/task), and the main
process the bytes and entries under the project directory. From the outside the report process samples
the launcher (torch's elastic agent runs in it) once a second.

What matters, measured after the warm-up (--warmup steps, default three saves: past the first
checkpoint removed by total_limit, when every code path has run once and allocators hold their pools):
- RSS: peak after the warm-up against RSS at its end; target growth < 5%;
- file descriptors and threads: the same count at the end as after the warm-up, never more;
- disk: never more than total_limit checkpoints, no leftover temporary directories.
The main process prints a table and writes every sample as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import describe_machine  # noqa: E402

from unison import Accelerator, ProjectConfiguration, set_seed  # noqa: E402

RSS_GROWTH_TARGET = 0.05
PROCESSES = 2
# A tiny MLP, yet 0.5M parameters: its checkpoint (weights and AdamW's two moments, ~6 MB) is large
# enough that keeping one save's state alive per checkpoint would show in RSS (~2% per save).
FEATURES, HIDDEN = 128, 2048


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arg = parser.add_argument
    arg("--steps", type=int, default=2000)
    arg("--save-every", type=int, default=100)
    arg("--total-limit", type=int, default=2)
    arg("--sample-every", type=int, default=20)
    arg("--warmup", type=int, default=None, help="steps before the baseline sample (default 3 saves)")
    arg("--out", type=Path, default=HERE / "results" / "soak.json")
    arg("--worker", type=Path, default=None, help="(internal) run as a launched worker, samples to this file")
    arg("--project", type=Path, default=None, help="(internal) the worker's project directory")
    return parser.parse_args()


# -- what is sampled ------------------------------------------------------------------------------
def process_figures(pid: int | str = "self") -> dict[str, int]:
    """RSS in kB, open file descriptors and threads of one process, from /proc."""
    proc = Path("/proc") / str(pid)
    status = (proc / "status").read_text()
    rss_kb = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
    return {"rss_kb": rss_kb, "fds": len(os.listdir(proc / "fd")), "threads": len(os.listdir(proc / "task"))}


def disk_figures(project: Path) -> dict[str, int]:
    """Bytes of every file under `project`, and the entries of its checkpoints folder (hidden included)."""
    files = [path for path in project.rglob("*") if path.is_file()]
    checkpoints = project / "checkpoints"
    entries = sorted(path.name for path in checkpoints.iterdir()) if checkpoints.is_dir() else []
    return {"disk_bytes": sum(path.stat().st_size for path in files), "checkpoint_entries": entries}


# -- the launched workers -------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=args.project, automatic_checkpoint_naming=True, total_limit=args.total_limit
        ),
    )
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, FEATURES, generator=generator)
    train = TensorDataset(x, torch.tanh(x @ torch.randn(FEATURES, FEATURES, generator=generator)))
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Dropout(0.1), nn.Linear(HIDDEN, FEATURES)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(
        model,
        optimizer,
        DataLoader(train, batch_size=16, shuffle=True),
        DataLoader(TensorDataset(*train[:100]), batch_size=16),
    )
    samples = []

    def sample(step: int) -> None:
        figures = {"step": step, "time": time.time(), **process_figures()}
        if accelerator.is_main_process:
            figures.update(disk_figures(args.project))
        samples.append(figures)

    sample(0)
    step, epoch = 0, 0
    while step < args.steps:
        train_dl.set_epoch(epoch)
        for inputs, targets in train_dl:
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.reduce(loss.detach(), "mean")
            step += 1
            if step % args.save_every == 0:
                model.eval()
                with torch.no_grad():
                    for inputs, _ in eval_dl:
                        accelerator.gather_for_metrics(model(inputs))
                model.train()
                accelerator.save_state()
            if step % args.sample_every == 0 or step % args.save_every == 0:
                sample(step)
            if step == args.steps:
                break
        epoch += 1
    gathered = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, samples)
    if accelerator.is_main_process:  # the machine as the workers see it (their torch threads)
        args.worker.write_text(json.dumps({"machine": describe_machine(), "workers": gathered}))


# -- the report -----------------------------------------------------------------------------------
def run_launch(args: argparse.Namespace, folder: Path) -> tuple[dict, list[dict]]:
    """Launch the workers; return what they wrote (the machine, their samples) and the launcher's samples
    (one a second, from outside)."""
    out = folder / "workers.json"
    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", str(PROCESSES), "--cpu"]
    command += [__file__, "--worker", str(out), "--project", str(folder / "project")]
    for flag in ("steps", "save_every", "total_limit", "sample_every"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    launcher = subprocess.Popen(command)
    launcher_samples = []
    while launcher.poll() is None:
        try:
            launcher_samples.append({"time": time.time(), **process_figures(launcher.pid)})
        except (OSError, StopIteration):  # it ended while we read
            break
        time.sleep(1)
    if launcher.wait() != 0:
        raise SystemExit(f"the soak run failed (exit code {launcher.returncode})")
    return json.loads(out.read_text()), launcher_samples


def summarize(samples: list[dict], in_warmup: Callable[[dict], bool]) -> dict:
    """Figures at the end of the warm-up (the last sample in it: the baseline), their peak after it, and
    at the end; RSS growth is the peak after the warm-up over the baseline."""
    baseline = [s for s in samples if in_warmup(s)][-1]
    after = [s for s in samples if not in_warmup(s)]
    summary = {}
    for key in ("rss_kb", "fds", "threads"):
        summary[key] = {
            "warmup": baseline[key],
            "peak_after": max(s[key] for s in after),
            "end": after[-1][key],
        }
    summary["rss_growth"] = summary["rss_kb"]["peak_after"] / summary["rss_kb"]["warmup"] - 1
    return summary


def report(args: argparse.Namespace) -> None:
    warmup = args.warmup if args.warmup is not None else 3 * args.save_every
    with tempfile.TemporaryDirectory(prefix="unison-soak-") as folder:
        started = time.time()
        launched, launcher_samples = run_launch(args, Path(folder))
        elapsed = time.time() - started
    workers = launched["workers"]
    rows = {
        f"rank {rank}": summarize(samples, lambda s: s["step"] <= warmup)
        for rank, samples in enumerate(workers)
    }
    warmup_end = next(s["time"] for s in workers[0] if s["step"] >= warmup)  # the launcher's clock: rank 0's
    rows["launcher"] = summarize(launcher_samples, lambda s: s["time"] <= warmup_end)
    main_samples = workers[0]
    disk = {
        "peak_bytes_after_warmup": max(s["disk_bytes"] for s in main_samples if s["step"] > warmup),
        "end_bytes": main_samples[-1]["disk_bytes"],
        "most_entries": max(len(s["checkpoint_entries"]) for s in main_samples),
        "end_entries": main_samples[-1]["checkpoint_entries"],
    }
    print(
        f"{PROCESSES} processes x {args.steps} steps, save every {args.save_every}, total_limit "
        f"{args.total_limit}; warm-up {warmup} steps; {elapsed:.0f} s"
    )
    header = ("process", "RSS MiB warm-up", "peak after", "end", "growth", "fds", "threads")
    print("{:<9} {:>14} {:>10} {:>8} {:>7} {:>12} {:>12}".format(*header))
    for name, row in rows.items():
        rss, fds, threads = row["rss_kb"], row["fds"], row["threads"]
        print(
            f"{name:<9} {rss['warmup'] / 1024:14.1f} {rss['peak_after'] / 1024:10.1f} "
            f"{rss['end'] / 1024:8.1f} "
            f"{100 * row['rss_growth']:6.2f}% {fds['warmup']:>4} -> {fds['peak_after']:<4} "
            f"{threads['warmup']:>4} -> {threads['peak_after']:<4}"
        )
    print(
        f"disk: peak {disk['peak_bytes_after_warmup'] / 1e3:.1f} kB after the warm-up, "
        f"{disk['end_bytes'] / 1e3:.1f} kB at the end; at most {disk['most_entries']} entries in "
        f"checkpoints/, at the end {disk['end_entries']}"
    )
    worst = max(row["rss_growth"] for name, row in rows.items() if name.startswith("rank"))
    target = f"target < {100 * RSS_GROWTH_TARGET:g}%"
    print(f"worst worker RSS growth after the warm-up: {100 * worst:.2f}% ({target})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: getattr(args, key) for key in ("steps", "save_every", "total_limit", "sample_every")}
    settings.update(warmup=warmup, processes=PROCESSES, elapsed_s=elapsed)
    result = {
        "machine": launched["machine"],
        "settings": settings,
        "summary": rows,
        "disk": disk,
        "samples": {"workers": workers, "launcher": launcher_samples},
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"written to {args.out}")


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
