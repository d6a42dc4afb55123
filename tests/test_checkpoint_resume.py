"""Exact resume through real launches: stopped or SIGKILLed runs, once resumed, end as uninterrupted ones."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launching import REPO_ROOT, WORKERS, launch_ok

WORKER = Path(__file__).parent / "workers" / "resume_worker.py"


def train(nproc: int, project: Path, out: Path, accum: int, *extra: str) -> None:
    launch_ok(WORKER, nproc, "--project", project, "--out", out, "--accum", str(accum), *extra)


def params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"parameters differ from the uninterrupted run: {different}"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def workers_of(project: Path) -> list[int]:
    """Pids of the live processes whose command line names `project` (the launcher and its workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(project).encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue  # ended while we looked
    return pids


def kill_at(nproc: int, project: Path, out: Path, accum: int, marker: str, delay: float = 0.0) -> None:
    """Start a run, wait until project/checkpoints/<marker> exists, then SIGKILL the launcher.

    The workers must die with it (the kernel kills them when the launcher goes, see state.py): a
    surviving worker would go on training and writing checkpoints beside the resumed run.
    """
    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", str(nproc), "--cpu", str(WORKER)]
    command += ["--project", str(project), "--out", str(out), "--accum", str(accum), "--step-sleep", "0.2"]
    command += ["--ballast-mb", "64"]
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    try:
        while not (project / "checkpoints" / marker).exists():
            assert process.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no checkpoint appeared within 120 s"
            time.sleep(0.002)
        time.sleep(delay)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + 10
    while workers_of(project) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers_of(project) == [], "workers outlived their SIGKILLed launcher"
    assert not out.exists(), "the run finished before the kill: the test proved nothing"


@pytest.mark.parametrize("nproc, accum", [(1, 4), (2, 2)], ids=["1proc", "2proc"])
def test_sigkilled_run_resumes_bit_identical(tmp_path, nproc, accum):
    reference = tmp_path / "reference.pt"
    train(nproc, tmp_path / "reference", reference, accum, "--ballast-mb", "64")

    project, out = tmp_path / "killed", tmp_path / "killed.pt"
    # Three kills: during the save of checkpoint_4 (its temporary folder exists, the manifest does not),
    # right after checkpoint_6 is complete, and between two saves; then a run to the end.
    kill_at(nproc, project, out, accum, ".checkpoint_4.tmp")
    assert not (project / "checkpoints" / "checkpoint_4").exists(), "the kill did not land during the save"
    kill_at(nproc, project, out, accum, "checkpoint_6/manifest.json")
    kill_at(nproc, project, out, accum, "checkpoint_8/manifest.json", delay=0.25)
    train(nproc, project, out, accum, "--ballast-mb", "64")
    assert_bit_identical(params(out), params(reference))


def test_resume_on_another_number_of_processes_follows_the_same_trajectory(tmp_path):
    common = ("--optimizer", "sgd", "--dropout", "0")
    reference = tmp_path / "reference.pt"
    train(2, tmp_path / "reference", reference, 2, *common)

    saved = tmp_path / "saved"
    train(2, saved, tmp_path / "unused.pt", 2, *common, "--stop-after", "3")
    assert (saved / "checkpoints" / "checkpoint_2").is_dir()
    for nproc, accum in [(1, 4), (4, 1)]:
        project = tmp_path / f"resumed{nproc}"
        shutil.copytree(saved, project)
        out = tmp_path / f"resumed{nproc}.pt"
        train(nproc, project, out, accum, *common)
        assert max_diff(params(out), params(reference)) < 1e-5, (nproc, accum)


def test_mid_epoch_resume_on_other_processes_and_accumulation_keeps_the_windows(tmp_path):
    """2 processes x accumulation 2, saved at step 3 (mid-epoch), resumed on 1 process x accumulation 4:
    the same 18 optimizer steps and parameters as the uninterrupted 1-process run (the saved micro-step
    count, 6 of k=2, ended the resumed run's first k=4 window after 2 micro-batches: 19 steps, 1.2e-2 off)."""
    worker = WORKERS / "resize_window_worker.py"
    launch_ok(worker, 2, tmp_path / "saved", 2, "-")
    launch_ok(worker, 1, tmp_path / "whole", 4, "-")
    launch_ok(worker, 1, tmp_path / "resumed", 4, tmp_path / "saved" / "ckpt_3")
    whole, resumed = (
        json.loads((tmp_path / run / "result.json").read_text()) for run in ("whole", "resumed")
    )
    assert whole["steps"] == resumed["steps"] == 18
    for name, values in whole["params"].items():
        assert torch.allclose(torch.tensor(resumed["params"][name]), torch.tensor(values), atol=1e-6), name


@pytest.mark.usefixtures("fresh_state")
def test_a_save_inside_an_accumulation_window_resumes_only_with_the_same_accumulation(tmp_path):
    from unison import Accelerator, AcceleratorState, CheckpointError, GradientState, PartialState

    def prepared(accumulation: int):
        for state in (PartialState, AcceleratorState, GradientState):
            state._reset_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
        model = torch.nn.Linear(2, 1)
        return accelerator, *accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    accelerator, model, optimizer = prepared(2)
    with accelerator.accumulate(model):  # one micro-batch of a window of 2
        accelerator.backward(model(torch.ones(1, 2)).sum())
    assert not accelerator.sync_gradients
    saved = accelerator.save_state(tmp_path / "inside")
    accelerator, model, optimizer = prepared(2)
    accelerator.load_state(saved)  # the same accumulation: the window goes on
    assert accelerator.step == 1
    accelerator, model, optimizer = prepared(4)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match="1 micro-batches into an accumulation window of 2 on 1"):
        accelerator.load_state(saved)
    assert torch.equal(model.weight, before)  # refused before anything was applied
