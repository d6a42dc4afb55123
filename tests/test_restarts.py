"""`unison launch --max-restarts`: a worker SIGKILLed mid-run, the group re-formed, the run resumed.

Issue 13 asks that a restarted job lose nothing: torch's elastic agent restarts every worker after one
dies, the new attempt forms a new process group (which torch makes fragile on gloo: pytorch#135712,
#167288) and the script resumes from its newest complete checkpoint with `load_state(missing_ok=True)`.
The end must be bit-identical to a run that was never interrupted, also when the kill lands inside a save.
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import WORKERS, describe, launch_ok

WORKER = WORKERS / "restart_worker.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final parameters of the run never interrupted (synchronous saves)."""
    out = tmp_path_factory.mktemp("reference")
    launch_ok(WORKER, 2, out / "project", out / "reference.pt", timeout=120)
    return torch.load(out / "reference.pt", weights_only=True)


def assert_bit_identical(reference: dict[str, torch.Tensor], path) -> None:
    resumed = torch.load(path, weights_only=True)
    assert reference.keys() == resumed.keys()
    different = [name for name in reference if not torch.equal(reference[name], resumed[name])]
    assert not different, f"parameters differ from the uninterrupted run: {different}"


def test_killed_workers_are_restarted_and_resume_bit_identical(tmp_path, reference):
    """One launch, three kills (one per attempt), each resumed from the checkpoint before it.

    Attempt 0: rank 1 dies between saves (step 3), so attempt 1 resumes from checkpoint_2. Attempt 1:
    rank 1 dies as the save of step 6 starts, rank 0 waiting in its collective; attempt 2 must resume
    from checkpoint_4, the half-made checkpoint_6 being no checkpoint. Attempt 2: rank 0 dies half-way
    through writing checkpoint_10; attempt 3 resumes from checkpoint_8 (mid-epoch) and finishes.
    """
    project = tmp_path / "killed"
    kills = ["1:step:3", "1:save-start:6", "0:save-middle:10"]
    result = launch_ok(
        WORKER,
        2,
        project,
        tmp_path / "killed.pt",
        *(arg for kill in kills for arg in ("--kill", kill)),
        launch_args=["--max-restarts", str(len(kills))],
        timeout=120,
    )
    resumes = [json.loads(line) for line in (project / "resumes.jsonl").read_text().splitlines()]
    assert resumes == [
        {"attempt": 0, "resumed_from": None},
        {"attempt": 1, "resumed_from": "checkpoint_2"},
        {"attempt": 2, "resumed_from": "checkpoint_4"},
        {"attempt": 3, "resumed_from": "checkpoint_8"},
    ], describe(result)
    # total_limit=2, and the saves the kills interrupted left nothing behind once redone
    assert sorted(path.name for path in (project / "checkpoints").iterdir()) == [
        "checkpoint_10",
        "checkpoint_12",
    ]

    assert_bit_identical(reference, tmp_path / "killed.pt")


def test_workers_killed_during_an_asynchronous_write_resume_bit_identical(tmp_path, reference):
    """save_state(async_save=True) with 128 MB of ballast per checkpoint (writes of a few hundred ms), and a
    process SIGKILLed 0-100 ms after save_state returned, in four attempts: each kill lands while a
    background write is in flight (the worker records which); the restart resumes from the checkpoint
    before it, the half-written one being no checkpoint, and the end is the uninterrupted run's."""
    project = tmp_path / "killed"
    kills = ["0:write:4", "1:write:6", "0:write:8", "1:write:10"]
    result = launch_ok(
        WORKER,
        2,
        project,
        tmp_path / "killed.pt",
        "--async-save",
        *("--ballast-mb", "128"),
        *(arg for kill in kills for arg in ("--kill", kill)),
        launch_args=["--max-restarts", str(len(kills))],
        timeout=180,
    )
    lines = [line for path in project.glob("kills-rank*.jsonl") for line in path.read_text().splitlines()]
    killed = sorted((json.loads(line) for line in lines), key=lambda record: record["attempt"])
    assert [record["attempt"] for record in killed] == [0, 1, 2, 3], describe(result)
    in_flight = [record["in_flight"] for record in killed]
    assert all(in_flight), f"a kill landed after the write had finished: {killed}"
    resumes = [json.loads(line) for line in (project / "resumes.jsonl").read_text().splitlines()]
    # each attempt resumes from the complete checkpoint before the one its predecessor's kill cut short
    expected = [None] + [f"checkpoint_{int(name.split('_')[1]) - 2}" for name in in_flight]
    assert [resume["resumed_from"] for resume in resumes] == expected, (killed, resumes)
    names = sorted(path.name for path in (project / "checkpoints").iterdir())  # no temporary left over
    assert names == ["checkpoint_10", "checkpoint_12"], names
    assert_bit_identical(reference, tmp_path / "killed.pt")
