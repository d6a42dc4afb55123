"""A stop signal while an asynchronous save is in flight: the save is finished first, within
UNISON_CHECKPOINT_GRACE seconds, or abandoned and said so (checkpoint/stop_signals.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from interrupt_save_worker import prepared
from launching import REPO_ROOT, WORKERS
from slowness import budget

from unison import Accelerator, env_vars
from unison.checkpoint import MANIFEST_NAME, verify_checkpoint
from unison.checkpoint import writing as checkpoint_writing
from unison.launching.launcher import LaunchError, worker_environment
from unison.launching.report import stopped_line

WORKER = WORKERS / "interrupt_save_worker.py"


BALLAST_MB = (100, 400, 1200)
"""The checkpoint's extra megabytes: 100 keep the write in flight 0.2 s after the launcher relayed the
saved line on an idle machine; on a busy one the line may come late, after the write."""


def _interrupted_save(tmp_path, ballast: int) -> tuple[subprocess.Popen, str, bool]:
    """Launch the worker (2 processes) with `ballast` MB in its checkpoint, Ctrl-C it 0.2 s after its
    saved line: the process, the line, and whether the checkpoint was complete before the signal."""
    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", "2", "--cpu", str(WORKER)]
    process = subprocess.Popen(
        [*command, str(tmp_path), str(ballast)],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", env_vars.CHECKPOINT_GRACE: "120"},  # a loaded machine
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    marker = process.stdout.readline()
    time.sleep(0.2)
    complete_before = (tmp_path / "checkpoints" / "checkpoint_3" / MANIFEST_NAME).exists()
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    return process, marker, complete_before


@pytest.mark.usefixtures("fresh_state")
def test_ctrl_c_during_an_asynchronous_save_finishes_it_and_the_last_line_says_so(tmp_path):
    """Ctrl-C to `unison launch` 0.2 s after save_state(async_save=True) returned (2 processes, 100 MB of
    ballast, more on a busy machine: the write is still in flight then): the workers finish the checkpoint
    before they end, the launcher's last line names it as complete, and a fresh run (here, one process)
    loads it with the parameters it saved. Before, the workers ended at once, and the line said nothing of
    the 23-123 MB left in `.checkpoint_3.tmp`."""
    checkpoint = tmp_path / "checkpoints" / "checkpoint_3"
    for ballast in BALLAST_MB:  # the line relayed late on a busy machine: more ballast, until it is in flight
        process, marker, complete_before = _interrupted_save(tmp_path, ballast)
        stdout, stderr = process.communicate(timeout=budget(180))
        assert marker == f"[rank0]: saved {checkpoint}\n", (marker, stdout, stderr)
        if not complete_before:
            break
        shutil.rmtree(tmp_path / "checkpoints")
    assert not complete_before, f"the write of {BALLAST_MB} MB ended within 0.2 s of its line each time"
    assert process.returncode == 130, (stdout, stderr)
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"unison launch: stopped by SIGINT; the checkpoint being saved in the background, "
        rf"{re.escape(str(checkpoint))}, was finished first \(\d+\.\d s; UNISON_CHECKPOINT_GRACE=120 s\): "
        r"it is complete\.",
        last,
    ), stderr
    assert verify_checkpoint(checkpoint)["files"]
    assert sorted(path.name for path in checkpoint.parent.iterdir()) == ["checkpoint_3"]  # no .tmp left

    accelerator, model, _ = prepared(tmp_path, 0)
    assert accelerator.load_state() == checkpoint
    saved, loaded = torch.load(tmp_path / "saved.pt", weights_only=True), model.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


@pytest.mark.usefixtures("fresh_state")
def test_a_save_still_writing_after_the_grace_is_abandoned_removed_and_said(tmp_path, monkeypatch):
    """SIGTERM while the write is stuck: after UNISON_CHECKPOINT_GRACE the temporary folder is removed,
    the note for the launcher's line says the save was abandoned and names the newest complete
    checkpoint, and the script's own SIGTERM handler runs after (the handlers chain, and are restored
    once the save is waited for). The writer, released later, publishes nothing."""
    released, entered = threading.Event(), threading.Event()
    real_save = checkpoint_writing.save_object

    def stuck(obj, path):  # the background write blocks until the test releases it
        entered.set()
        released.wait(60)
        real_save(obj, path)

    notes = tmp_path / "notes"
    notes.mkdir()
    monkeypatch.setenv(env_vars.CHECKPOINT_GRACE, "0.3")
    monkeypatch.setenv(env_vars.INTERRUPTED_SAVE_NOTES, str(notes))
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    older = accelerator.save_state(tmp_path / "checkpoints" / "checkpoint_1")  # synchronous: complete
    monkeypatch.setattr(checkpoint_writing, "save_object", stuck)
    scripts_own = []

    def own_handler(number, frame):
        scripts_own.append(number)

    previous = signal.signal(signal.SIGTERM, own_handler)
    try:
        lost = accelerator.save_state(tmp_path / "checkpoints" / "checkpoint_2", async_save=True)
        assert entered.wait(30)
        signal.raise_signal(signal.SIGTERM)
        assert scripts_own == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is own_handler  # back in place
        assert sorted(os.listdir(lost.parent)) == ["checkpoint_1"]  # no .tmp, no .abandoned
        said = (notes / "0.outcome").read_text()
        assert said == (
            f"the checkpoint being saved in the background, {lost}, was abandoned after "
            "UNISON_CHECKPOINT_GRACE=0.3 s and its temporary folder removed; the newest complete checkpoint "
            f"is {older} (export UNISON_CHECKPOINT_GRACE=SECONDS to let a save finish)."
        )
        assert stopped_line("SIGTERM", str(notes)) == f"unison launch: stopped by SIGTERM; {said}"
        released.set()
        with pytest.raises((RuntimeError, OSError), match=r"\.checkpoint_2\.tmp"):  # its folder is gone
            accelerator.wait_for_checkpoint()
        assert sorted(os.listdir(lost.parent)) == ["checkpoint_1"]
    finally:
        released.set()
        signal.signal(signal.SIGTERM, previous)


def test_the_launchers_line_prefers_an_outcome_to_what_a_killed_worker_left(tmp_path):
    """The lowest rank's outcome wins; a worker SIGKILLed while it waited leaves only its "waiting" note,
    said when no worker reported an outcome; without notes no save was in flight."""
    nothing = "unison launch: stopped by SIGINT; the workers were terminated."
    assert stopped_line("SIGINT", str(tmp_path)) == nothing
    (tmp_path / "0.waiting").write_text("lost.")
    assert stopped_line("SIGINT", str(tmp_path)) == "unison launch: stopped by SIGINT; lost."
    (tmp_path / "10.outcome").write_text("ten.")
    (tmp_path / "2.outcome").write_text("two.")
    assert stopped_line("SIGINT", str(tmp_path)) == "unison launch: stopped by SIGINT; two."


def test_the_agent_waits_the_grace_and_a_margin_before_it_sigkills(monkeypatch):
    """`unison launch` exports TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torch's SIGTERM-to-SIGKILL wait) as the grace
    plus 10 s, unless the user set it; a grace that is no number of seconds is refused."""
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv(env_vars.CHECKPOINT_GRACE, raising=False)
    assert worker_environment(2)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "30"  # 20 s of grace + 10
    monkeypatch.setenv(env_vars.CHECKPOINT_GRACE, "300")
    assert worker_environment(2)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "310"
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")  # the user's own stays
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in worker_environment(2)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    monkeypatch.setenv(env_vars.CHECKPOINT_GRACE, "-1")  # refused before any process starts
    with pytest.raises(LaunchError, match=r"UNISON_CHECKPOINT_GRACE='-1': give the seconds \(0 or more\)"):
        worker_environment(2)
