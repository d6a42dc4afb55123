"""`unison launch --max-restarts`: a worker SIGKILLed mid-run, the group re-formed, the run resumed.

Issue 13 asks that a restarted job lose nothing: torch's elastic agent restarts every worker after one
dies, the new attempt forms a new process group (which torch makes fragile on gloo: pytorch#135712,
#167288) and the script resumes from its newest complete checkpoint with `load_state(missing_ok=True)`.
The end must be bit-identical to a run that was never interrupted, also when the kill lands inside a save.
"""

from __future__ import annotations

import json

import torch
from launching import WORKERS, describe, launch_ok

WORKER = WORKERS / "restart_worker.py"


def test_killed_workers_are_restarted_and_resume_bit_identical(tmp_path):
    """One launch, three kills (one per attempt), each resumed from the checkpoint before it.

    Attempt 0: rank 1 dies between saves (step 3), so attempt 1 resumes from checkpoint_2. Attempt 1:
    rank 1 dies as the save of step 6 starts, rank 0 waiting in its collective; attempt 2 must resume
    from checkpoint_4, the half-made checkpoint_6 being no checkpoint. Attempt 2: rank 0 dies half-way
    through writing checkpoint_10; attempt 3 resumes from checkpoint_8 (mid-epoch) and finishes.
    """
    launch_ok(WORKER, 2, tmp_path / "reference", tmp_path / "reference.pt", timeout=120)

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

    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    resumed = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert reference.keys() == resumed.keys()
    different = [name for name in reference if not torch.equal(reference[name], resumed[name])]
    assert not different, f"parameters differ from the uninterrupted run: {different}"
