"""Launched by tests/test_state.py: the script forms the process group itself, then uses unison.

Usage: adopt_group_worker.py OUT_DIR. Each rank records in OUT_DIR/rank{R}.json what asking for a
timeout unison cannot apply raised, and what the adopted state then reports.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from unison import PartialState

out_dir = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=77))


def error_of(action) -> str:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


record = {"explicit_timeout": error_of(lambda: PartialState(timeout=30))}
state = PartialState()  # adopts the group as it is
record["state_timeout"] = state.timeout
record["later_timeout"] = error_of(lambda: PartialState(timeout=77))
total = torch.tensor([state.process_index + 1.0])
dist.all_reduce(total)
record["all_reduce"] = total.item()
(out_dir / f"rank{state.process_index}.json").write_text(json.dumps(record))
dist.destroy_process_group()
