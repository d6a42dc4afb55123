"""Launched worker: Ctrl-C while an asynchronous save is in flight (tests/test_interrupt_async_save.py).

`PROJECT BALLAST_MB`: train a few steps, save_state(async_save=True) with BALLAST_MB of registered
ballast (a write that lasts long enough to be interrupted), write the model's parameters at that step
to PROJECT/saved.pt, print "saved <checkpoint>" and keep training until the test's SIGINT ends the run.
The test then loads the checkpoint into `prepared(PROJECT, 0)` and compares with saved.pt.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

from unison import Accelerator, ProjectConfiguration

TRAIN_SECONDS = 120  # far longer than the test waits: the run ends by its SIGINT, not by itself


class Ballast:
    """Constant bytes in the checkpoint, so that writing it takes long enough to be interrupted."""

    def __init__(self, megabytes: int) -> None:
        self.data = torch.zeros(megabytes * 2**18)

    def state_dict(self) -> dict:
        return {"data": self.data}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: filler, not training state."""


def prepared(project: Path, ballast_mb: int) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project)))
    model = nn.Linear(16, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.register_for_checkpointing(Ballast(ballast_mb))
    return accelerator, model, optimizer


def step(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 16)).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def save(project: Path, ballast_mb: int) -> None:
    accelerator, model, optimizer = prepared(project, ballast_mb)
    for _ in range(3):
        step(accelerator, model, optimizer)
    checkpoint = accelerator.save_state(async_save=True)
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), project / "saved.pt")
        print(f"saved {checkpoint}", flush=True)
    deadline = time.monotonic() + TRAIN_SECONDS
    while time.monotonic() < deadline:  # training goes on while the checkpoint is written
        step(accelerator, model, optimizer)
        time.sleep(0.01)


if __name__ == "__main__":
    save(Path(sys.argv[1]), int(sys.argv[2]))
