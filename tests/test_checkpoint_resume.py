"""Exact resume through real launches: stopped or SIGKILLed runs, once resumed, end as uninterrupted ones."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from launching import REPO_ROOT, WORKERS, launch_ok

WORKER = Path(__file__).parent / "workers" / "resume_worker.py"


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


KILLS = (  # (file under PROJECT/checkpoints whose appearance triggers the SIGKILL, seconds waited after it,
    # MB of ballast: 64 makes the save last long enough to be killed mid-way, where that is the point)
    (".checkpoint_4.tmp", 0.0, 64),  # during the save of checkpoint_4: its temporary folder, no manifest yet
    ("checkpoint_6/manifest.json", 0.0, 0),  # right after checkpoint_6 is complete
    ("checkpoint_8/manifest.json", 0.25, 0),  # between two saves
)


def kill_at(
    nproc: int, project: Path, out: Path, accum: int, marker: str, delay: float, ballast: int
) -> list[str]:
    """Start a run, wait until project/checkpoints/<marker> exists, then SIGKILL the launcher.

    The workers must die with it (the kernel kills them when the launcher goes, see state.py): a
    surviving worker would go on training and writing checkpoints beside the resumed run. Returns what
    went wrong (nothing when the kill landed as meant), for the test to assert.
    """
    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", str(nproc), "--cpu", str(WORKER)]
    command += ["--project", str(project), "--out", str(out), "--accum", str(accum), "--step-sleep", "0.2"]
    command += ["--ballast-mb", str(ballast)]
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    problems = []
    deadline = time.monotonic() + 120
    try:
        while not (project / "checkpoints" / marker).exists():
            if process.poll() is not None:
                problems.append("the run ended before it was killed")
                break
            if time.monotonic() > deadline:
                problems.append("no checkpoint appeared within 120 s")
                break
            time.sleep(0.002)
        else:
            time.sleep(delay)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + 10
    while workers_of(project) and time.monotonic() < deadline:
        time.sleep(0.05)
    if workers_of(project):
        problems.append("workers outlived their SIGKILLed launcher")
    if out.exists():
        problems.append("the run finished before the kill: the test proved nothing")
    return problems


def kill_three_times(nproc: int, project: Path, accum: int) -> list[str]:
    """The KILLS in turn, each run resuming from what the last left; what went wrong, per kill."""
    problems = []
    for marker, delay, ballast in KILLS:
        found = kill_at(nproc, project, project.with_suffix(".pt"), accum, marker, delay, ballast)
        if marker == KILLS[0][0] and (project / "checkpoints" / "checkpoint_4").exists():
            found.append("the kill did not land during the save")
        problems += [f"kill at {marker}: {problem}" for problem in found]
    return problems


RESIZE_WORKER = WORKERS / "resize_window_worker.py"
SAVES = [f"result/ckpt_{step}" for step in (3, 6, 9)]  # resize_window_worker's saves on 2 processes
SGD = ("--optimizer", "sgd", "--dropout", "0")


def resume_run(project: Path, out: Path, accum: int, *extra: str) -> list[str]:
    """resize_window_worker's arguments for one resume_worker run in its launch."""
    return ["--", "--project", str(project), "--out", str(out), "--accum", str(accum), *extra]


@dataclass
class Launched:
    root: Path
    kill_problems: dict[int, list[str]]  # per number of processes


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Launched:
    """Every run of this file, in three launches on 2, 1 and 4 processes after the SIGKILLed runs (3 on
    2 processes, 3 on 1): the resize_window_worker runs (under resize/on<n>) and, in the same launches,
    the resume_worker runs (under resume/): the killed runs taken to the end (killed<n>.pt) and the
    uninterrupted ones they must equal (uninterrupted<n>.pt), and the SGD run on 2 x 2 (reference.pt),
    its save at step 2 (saved/), and that save resumed on 1 x 4 and 4 x 1 (resumed<n>.pt)."""
    root = tmp_path_factory.mktemp("launched")
    resize, resume = root / "resize", root / "resume"
    kills = {
        nproc: kill_three_times(nproc, resume / f"killed{nproc}", accum) for nproc, accum in ((2, 2), (1, 4))
    }

    def killed(nproc: int, accum: int) -> list[str]:  # the killed run to the end, and its reference
        return [
            *resume_run(resume / f"killed{nproc}", resume / f"killed{nproc}.pt", accum),
            *resume_run(resume / f"uninterrupted{nproc}", resume / f"uninterrupted{nproc}.pt", accum),
        ]

    saves = ",".join(str(resize / "on2" / save) for save in SAVES)
    launch_ok(
        RESIZE_WORKER, 2, resize / "on2", 2, f"-,{saves}",
        *resume_run(resume / "reference", resume / "reference.pt", 2, *SGD),
        *resume_run(resume / "saved", resume / "unused.pt", 2, *SGD, "--stop-after", "3"),
        *killed(2, 2),
    )  # fmt: skip
    for nproc in (1, 4):
        shutil.copytree(resume / "saved", resume / f"resumed{nproc}")
    launch_ok(
        RESIZE_WORKER, 1, resize / "on1", 4, f"-,{saves},{resize / 'on2' / SAVES[0]}:5",
        *resume_run(resume / "resumed1", resume / "resumed1.pt", 4, *SGD),
        *killed(1, 4),
    )  # fmt: skip
    launch_ok(
        RESIZE_WORKER, 4, resize / "on4", 1, saves,
        *resume_run(resume / "resumed4", resume / "resumed4.pt", 1, *SGD),
    )  # fmt: skip
    return Launched(root, kills)


