"""Launched worker: save_state under one layout, load_state under another, through the Accelerator.

    layout_checkpoint_worker.py save LAYOUT DIR [LAYOUT DIR ...] [load LAYOUT DIR ...]
        for each pair: train 2 steps under LAYOUT, save_state(DIR/checkpoint), save_model(DIR/weights),
        save_state(DIR/checkpoint_async, async_save=True), train 1 more step while it is written (end_training
        waits for it); the main process writes the consolidated weights after each to DIR/at_save.pt and
        DIR/after_step.pt
    layout_checkpoint_worker.py load LAYOUT DIR [LAYOUT DIR ...]
        for each pair: load_state(DIR/checkpoint) under LAYOUT, train the same 1 step; the main process
        writes DIR/restored_<N>_<LAYOUT>.pt and DIR/loaded_<N>_<LAYOUT>.pt (N: the number of processes)

Several pairs share one launch (a launch costs seconds of start-up): each gets its own Accelerator.
`save ... load ...` in one command line saves, then loads on the same processes.
The tiny GPT (examples/gpt/model.py) trains with SGD+momentum (its momentum buffers must survive the
move between layouts) on fixed batches of 8 sequences, the same global batch in every layout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_gpt import make_tiny_gpt

from unison import Accelerator

BLOCK = 16
GLOBAL_BATCH = 8


def loss_fn(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def run(mode: str, layout: str, directory: Path) -> None:
    accelerator = Accelerator(cpu=True, parallelism=layout)
    model = make_tiny_gpt(1234, BLOCK)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    dp_size, dp_rank = accelerator.parallelism.dp_size, accelerator.data_parallel_index
    tokens = torch.randint(0, 32, (3, GLOBAL_BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(5))
    share = GLOBAL_BATCH // dp_size

    def step(index: int) -> None:
        batch = tokens[index, dp_rank * share : (dp_rank + 1) * share]
        accelerator.forward_backward(model, batch[:, :-1], batch[:, 1:], loss_fn)
        optimizer.step()
        optimizer.zero_grad()

    def write(name: str) -> None:
        state = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            torch.save(state, directory / name)

    if mode == "save":
        step(0)
        step(1)
        accelerator.save_state(directory / "checkpoint")
        accelerator.save_model(model, directory / "weights")
        write("at_save.pt")
        # the same state again, written in the background while the next step changes every weight
        accelerator.save_state(directory / "checkpoint_async", async_save=True)
        step(2)
        write("after_step.pt")
    else:
        suffix = f"{accelerator.num_processes}_{layout}"
        accelerator.load_state(directory / "checkpoint")
        write(f"restored_{suffix}.pt")
        step(2)
        write(f"loaded_{suffix}.pt")
    accelerator.end_training()


def main() -> None:
    groups: list[list[str]] = []
    for arg in sys.argv[1:]:
        if arg in ("save", "load"):
            groups.append([arg])
        else:
            groups[-1].append(arg)
    for mode, *pairs in groups:
        for layout, directory in zip(pairs[::2], pairs[1::2], strict=True):
            run(mode, layout, Path(directory))


if __name__ == "__main__":
    main()
