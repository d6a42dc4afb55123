"""Launched by tests/test_checkpoint_storage.py with 2 processes: write checkpoints together, then hang.

Usage: checkpoint_storage_worker.py CHECKPOINTS_DIR OUT_DIR

1. Every rank writes its own file (rank 0 also a "model" file) into checkpoint_1; rank 1 writes late,
   so a manifest written before everyone finished would miss its file. Each rank passes different
   metadata, so the manifest shows which process wrote it. Right after the block, each rank records
   what it sees (the final barrier means checkpoint_1 must already be complete) in OUT_DIR/rank{R}.json.
2. Every rank starts checkpoint_2, writes part of its files, announces OUT_DIR/ready{R}.json (pid and
   the launcher's pid) and sleeps inside the block until the test kills the whole launch with SIGKILL.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from unison import PartialState
from unison.checkpoint import list_checkpoints, save_object, verify_checkpoint, write_checkpoint

checkpoints_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
state = PartialState()
rank = state.process_index

# 1. a complete save by two processes
with write_checkpoint(checkpoints_dir / "checkpoint_1", metadata={"step": 1, "writer_rank": rank}) as staging:
    if rank == 1:
        time.sleep(1.0)
    save_object({"rank": rank, "values": torch.arange(1000) * (rank + 1)}, staging / f"rng_state_{rank}.pt")
    if rank == 0:
        save_object({"weight": torch.linspace(0, 1, 4096)}, staging / "model.pt")

manifest = verify_checkpoint(checkpoints_dir / "checkpoint_1")
record = {
    "manifest_files": sorted(manifest["files"]),
    "metadata": manifest["metadata"],
    "listed": [path.name for path in list_checkpoints(checkpoints_dir)],
    # (rank 0 may already have created checkpoint_2's staging directory: leave that out)
    "entries": sorted(path.name for path in checkpoints_dir.iterdir() if "checkpoint_1" in path.name),
}
(out_dir / f"rank{rank}.json").write_text(json.dumps(record))

# 2. a save that is killed while the processes are still writing
with write_checkpoint(checkpoints_dir / "checkpoint_2", metadata={"step": 2}) as staging:
    save_object({"rank": rank, "values": torch.zeros(1000)}, staging / f"rng_state_{rank}.pt")
    (out_dir / f"ready{rank}.json").write_text(json.dumps({"pid": os.getpid(), "launcher_pid": os.getppid()}))
    time.sleep(600)
    save_object({"never": True}, staging / f"late_{rank}.pt")
