"""Launched worker for tests/test_restarts.py: a training script that survives `--max-restarts`.

It resumes the way the checkpointing guide tells users to: `load_state(missing_ok=True)` once after
prepare, then `for epoch in range(loader.epoch, EPOCHS)`. When torch's agent restarts the group after a
worker died, the new attempt picks up the newest complete checkpoint by itself.

`--kill RANK:PLACE:STEP` (repeatable) is the fault to inject: the i-th one applies to restart attempt i
(TORCHELASTIC_RESTART_COUNT), so one launch can die several times, each time elsewhere. The process of
rank RANK SIGKILLs itself (no exception, no cleanup: as the OOM killer would) at optimizer step STEP:

- `step`: after the optimizer step, between two saves;
- `save-start`: inside the save of that step, from a save_state pre-hook: the checkpoint's temporary
  directory exists, nothing is written yet, the other process waits in the save's next collective;
- `save-middle`: inside the save of that step, from the state_dict() of an object registered for
  checkpointing, which the main process writes after the model, optimizer, scheduler and data loader
  (so RANK must be 0): the temporary directory holds half a checkpoint.

- `write`: with `--async-save`, once save_state of that step has returned and its background write is
  under way: a timer SIGKILLs the process after a random 0-100 ms (seeded by the attempt), first
  appending to PROJECT/kills-rankR.jsonl which checkpoint was still being written (None: none).
  `--ballast-mb` makes the writes long enough for that.

Rank 0 appends {"attempt", "resumed_from"} to PROJECT/resumes.jsonl after each load_state, so the test
can tell that every restart resumed from the checkpoint before its kill (a restart that started over
would also end on the reference parameters and prove nothing). The main process writes the final
parameters to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, ProjectConfiguration, set_seed

EPOCHS = 2
SAMPLES = 96  # 6 optimizer steps per epoch at a global batch of 16 (2 processes x 4 x accumulation 2)
MICRO_BATCH = 4
SAVE_EVERY = 2


class KillPoint:
    """Registered for checkpointing: its state_dict() is the `save-middle` kill point."""

    def __init__(self, kill: tuple[int, str, int] | None, accelerator: Accelerator) -> None:
        self.kill, self.accelerator = kill, accelerator

    def check(self, place: str) -> None:
        """SIGKILL this process if the kill of this attempt is for this rank, place and step."""
        here = (self.accelerator.process_index, place, self.accelerator.optimizer_steps)
        if self.kill == here:
            os.kill(os.getpid(), signal.SIGKILL)

    def state_dict(self) -> dict:
        self.check("save-middle")
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Ballast:
    """Registered for checkpointing: MB of float32 that make each save's write take a while."""

    def __init__(self, megabytes: int) -> None:
        self.tensor = torch.zeros(megabytes * 2**18)

    def state_dict(self) -> dict:
        return {"ballast": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["ballast"]


def kill_during_the_write(accelerator: Accelerator, project: Path, attempt: int) -> None:
    """SIGKILL this process a random 0-100 ms from now, saying first whether a write was in flight."""
    delay = random.Random(attempt).uniform(0.0, 0.1)

    def kill() -> None:
        record = {"attempt": attempt, "step": accelerator.optimizer_steps, "delay": round(delay, 3)}
        in_flight = accelerator.checkpoint_in_flight
        record["in_flight"] = in_flight and in_flight.name
        with open(project / f"kills-rank{accelerator.process_index}.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Timer(delay, kill).start()


def parse_kill(text: str) -> tuple[int, str, int]:
    rank, place, step = text.split(":")
    if place not in ("step", "save-start", "save-middle", "write"):
        raise argparse.ArgumentTypeError(f"unknown kill place {place!r}")
    return int(rank), place, int(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill", type=parse_kill, action="append", default=[])
    parser.add_argument("--async-save", action="store_true", help="ProjectConfiguration(async_save=True)")
    parser.add_argument("--ballast-mb", type=int, default=0, help="extra checkpointed MB (longer writes)")
    args = parser.parse_args()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    kill = args.kill[attempt] if attempt < len(args.kill) else None

    torch.set_num_threads(1)
    accelerator = Accelerator(
        gradient_accumulation_steps=2,
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=args.project,
            automatic_checkpoint_naming=True,
            total_limit=2,
            async_save=args.async_save,
        ),
    )
    set_seed(0)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 8, generator=generator)
    dataset = TensorDataset(x, x @ torch.randn(8, 2, generator=generator))
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    kill_point = KillPoint(kill, accelerator)
    accelerator.register_for_checkpointing(kill_point)
    if args.ballast_mb:
        accelerator.register_for_checkpointing(Ballast(args.ballast_mb))
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: kill_point.check("save-start")
    )

    resumed_from = accelerator.load_state(missing_ok=True)
    if accelerator.is_main_process:
        args.project.mkdir(parents=True, exist_ok=True)
        with open(args.project / "resumes.jsonl", "a") as log:
            log.write(
                json.dumps({"attempt": attempt, "resumed_from": resumed_from and resumed_from.name}) + "\n"
            )

    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            kill_point.check("step")
            if accelerator.optimizer_steps % SAVE_EVERY == 0:
                accelerator.save_state()
                if kill == (accelerator.process_index, "write", accelerator.optimizer_steps):
                    kill_during_the_write(accelerator, args.project, attempt)
    accelerator.end_training()  # an asynchronous save in flight is finished first
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), args.out)


if __name__ == "__main__":
    main()