@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "2proc"])
def test_sigkilled_run_resumes_bit_identical(launched, nproc):
    """SIGKILLed three times (KILLS: during a save, right after one, between two), each time resumed
    from the newest complete checkpoint, then taken to the end: the same parameters, bit for bit, as
    the uninterrupted run (AdamW, dropout; 1 x 4 and 2 x 2)."""
    assert launched.kill_problems[nproc] == []
    resume = launched.root / "resume"
    assert_bit_identical(params(resume / f"killed{nproc}.pt"), params(resume / f"uninterrupted{nproc}.pt"))
    # the last run went on from a checkpoint (a run that loaded nothing would end bit-identical too)
    assert int((resume / f"killed{nproc}.resumed_at").read_text()) > 0
    assert int((resume / f"uninterrupted{nproc}.resumed_at").read_text()) == 0


def test_resume_on_another_number_of_processes_follows_the_same_trajectory(launched):
    """Saved on 2 x 2 at step 2 (the run stopped at step 3), resumed on 1 x 4 and 4 x 1: each ends within
    1e-5 of the uninterrupted 2 x 2 run (SGD, no dropout)."""
    resume = launched.root / "resume"
    assert (resume / "saved" / "checkpoints" / "checkpoint_2").is_dir()
    assert not (resume / "unused.pt").exists()  # the saved run stopped at step 3
    reference = params(resume / "reference.pt")
    for nproc in (1, 4):
        assert max_diff(params(resume / f"resumed{nproc}.pt"), reference) < 1e-5, nproc


def test_resume_at_every_save_point_on_1_2_and_4_processes_with_accumulation_adjusted(launched):
    """2 processes x accumulation 2 (96 shuffled samples, micro-batch 4, AdamW, 3 epochs of 6 steps),
    saved every 3 optimizer steps; the saves at steps 3 (mid-epoch), 6 (an epoch boundary) and 9 (mid
    second epoch) are resumed on 1 x 4, 2 x 2 and 4 x 1 (the same global batch of 16): each takes the
    same 18 optimizer steps as the uninterrupted run and ends within 1e-4 of it (AdamW; measured 3e-8).
    Before the fix, the mid-epoch save resumed on 1 x 4 took 19 steps and ended 1.2e-2 away. A position
    that is no whole number of the resuming run's global batch (48 samples in steps of 5) is refused by
    load_state before anything is applied."""
    resize = launched.root / "resize"
    whole = json.loads((resize / "on1" / "result.json").read_text())
    assert whole["steps"] == 18
    for nproc in (1, 2, 4):
        for save in SAVES:
            name = Path(save).name
            resumed = json.loads((resize / f"on{nproc}" / f"{name}.json").read_text())
            assert resumed["steps"] == 18, (nproc, name, resumed["steps"])
            for key, values in whole["params"].items():
                diff = (torch.tensor(resumed["params"][key]) - torch.tensor(values)).abs().max().item()
                assert diff < 1e-4, (nproc, name, key, diff)
    refused = json.loads((resize / "on1" / "ckpt_3_mb5.json").read_text())
    assert refused["refused"].startswith("CheckpointError: "), refused
    assert "samples_consumed=48: that is not a multiple of its total_batch_size=5" in refused["refused"]
    assert refused["untouched"], "the model was changed before the checkpoint was refused"


@pytest.mark.usefixtures("fresh_state")
def test_a_save_inside_an_accumulation_window_resumes_only_with_the_same_accumulation(tmp_path):
    """The window goes on where the resumed accumulation is the saved one: with the script's own, or with
    another the script asks for (the saved global batch wins, checkpoint/global_batch.py). A micro-batch
    halved since the save needs accumulation 4 to keep the global batch, and a window of 2 cannot go on
    in one of 4: refused before anything is applied."""
    from torch.utils.data import DataLoader, TensorDataset

    from unison import Accelerator, AcceleratorState, CheckpointError, GradientState, PartialState

    def prepared(accumulation: int, batch_size: int = 2):
        for state in (PartialState, AcceleratorState, GradientState):
            state._reset_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
        model = torch.nn.Linear(2, 1)
        loader = DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=batch_size)
        return accelerator, *accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)

    accelerator, model, optimizer, _ = prepared(2)
    with accelerator.accumulate(model):  # one micro-batch of a window of 2
        accelerator.backward(model(torch.ones(1, 2)).sum())
    assert not accelerator.sync_gradients
    saved = accelerator.save_state(tmp_path / "inside")
    accelerator, model, optimizer, _ = prepared(2)
    accelerator.load_state(saved)  # the same accumulation: the window goes on
    assert accelerator.step == 1
    accelerator, model, optimizer, _ = prepared(4)
    accelerator.load_state(saved)
    assert (accelerator.step, accelerator.gradient_accumulation_steps) == (1, 2)
    accelerator.gradient_accumulation_steps = 4  # the documented way to change the global batch on purpose
    synced = []
    for _ in range(3):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(1, 2)).sum())
        synced.append(accelerator.sync_gradients)
    assert synced == [False, False, True]
    accelerator, model, optimizer, _ = prepared(2, batch_size=1)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match="window of 2 on 1 processes; this run accumulates 4 on 1"):
        accelerator.load_state(saved)
    assert torch.equal(model.weight, before)  # refused before anything was applied
    assert accelerator.gradient_accumulation_steps == 2
