"""Launched by tests/test_three_nodes.py. Usage: three_node_worker.py PROJECT OUT [options]

Trains a small MLP (no dropout, shuffled data, AdamW with a StepLR scheduler, 96 samples, micro-batch 4
per process, 2 epochs), fully seeded, written as docs/checkpointing.md and design.md write the loop:
`load_state(missing_ok=True)` once after prepare, `for epoch in range(loader.epoch, EPOCHS)`, and the
loss all-reduced after every micro-step (`accelerator.reduce(loss, "mean")`, as it is logged). With
--save it saves the training state under PROJECT/checkpoints after every optimizer step, so an elastic
restart on fewer processes resumes from the newest one (load_state converts the accumulation to keep
the saved global batch per optimizer step).

Options:
- --accumulation G: the script's gradient_accumulation_steps (default 2: 24 samples per optimizer step
  on 3 processes, 16 on 2). A resumed run gets what the checkpoint's global batch needs instead.
- --log-at-optimizer-steps: all-reduce (log) the loss only when the optimizer steps, as scripts that log
  once per step do, instead of after every micro-step: the only collective of a micro-step is then
  DDP's gradient all-reduce inside backward, the one a lost node leaves the others waiting in.
- --stop-after K: end cleanly after optimizer step K (and its save).
- --hold-after K: once (while OUT/held does not exist), when the save of step K has returned, write
  OUT/held and wait (at most HOLD_SECONDS) until OUT/go exists, then go on into step K + 1. The test
  takes this node's link down meanwhile: the step at which the network goes is then known, so the last
  checkpoint the group completed is step K whatever the timing.

Each rank prints "starting attempt N" (TORCHELASTIC_RESTART_COUNT) first, and one line after
load_state: its attempt, rank, world size, the checkpoint it resumed from (or "nothing to resume") and
its accumulation. At the end each rank writes OUT/result-rank<R>.json (those facts, the optimizer steps
taken, every logged loss, and the seconds the training loop and each of its optimizer steps took, from
the end of the previous step, its save and hold excluded); the main process writes OUT/params.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, ProjectConfiguration, set_seed

EPOCHS = 2
SAMPLES = 96  # a whole number of optimizer steps per epoch at 16 (2 x 4 x 2) and 24 (3 x 4 x 2, 2 x 4 x 3)
MICRO_BATCH = 4
HOLD_SECONDS = 60.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--log-at-optimizer-steps", action="store_true")
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--hold-after", type=int, default=None)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"starting attempt {attempt}", flush=True)

    torch.set_num_threads(1)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulation,
        cpu=True,
        project_config=ProjectConfiguration(project_dir=args.project, automatic_checkpoint_naming=True),
    )
    set_seed(0)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 8, generator=generator)
    dataset = TensorDataset(x, torch.tanh(x @ torch.randn(8, 2, generator=generator)))
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    resumed = accelerator.load_state(missing_ok=True)
    seen = {
        "attempt": attempt,
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "resumed_from": resumed and resumed.name,
        "resumed_at_step": accelerator.optimizer_steps,
        "accumulation": accelerator.gradient_accumulation_steps,
    }
    print(
        f"attempt {attempt}: rank {seen['rank']} of world size {seen['world_size']}, "
        f"resumed from {seen['resumed_from'] or 'nothing to resume'} at optimizer step "
        f"{seen['resumed_at_step']}, gradient_accumulation_steps {seen['accumulation']}",
        flush=True,
    )

    started = last = time.monotonic()
    losses = []
    step_seconds = []  # each optimizer step's wall time: on a slow link, at least one round trip's
    stop = False
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients or not args.log_at_optimizer_steps:
                losses.append(accelerator.reduce(loss.detach(), "mean").item())  # the mean loss, as logged
            if not accelerator.sync_gradients:
                continue
            step = accelerator.optimizer_steps
            step_seconds.append(time.monotonic() - last)
            if args.save:
                accelerator.save_state()
            if step == args.hold_after and not (args.out / "held").exists():
                hold(args.out, step)
            last = time.monotonic()
            if step == args.stop_after:
                stop = True
                break
        if stop:
            break
    seen["loop_seconds"] = time.monotonic() - started
    seen["optimizer_steps"] = accelerator.optimizer_steps
    seen["step_seconds"] = step_seconds
    seen["losses"] = losses
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"result-rank{seen['rank']}.json").write_text(json.dumps(seen))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(
            {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()},
            args.out / "params.pt",
        )
    accelerator.end_training()


def hold(out: Path, step: int) -> None:
    """Say this rank waits after step `step`, and wait until the test says go (bounded)."""
    (out / "held").write_text(str(step))
    print(f"holding after optimizer step {step}", flush=True)
    deadline = time.monotonic() + HOLD_SECONDS
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    main()
