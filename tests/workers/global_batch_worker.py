"""Launched worker: a resume on another number of processes keeps the global batch per optimizer step.

Usage: global_batch_worker.py OUT_DIR RUN [RUN ...]. Each RUN is `NAME:ACCUMULATION:RESUME[:split]`, run in
turn in this launch, each with a fresh Accelerator, model and loader, the script passing
`gradient_accumulation_steps=ACCUMULATION` as a script that is restarted unchanged would. RESUME is `-`
(train from the start) or a checkpoint directory given to load_state. The loop: 96 samples, micro-batch 4
per process (with `split`: split_batches=True and a loader batch of 4 x the processes that saved, 8), SGD
with momentum and a StepLR scheduler, 2 epochs, a save every 3 optimizer steps under OUT_DIR/NAME/ckpt_<n>.
Every process writes OUT_DIR/NAME.<rank>.json: the accumulation after load_state, the optimizer steps taken,
the scheduler's learning rate and the final parameters, or, when load_state refused the checkpoint, its
message and whether the model was left untouched.
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, DataLoaderConfiguration, GradientState

EPOCHS = 2


def run(out: Path, spec: str) -> dict:
    AcceleratorState._reset_state()  # a fresh Accelerator per run; the process group stays
    GradientState._reset_state()
    name, accumulation, resume, *flags = spec.split(":")
    split = "split" in flags
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=int(accumulation),
        dataloader_config=DataLoaderConfiguration(split_batches=split),
    )
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    loader = DataLoader(data, batch_size=8 if split else 4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume != "-":
        before = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
        try:
            accelerator.load_state(resume)
        except Exception as error:
            after = accelerator.get_state_dict(model)
            untouched = all(torch.equal(before[k], after[k]) for k in before)
            return {"refused": f"{type(error).__name__}: {error}", "untouched": untouched}
    resumed_accumulation = accelerator.gradient_accumulation_steps
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and accelerator.optimizer_steps % 3 == 0:
                accelerator.save_state(out / name / f"ckpt_{accelerator.optimizer_steps}")
    return {
        "accumulation": resumed_accumulation,
        "steps": accelerator.optimizer_steps,
        "lr": scheduler.get_last_lr()[0],
        "params": {k: v.tolist() for k, v in accelerator.get_state_dict(model).items()},
    }


def main() -> None:
    out = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        result = run(out, spec)
        rank = AcceleratorState().process_index
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{spec.split(':')[0]}.{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
