"""Launched by tests/test_launch.py. Usage: launch_worker.py MODE [OUT_DIR].

report:  form the group, all_reduce, and write what this rank saw (env, state) to OUT_DIR/rank{R}.json.
crash:   rank 1 raises after a broadcast while rank 0 waits in the next collective and rank 2 in none;
         rank 1's atexit handler (a tracker's flush, say) writes OUT_DIR/flushed-rank1.
sleep:   say ready, then sleep until interrupted (Ctrl-C on the launcher).
restart: rank 1 raises on the first attempt (after the group formed); the second attempt succeeds.
"""

import atexit
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from unison import AcceleratorState, PartialState

mode = sys.argv[1]
state = PartialState()
rank = state.process_index
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)

if mode == "report":
    print(f"stdout line from rank {rank}")
    print(f"stderr line from rank {rank}", file=sys.stderr)
    seen = {
        name: os.environ.get(name)
        for name in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "OMP_NUM_THREADS",
            "UNISON_CPU",
            "UNISON_MIXED_PRECISION",
            "UNISON_GRADIENT_ACCUMULATION_STEPS",
            "UNISON_TIMEOUT",
        )
    }
    seen["sum"] = total.item()
    seen["mixed_precision"] = AcceleratorState().mixed_precision
    seen["timeout_s"] = state.timeout.total_seconds()
    seen["device"] = str(state.device)
    seen["argv"] = sys.argv[1:]
    (Path(sys.argv[2]) / f"rank{rank}.json").write_text(json.dumps(seen))
elif mode == "crash":
    peers = dist.new_group([0, 1])  # collective: every rank creates it
    if rank >= 2:
        time.sleep(60)  # in no collective: torch's agent ends it with SIGTERM once rank 1 has failed
    else:
        dist.broadcast(torch.zeros(1), src=0, group=peers)  # ranks 0 and 1 agree once more...
        if rank == 1:
            atexit.register(lambda: (Path(sys.argv[2]) / "flushed-rank1").write_text("flushed"))
            time.sleep(0.5)  # let rank 0 block in the next collective first
            print(f"failing at {time.time()}", flush=True)
            raise RuntimeError("deliberate failure on rank 1")
        dist.all_reduce(torch.zeros(1), group=peers)  # ...then go different ways
        print(f"rank {rank} passed the all_reduce, which must not happen")
elif mode == "sleep":
    print(f"rank {rank} ready", flush=True)
    time.sleep(60)  # until the test interrupts the launcher
elif mode == "restart":
    if attempt == 0 and rank == 1:
        raise RuntimeError("deliberate failure on the first attempt")
    print(f"attempt {attempt} rank {rank} sum {total.item():g}")
else:
    raise SystemExit(f"unknown mode {mode!r}")
