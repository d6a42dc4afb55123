"""Launched by tests/test_checkpoint_storage.py with 2 processes (and a short group timeout): a save or
load step that fails on one process must fail on every process, so that a script catching the error
goes on with matched collectives instead of hanging; a damaged file that process 1 alone verifies is
refused on both.

Usage: checkpoint_failure_worker.py BASE_DIR. Each rank records in BASE_DIR/rank{R}.json, per phase,
the error it got and the all_reduce the script then runs (every rank's 1 + rank summed: 3).
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from unison import Accelerator
from unison.checkpoint import training_state

base = Path(sys.argv[1])


class FailsOnRank0:
    """A registered object whose state cannot be taken on process 0 (which writes replicated parts)."""

    def state_dict(self) -> dict:
        if dist.get_rank() == 0:
            raise OSError("No space left on device (simulated)")
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def error_of(action) -> str:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


def then_all_reduce() -> float:
    """What the script does after catching the error: a collective every rank must meet."""
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return total.item()


accelerator = Accelerator(cpu=True, project_dir=base / "shared")
rank = accelerator.process_index
model = accelerator.prepare(nn.Linear(4, 2))
record: dict = {}

failing = FailsOnRank0()
accelerator.register_for_checkpointing(failing)
record["save_state"] = error_of(lambda: accelerator.save_state(base / "broken"))
record["save_state_then"] = then_all_reduce()
record["broken_renamed"] = (base / "broken").exists()
accelerator._custom_objects.remove(failing)

(base / "not_a_directory").write_text("a file where save_model wants a directory")
record["save_model"] = error_of(lambda: accelerator.save_model(model, base / "not_a_directory"))
record["save_model_then"] = then_all_reduce()

saved = accelerator.save_state()  # project_dir/checkpoints/checkpoint_0, complete
if rank == 1:  # this process's read fails (an out-of-memory map_location onto one GPU, say)
    real_load_object = training_state.load_object

    def load_object(path, **kwargs):
        if path.name.startswith("model_"):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_load_object(path, **kwargs)

    training_state.load_object = load_object
record["load_state"] = error_of(lambda: accelerator.load_state(saved))
record["load_state_then"] = then_all_reduce()
if rank == 1:
    training_state.load_object = real_load_object

# A damaged file that only process 1 verifies (its RNG states): refused on every process, nothing applied.
if rank == 0:
    shutil.copytree(saved, base / "damaged")
    with open(base / "damaged" / "rng_state_1.pt", "r+b") as file:
        file.seek(100)
        byte = file.read(1)[0]
        file.seek(100)
        file.write(bytes([byte ^ 0xFF]))
dist.barrier()
weight = accelerator.unwrap_model(model).weight
with torch.no_grad():
    weight.fill_(7.0)
record["damaged_rank1_file"] = error_of(lambda: accelerator.load_state(base / "damaged"))
record["damaged_untouched"] = bool((weight == 7.0).all())

# A node whose view of the checkpoints lags (here: another, empty directory) follows process 0's.
view = Accelerator(cpu=True, project_dir=base / ("shared" if rank == 0 else f"lagging{rank}"))
view.prepare(nn.Linear(4, 2))
record["lagging_view_loaded"] = str(view.load_state(missing_ok=True))
record["lagging_view_then"] = then_all_reduce()
(base / f"rank{rank}.json").write_text(json.dumps(record))
