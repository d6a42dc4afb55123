"""Run by tests/test_launch.py with plain python, as a notebook would: functions live in __main__.

Prints one JSON line with what notebook_launcher returned and how its failures looked.
"""

import json
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from unison import AcceleratorState, PartialState
from unison.launching.notebook import notebook_launcher


def train(scale):
    state = AcceleratorState()
    total = torch.tensor([state.process_index + 1.0]) * scale
    dist.all_reduce(total)
    print(f"worker {state.process_index} of {state.num_processes}")
    return {
        "rank": state.process_index,
        "world": dist.get_world_size(),
        "sum": total.item(),
        "mixed_precision": state.mixed_precision,
        "distributed_type": state.distributed_type.value,
        "device": str(state.device),
    }


def fail_on_rank_1():
    state = PartialState(timeout=60)
    if state.process_index == 1:
        raise ValueError("notebook failure on rank 1")
    dist.barrier()


def fail_on_rank_0(sleep_seconds):
    """Accelerate's test_notebook.py monitoring case: rank 0 raises, rank 1 sleeps (no collective), so
    rank 1 only ends because rank 0 did, and must not be blamed."""
    state = PartialState()
    if state.process_index == 0:
        raise RuntimeError("I'm an even process. I don't like to sleep.")
    time.sleep(sleep_seconds)


report = {"results": notebook_launcher(train, (10,), num_processes=2, mixed_precision="bf16", cpu=True)}
# Accelerate's rendezvous and monitoring arguments: a c10d rendezvous, a 10 ms watch
report["c10d"] = notebook_launcher(
    train, (1,), num_processes=2, cpu=True, rdzv_backend="c10d", monitor_interval=0.01
)
start = time.monotonic()
try:
    notebook_launcher(fail_on_rank_1, num_processes=2, cpu=True)
except RuntimeError as error:
    report["failure"] = str(error)
report["failure_seconds"] = time.monotonic() - start
start = time.monotonic()
try:
    notebook_launcher(fail_on_rank_0, (100,), num_processes=2, cpu=True, monitor_interval=0.01)
except ChildFailedError as error:  # torch's type, as Accelerate raises it
    report["rank_0_failure"] = str(error)
    report["rank_0_failure_types"] = [cls.__name__ for cls in type(error).__mro__]
report["rank_0_failure_seconds"] = time.monotonic() - start
PartialState(cpu=True)  # a state in the launching process must be refused
try:
    notebook_launcher(train, (1,), num_processes=2, cpu=True)
except RuntimeError as error:
    report["existing_state"] = str(error)
print("REPORT " + json.dumps(report))
