"""Launched worker: a small training run that checkpoints every few steps and can resume.

Written the way the checkpointing guide tells users to write their loop: `load_state(missing_ok=True)`
once after prepare, then `for epoch in range(train_dl.epoch, EPOCHS)`. Tests run it uninterrupted,
killed and resumed, stopped and resumed on another number of processes, and compare the parameters
it writes at the end (main process, OUT) with torch.equal or a tolerance. `main(argv)` runs it from
another launched worker (resize_window_worker.py), so that one launch does several runs.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, GradientState, ProjectConfiguration, set_seed

EPOCHS = 2
SAMPLES = 80  # 5 optimizer steps per epoch at a global batch of 16 samples
MICRO_BATCH = 4


class Ballast:
    """Constant bytes in every checkpoint, so a save lasts long enough for a test to kill it mid-way.

    Filler, not training state: a run keeps its own size when it loads a checkpoint, so only the runs
    that need a slow save pay for one.
    """

    def __init__(self, megabytes: int) -> None:
        self.data = torch.zeros(megabytes * 2**18)

    def state_dict(self) -> dict:
        return {"data": self.data}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: this run's size stays."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--accum", type=int, required=True)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--stop-after", type=int, default=None, help="exit cleanly after this optimizer step")
    parser.add_argument("--ballast-mb", type=int, default=0, help="extra checkpointed MB (slower saves)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (kill window)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """One run, from the command line or (argv) as one of several runs in a launch."""
    args = parse_args(argv)
    AcceleratorState._reset_state()  # a fresh Accelerator per run; the process group stays
    GradientState._reset_state()
    torch.set_num_threads(1)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accum,
        cpu=True,
        project_config=ProjectConfiguration(project_dir=args.project, total_limit=2),
    )
    set_seed(0)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 8, generator=generator)
    dataset = TensorDataset(x, x @ torch.randn(8, 2, generator=generator))
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(args.dropout), nn.Linear(32, 2))
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.register_for_checkpointing(Ballast(args.ballast_mb))
    accelerator.load_state(missing_ok=True)
    resumed_at = accelerator.optimizer_steps  # 0 when no checkpoint was there to load

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
            time.sleep(args.step_sleep)
            if accelerator.optimizer_steps % args.save_every == 0:
                accelerator.save_state()
            if accelerator.optimizer_steps == args.stop_after:
                return
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), os.fspath(args.out))
        # which step the run began at: a resume that loaded nothing would also end bit-identical
        Path(args.out).with_suffix(".resumed_at").write_text(str(resumed_at))


if __name__ == "__main__":
    main()
