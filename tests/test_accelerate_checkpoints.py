"""A run started under Hugging Face Accelerate continues under unison: `load_state(<the folder Accelerate's
save_state wrote>)` reads it (src/unison/checkpoint/accelerate_folders.py; issue 41).

The script is tests/workers/accelerate_checkpoint_worker.py. Real Accelerate 1.15 (the `test` extra) runs
it under torch.distributed.run on 1 and 2 processes, for three layouts: plain (DDP on 2 processes), FSDP2
with SHARDED_STATE_DICT (DCP folders) and FSDP2 with FULL_STATE_DICT (Accelerate's default): it trains
into the second epoch, saves, and resumes that folder itself, as a restarted script would. That resumed
run is the reference. unison (numerics="accelerate") resumes the same folders: on 1 process in this
process, on 2 under unison launch. Accelerate 1.15 drops an fsdp_plugin on CPU processes; the worker sets
its state to FSDP as Accelerate sets it on GPUs, and Accelerate's own FSDP2 code then runs on gloo.

Measured (2-core CPU VM, torch 2.13.0, accelerate 1.15.0, 2026-11-29): every micro-step's loss, the
learning rate and the registered object equal Accelerate's resumed run exactly in every case; the final
parameters too, except under ZeRO-3 on 2 processes (Accelerate's FSDP folders, and its DDP folder resumed
under ZeRO-3), 3.0e-8 apart: the sharded gradient reduction rounds apart in the last bit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from contextlib import contextmanager

import pytest
import torch
from accelerate_checkpoint_worker import LAYOUTS, Lines, build, resumed
from launching import WORKERS, describe, launch_ok, run
from safetensors.torch import load_file
from torch import nn

from unison import AcceleratorState, GradientState, PartialState
from unison.checkpoint import CheckpointError
from unison.checkpoint.accelerate_folders import _own_names

WORKER = WORKERS / "accelerate_checkpoint_worker.py"
FSDP_TWO_PROCESSES = 1e-6  # measured 3.0e-8: ZeRO-3's sharded gradient reduction, its rounding
EXACT = 0.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{processes: folder}: Accelerate's checkpoints and its own resumed runs, and unison's on 2 processes."""
    out = {}
    for processes in (1, 2):
        folder = tmp_path_factory.mktemp(f"accelerate_{processes}")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(processes), WORKER, "accelerate", folder]
        result = run(command, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, describe(result)
        out[processes] = folder
    launch_ok(WORKER, 2, "unison", out[2], timeout=120)
    return out


@contextmanager
def restarted():
    """A script's run in this process, as if restarted (the shared states as a new process has them),
    yielding the lines unison logged during it."""
    for state in (PartialState, AcceleratorState, GradientState):
        state._reset_state()
    lines = Lines()
    logging.getLogger("unison").addHandler(lines)
    try:
        yield lines.lines
    finally:
        logging.getLogger("unison").removeHandler(lines)


def _distance(accelerate: dict, unison: dict) -> float:
    """The largest difference of two resumed runs: every micro-step's loss and (where the process has
    them: get_state_dict gives them to the main process) the final parameters. The learning rate, the
    registered counter and Accelerator.step must be equal."""
    assert len(unison["losses"]) == len(accelerate["losses"]) > 0
    assert (unison["lr"], unison["count"], unison["step"]) == (
        accelerate["lr"],
        accelerate["count"],
        accelerate["step"],
    )
    assert unison["loaded"]["optimizer_steps"] == accelerate["loaded"]["count"] > 0  # from AdamW's step
    differences = [abs(a - u) for a, u in zip(accelerate["losses"], unison["losses"])]
    differences += [
        (torch.tensor(accelerate["params"][key]) - torch.tensor(value)).abs().max().item()
        for key, value in unison["params"].items()
    ]
    return max(differences)


def _line(lines: list[str]) -> str:
    said = [line for line in lines if line.startswith("read an Accelerate checkpoint")]
    assert len(said) == 1, lines
    return said[0]


def test_one_process(folders, fresh_state):
    """unison resumes each of Accelerate's one-process folders, in this process, as Accelerate did."""
    for layout in LAYOUTS:
        with restarted() as lines:
            unison = resumed("unison", layout, folders[1] / layout / "checkpoint")
        accelerate = json.loads((folders[1] / layout / "accelerate_rank0.json").read_text())
        assert _distance(accelerate, unison) == EXACT, layout
        assert "1 model, 1 optimizer, 1 scheduler, 1 registered object" in _line(lines)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes(folders, layout):
    """Under unison launch on 2 processes (DDP, or ZeRO-3 for FSDP), each process as Accelerate's did."""
    tolerance = FSDP_TWO_PROCESSES if layout.startswith("fsdp") else EXACT
    for rank in (0, 1):
        accelerate = json.loads((folders[2] / layout / f"accelerate_rank{rank}.json").read_text())
        unison = json.loads((folders[2] / layout / f"unison_rank{rank}.json").read_text())
        assert _distance(accelerate, unison) <= tolerance, (layout, rank)
    line = _line(json.loads((folders[2] / layout / "unison_rank0.json").read_text())["lines"])
    assert ("FSDP sharded" in line) == (layout == "fsdp"), line


def test_two_processes_plain_folder_into_zero3(folders):
    """Accelerate's DDP folder (model.safetensors, optimizer.bin by parameter position) resumed under
    ZeRO-3: each process takes its shards of the whole tensors, and the run goes on as Accelerate's."""
    for rank in (0, 1):
        accelerate = json.loads((folders[2] / "plain" / f"accelerate_rank{rank}.json").read_text())
        unison = json.loads((folders[2] / "plain" / f"unison_zero3_rank{rank}.json").read_text())
        assert _distance(accelerate, unison) <= FSDP_TWO_PROCESSES, rank


def test_refused_before_anything_changes(folders, tmp_path, fresh_state):
    """What cannot be continued is refused on load, naming why, the live objects untouched; a folder of
    another number of processes loads, and the line says whose random states were taken."""
    source = folders[1] / "plain" / "checkpoint"
    cases = {
        "latest": "DeepSpeed checkpoint",
        "dl_state_dict.bin": "StatefulDataLoader",
        "pytorch_model_fsdp_0_rank0.bin": "per-rank files",
    }
    for extra, reason in cases.items():
        folder = tmp_path / extra
        shutil.copytree(source, folder)
        (folder / extra).write_bytes(b"")
        with restarted():
            accelerator, model, *_ = build("unison", "plain")
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(CheckpointError, match=reason):
                accelerator.load_state(folder)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with restarted():
        accelerator, *_ = build("unison", "plain")
        accelerator._schedulers.clear()  # a script that prepared no scheduler
        with pytest.raises(CheckpointError, match="1 scheduler and this run prepared 0"):
            accelerator.load_state(source)
    with restarted() as lines:
        accelerator, model, *_ = build("unison", "plain")
        accelerator.load_state(folders[2] / "plain" / "checkpoint")
    saved = load_file(folders[2] / "plain" / "checkpoint" / "model.safetensors")
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in saved.items())
    assert "random states saved by 2 processes, resumed by 1" in _line(lines)


def test_names_as_accelerate_saved_them():
    """A state dict saved from DDP's or torch.compile's wrapper (`module.` or `_orig_mod.` before every
    name) and through safetensors (one name of a tied weight: Accelerate's save drops the others) is read
    under every name of the model's own."""
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    for prefix in ("module.", "_orig_mod."):
        state = _own_names({f"{prefix}0.weight": torch.ones(4, 3)}, model)
        assert set(state) == {"0.weight", "1.weight"} and state["1.weight"] is state["0.weight"]
