"""Launched by tests/test_checkpoint_state.py with 2 processes: save_state / load_state pre-hooks, as
diffusers' training scripts use them, under ZeRO-3 (whose model saves are collective).

Usage: state_hooks_worker.py OUT_DIR. The save hook writes its own file and removes model 0's weights
on the main process only; the load hook takes model 0 out of the list on every process. Each rank
records what the checkpoint holds and what loading restored in OUT_DIR/rank{R}.json.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from unison import Accelerator


def main() -> None:
    """Inside a function, so every prepared model is freed before the interpreter's teardown: one left
    in a global can abort the process after its work is done (docs/failures.md)."""
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True, parallelism="zero3")
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 2)
    first, second, opt_first, opt_second = accelerator.prepare(
        first,
        second,
        torch.optim.SGD(first.parameters(), lr=0.1),
        torch.optim.SGD(second.parameters(), lr=0.1),
    )
    accelerator.backward(second(first(torch.randn(3, 4))).pow(2).mean())
    opt_first.step()
    opt_second.step()
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", len(models), len(weights)))
        if accelerator.is_main_process:  # diffusers' pattern: only the main process saves and pops
            (Path(output_dir) / "first").mkdir()
            (Path(output_dir) / "first" / "saved_by_hook.txt").write_text("model 0, saved its own way")
            weights.pop(0)

    def load_hook(models, input_dir):
        calls.append(("load", len(models), (Path(input_dir) / "first" / "saved_by_hook.txt").exists()))
        models.pop(0)

    handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    saved = {
        name: accelerator.get_state_dict(model) for name, model in (("first", first), ("second", second))
    }
    checkpoint = accelerator.save_state(out / "checkpoint")
    for model in (first, second):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
    accelerator.load_state(checkpoint)
    now = {name: accelerator.get_state_dict(model) for name, model in (("first", first), ("second", second))}
    handle.remove()
    again = accelerator.save_state(out / "again")
    record = {
        "calls": calls,
        "files": sorted(path.name for path in checkpoint.iterdir()),
        "files_after_remove": sorted(path.name for path in again.iterdir()),
    }
    if accelerator.is_main_process:  # get_state_dict gives the full tensors to the main process
        record["second_restored"] = all(torch.equal(now["second"][k], v) for k, v in saved["second"].items())
        record["first_left_alone"] = all(
            torch.equal(now["first"][k], v + 1) for k, v in saved["first"].items()
        )
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
