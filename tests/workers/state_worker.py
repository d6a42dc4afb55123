"""Launched by tests/test_state.py: exercise PartialState / AcceleratorState in a real gloo group.

Usage: state_worker.py OUT_DIR [--explicit-timeout S]. Each rank records what it observed in
OUT_DIR/rank{R}.json; the test compares that with references it computes itself.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from unison import AcceleratorState, PartialState

out_dir = Path(sys.argv[1])
explicit_timeout = (
    float(sys.argv[sys.argv.index("--explicit-timeout") + 1]) if "--explicit-timeout" in sys.argv else None
)

state = PartialState(timeout=explicit_timeout) if explicit_timeout else PartialState()
rank, world = state.process_index, state.num_processes
record: dict = {
    "env_rank": int(os.environ["RANK"]),
    "env_local_rank": int(os.environ["LOCAL_RANK"]),
    "env_world_size": int(os.environ["WORLD_SIZE"]),
    "num_processes": world,
    "process_index": rank,
    "local_process_index": state.local_process_index,
    "is_main_process": state.is_main_process,
    "is_local_main_process": state.is_local_main_process,
    "device": str(state.device),
    "distributed_type": state.distributed_type.value,
    "dist_initialized": dist.is_initialized(),
    "dist_world_size": dist.get_world_size(),
    "dist_rank": dist.get_rank(),
    "backend": dist.get_backend(),
    "state_timeout_s": state.timeout.total_seconds(),
    "group_timeout_s": dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
}

total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
record["all_reduce_rank_plus_one"] = total.item()


def timed_block(context, sleep_main: float) -> dict:
    """Enter `context`; the first group sleeps so a missing wait would show as overlapping intervals."""
    with context:
        start = time.time()
        if rank == 0:
            time.sleep(sleep_main)
        end = time.time()
    return {"start": start, "end": end}


# wait_for_everyone: rank 0 arrives late; nobody may leave the barrier before it arrived.
if rank == 0:
    time.sleep(0.5)
arrived = time.time()
state.wait_for_everyone()
record["barrier"] = {"arrived": arrived, "left": time.time()}

record["main_process_first"] = timed_block(state.main_process_first(), 0.5)
record["local_main_process_first"] = timed_block(state.local_main_process_first(), 0.5)

# split_between_processes over each container type, with and without padding.
splits = {}
for n_items in (7, 2):
    items = list(range(10, 10 + n_items))
    for padding in (False, True):
        key = f"{n_items}_{'pad' if padding else 'nopad'}"
        with state.split_between_processes(items, apply_padding=padding) as share:
            splits[f"list_{key}"] = share
        with state.split_between_processes(tuple(items), apply_padding=padding) as share:
            splits[f"tuple_{key}"] = {"type": type(share).__name__, "items": list(share)}
        tensor = torch.tensor(items).repeat_interleave(2).view(-1, 2)  # rows [i, i]
        with state.split_between_processes(tensor, apply_padding=padding) as share:
            splits[f"tensor_{key}"] = {"type": type(share).__name__, "rows": share.tolist()}
        with state.split_between_processes({"a": items, "b": tensor}, apply_padding=padding) as share:
            splits[f"dict_{key}"] = {"a": share["a"], "b": share["b"].tolist()}
record["splits"] = splits

calls = []


@state.on_main_process
def only_main(value):
    calls.append(value)
    return value * 2


record["on_main_process"] = {"returned": only_main(21), "calls": calls}
state.print(f"PRINTED-BY-STATE from rank {rank}")

# A second state that disagrees with the first must fail on every rank, with a message naming it.
errors = {}
for name, make in {
    "cpu": lambda: PartialState(cpu=False),
    "timeout": lambda: PartialState(timeout=state.timeout.total_seconds() + 1),
    "mixed_precision": lambda: AcceleratorState(mixed_precision="fp16"),
}.items():
    if name == "mixed_precision":
        AcceleratorState(mixed_precision="bf16")
    try:
        make()
        errors[name] = None
    except ValueError as error:
        errors[name] = str(error)
record["conflict_errors"] = errors
record["same_settings_ok"] = PartialState(cpu=True).process_index == rank  # agreeing again is fine

(out_dir / f"rank{rank}.json").write_text(json.dumps(record))
state.wait_for_everyone()
