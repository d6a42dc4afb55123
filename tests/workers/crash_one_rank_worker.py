"""Started once per rank by a real launcher (srun, mpirun, mpiexec) in tests/test_real_launchers.py: trains
a small model through `Accelerator.prepare`, and the rank named by argv[1] raises at its third step while
the others go on into that step's gradient all-reduce. unison must end them all within seconds."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from unison import Accelerator


def main() -> None:
    crashing_rank = int(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    print(f"rank {accelerator.process_index} of {accelerator.num_processes} started", flush=True)
    for step in range(1000):
        if step == 2 and accelerator.process_index == crashing_rank:
            raise RuntimeError(f"planned crash of rank {crashing_rank} at step {step}")
        loss = model(torch.randn(4, 16)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.05)
    print(f"rank {accelerator.process_index} trained 1000 steps: the crash did not end it", flush=True)


if __name__ == "__main__":
    main()
