"""Launched worker: resume on another number of processes AND another accumulation, mid-epoch or not.

Usage: resize_window_worker.py OUT_DIR ACCUMULATION RUNS [-- RESUME_WORKER_ARGS ...]. Trains a linear model
on 96 shuffled samples (micro-batch 4 per process, AdamW, 3 epochs), saving the training state every 3
optimizer steps under OUT_DIR/<name>/ckpt_<step>. RUNS is comma-separated, run in turn in this launch, each
with a fresh Accelerator, model and loader: "-" trains from the start, a checkpoint directory resumes from
it, and DIR:B resumes from it with micro-batch B. Process 0 writes OUT_DIR/<name>.json per run ("result"
from the start, else the checkpoint's directory name, with "_mb<B>"): the optimizer steps taken and the
final parameters, or, when load_state refused the checkpoint, its message and whether the model was left
untouched. Each group after a `--` is then one run of resume_worker.py with those arguments, in this same
launch: the test file's other runs on this number of processes share its start-up.
"""

import json
import sys
from pathlib import Path

import torch
from resume_worker import main as resume_worker_run
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, GradientState


def run(out: str, accumulation: int, spec: str) -> dict:
    AcceleratorState._reset_state()  # a fresh Accelerator per run; the process group stays
    GradientState._reset_state()
    resume, _, batch = spec.partition(":")
    micro_batch = int(batch or 4)
    name = "result" if resume == "-" else Path(resume).name + (f"_mb{batch}" if batch else "")
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation, project_dir=f"{out}/{name}")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = DataLoader(data, batch_size=micro_batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if resume != "-":
        before = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
        try:
            accelerator.load_state(resume)
        except Exception as error:
            after = accelerator.get_state_dict(model)
            untouched = all(torch.equal(before[k], after[k]) for k in before)
            return {"name": name, "refused": f"{type(error).__name__}: {error}", "untouched": untouched}
    for _ in range(loader.epoch, 3):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and accelerator.optimizer_steps % 3 == 0:
                # under the run's own name: a resume in this launch must not overwrite the saves it reads
                accelerator.save_state(f"{out}/{name}/ckpt_{accelerator.optimizer_steps}")
    state = accelerator.get_state_dict(model)
    return {
        "name": name,
        "steps": accelerator.optimizer_steps,
        "params": {k: v.tolist() for k, v in state.items()},
    }


def main() -> None:
    out, accumulation, runs, *rest = sys.argv[1:]
    for spec in runs.split(","):
        result = run(out, int(accumulation), spec)
        if AcceleratorState().is_main_process:
            Path(out).mkdir(parents=True, exist_ok=True)
            Path(out, f"{result['name']}.json").write_text(json.dumps(result))
    groups: list[list[str]] = []
    for arg in rest:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    for argv in groups:
        resume_worker_run(argv)


if __name__ == "__main__":
    main()
