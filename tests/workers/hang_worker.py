"""Launched by tests/test_hangs.py. Usage: hang_worker.py MODE.

stuck-loader: rank 1's data loading never returns (its DataLoader worker sleeps) while rank 0 waits in
              accelerator.reduce: the stall timeout reports where each rank is.
diverge:      rank 1 catches an exception and skips accelerator.reduce, going on to accelerator.gather,
              while rank 0 is in the reduce: reported as a divergence within seconds, whatever the timeout.
barrier:      rank 1 never reaches wait_for_everyone("after-eval"): the stall report names the barrier
              and the rank that never arrived.
mismatch:     rank 0 all-reduces 1 element, rank 1 two (run with --debug: refused on every rank at once).
ddp-backward: a DDP model, accumulation 2 (launch with --gradient-accumulation-steps 2); after the first
              optimizer step rank 1 stops before its synchronised backward while rank 0 waits in the
              all-reduce DDP issues from C++ inside backward: the stall timeout reports it.
"""

import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from unison import Accelerator

mode = sys.argv[1]
accelerator = Accelerator()
rank = accelerator.process_index


class SlowOnRankOne(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        if rank == 1 and index >= 8:
            time.sleep(3600)  # a stuck read (a dead network file system, a lock)
        return torch.tensor([float(index)])


def step_metric(value):
    return accelerator.reduce(torch.tensor([value]))


if mode == "stuck-loader":
    loader = DataLoader(SlowOnRankOne(), batch_size=4, num_workers=1)
    for batch in loader:
        step_metric(batch.sum().item())
elif mode == "diverge":
    for step in range(3):
        try:
            if rank == 1 and step == 1:
                print(f"skipping at {time.time()}", flush=True)
                raise ValueError("a bad batch")
            step_metric(float(step))
        except ValueError:
            pass  # "skip the bad batch": rank 1 goes on without the reduce its peers are in
        accelerator.gather(torch.ones(2, 3))
elif mode == "barrier":
    if rank == 1:
        time.sleep(3600)  # e.g. an evaluation that never ends on this rank
    accelerator.wait_for_everyone("after-eval")
elif mode == "mismatch":
    dist.all_reduce(torch.ones(rank + 1))
elif mode == "ddp-backward":
    model, optimizer = accelerator.prepare(torch.nn.Linear(4, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    for step in range(4):  # micro-steps; 1 ends the first optimizer step, 3 is synchronised again
        with accelerator.accumulate(model):
            if rank == 1 and step == 3:
                time.sleep(3600)  # a rank that stops before its backward (a lost node, a stuck read)
            accelerator.backward(model(torch.ones(2, 4)).sum())  # DDP all-reduces the gradients in here
            optimizer.step()
            optimizer.zero_grad()
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"rank {rank} finished {mode}, which must not happen")
