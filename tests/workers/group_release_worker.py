"""Launched by tests/test_state.py: destroy_process_group ends the gloo group for real (its worker
threads stop while the interpreter is whole), even after a DDP step, a gather_object, a ZeRO-3 (FSDP2)
step with its state gathered and saved, and a barrier.

torch.distributed.nn.functional takes `group=group.WORLD` as default arguments, evaluated when it is
first imported: imported after the group formed (DDP, the profiler, torch.compile and torch's checkpoint
code import it lazily), it keeps the group alive after destroy_process_group, and gloo's threads then
outlive the script. One of them may release a finished collective's tensors after the interpreter began
its teardown, and the process aborts ("terminate called without an active exception"; docs/failures.md).
A ZeRO-3 model holds the group the same way through DTensor's caches of the DeviceMeshes it propagated
ops on (FSDP2's fully_shard runs such ops), and through ZeroRedundancyOptimizer's module if imported.

Usage: group_release_worker.py OUT_DIR. Each rank writes OUT_DIR/rank{R}.json: "before" and "after", the
number of gloo worker threads ("pt_gloo_runloop", as torch names them) before destroy_process_group and
at exit, after unison's exit handler (this one is registered first, so it runs last).
"""

import atexit
import json
import os
import sys
from pathlib import Path

import torch

import unison
from unison import Accelerator
from unison.utils import gather_object


def gloo_threads() -> int:
    tasks = Path("/proc/self/task")
    return sum((tasks / task / "comm").read_text().strip() == "pt_gloo_runloop" for task in os.listdir(tasks))


def main() -> int:
    """Inside a function, so that nothing of the script holds the group once it returns."""
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    accelerator.backward(model(torch.randn(4, 3)).sum())
    gather_object([accelerator.process_index])
    sharded = Accelerator(cpu=True, parallelism="zero3")
    zero3 = sharded.prepare(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)))
    sharded.backward(zero3(torch.randn(4, 3)).sum())
    sharded.get_state_dict(zero3)  # gathers the shards: DTensor's redistribution caches see the mesh
    sharded.save_state(Path(sys.argv[1]) / "zero3")  # the checkpoint code must not import ZeRO-1's module
    accelerator.wait_for_everyone()
    before = gloo_threads()
    state = accelerator.state  # as Accelerate's test scripts end: the shared state reset, then the group
    unison.AcceleratorState._reset_state()
    state.destroy_process_group()
    return before


def write_record() -> None:
    record = {"before": threads_before, "after": gloo_threads()}
    (Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    atexit.register(write_record)
    threads_before = main()
