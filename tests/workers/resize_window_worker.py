"""Launched worker: resume on another number of processes AND another accumulation, mid-epoch.

Usage: resize_window_worker.py OUT_DIR ACCUMULATION RESUME_DIR_OR_DASH. Trains a linear model on 96
shuffled samples (micro-batch 4 per process, AdamW, 3 epochs), saving the training state every 3
optimizer steps under OUT_DIR/ckpt_<step>; with RESUME_DIR it loads that first. Process 0 writes
OUT_DIR/result.json: optimizer steps taken and the final parameters.
"""

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator

out, accumulation, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3]
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation, project_dir=out)
torch.manual_seed(0)
data = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
loader = DataLoader(data, batch_size=4, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
if resume != "-":
    accelerator.load_state(resume)
for _ in range(loader.epoch, 3):
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and accelerator.optimizer_steps % 3 == 0:
            accelerator.save_state(f"{out}/ckpt_{accelerator.optimizer_steps}")
state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    result = {"steps": accelerator.optimizer_steps, "params": {k: v.tolist() for k, v in state.items()}}
    with open(f"{out}/result.json", "w") as file:
        json.dump(result, file)
