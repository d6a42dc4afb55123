"""Launched by tests/test_accelerate_checkpoints.py: one Accelerate-style script, run under real Hugging
Face Accelerate or under unison (numerics="accelerate"), for a run started under Accelerate and
continued under unison.

    accelerate_checkpoint_worker.py accelerate OUT_DIR   (under torch.distributed.run, 1 or 2 processes)
    accelerate_checkpoint_worker.py unison OUT_DIR       (under unison launch, or imported: 1 process)

For each layout, "plain" (DDP on 2 processes), "fsdp" (FSDP2, SHARDED_STATE_DICT: DCP folders) and
"fsdp_full" (FSDP2, FULL_STATE_DICT, Accelerate's default):

- accelerate: train into the second epoch and `save_state(OUT_DIR/<layout>/checkpoint)` at the end of
  an optimizer step; then, as a restarted script does, build everything afresh, `load_state` it and
  train to the end (`skip_first_batches` for the rest of the interrupted epoch, the loop of Accelerate's
  examples/by_feature/checkpointing.py). That resumed run is the reference.
- unison: the same restarted script under unison, loading Accelerate's folder; and the plain folder once
  more into ZeRO-3 (unison's FSDP), written as unison_zero3_rank<R>.json.

Each process writes OUT_DIR/<layout>/<framework>_rank<R>.json: the resumed run's loss at every
micro-step, its final parameters (whole, from get_state_dict), its last learning rate, the registered
counter (at the load and at the end), and on unison its optimizer_steps at the load and the lines it
logged. The model has dropout, so the restored RNG states matter; the loader shuffles; accumulation 2
leaves a short window at each epoch's end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROWS, FEATURES, BATCH, ACCUMULATION, EPOCHS, LR, SEED = 40, 8, 4, 2, 3, 1e-2, 7
LAYOUTS = ("plain", "fsdp", "fsdp_full")
SAVE_EPOCH = 1  # saved at the end of the first optimizer step of this epoch: ACCUMULATION batches into it


class Counter:
    """An object registered for checkpointing (Accelerate writes it as custom_checkpoint_0.pkl)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(ROWS, FEATURES, generator=generator)
    return TensorDataset(features, (features[:, :3].sum(1) > 0).long())


def build(framework: str, layout: str):
    """The script's set-up, as a restarted script runs it: seed, Accelerator, model, prepare."""
    if framework == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin, set_seed

        kwargs = {}
    else:
        from unison import Accelerator
        from unison.utils import FullyShardedDataParallelPlugin, set_seed

        kwargs = {"numerics": "accelerate"}
    if layout != "plain":
        state_dict_type = "FULL_STATE_DICT" if layout == "fsdp_full" else "SHARDED_STATE_DICT"
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type=state_dict_type, reshard_after_forward=True
        )
    plugin = kwargs.pop("fsdp_plugin", None) if framework == "accelerate" else None
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, **kwargs)
    if plugin is not None:
        _force_fsdp(accelerator, plugin)
    set_seed(SEED)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Dropout(0.2), nn.GELU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(make_data(), batch_size=BATCH, shuffle=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    counter = Counter()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, loader, scheduler, counter


def train(parts, epochs: range, skip: int = 0, save_to: Path | None = None) -> list[float]:
    """Accelerate's loop; with `save_to`, save at the end of SAVE_EPOCH's first optimizer step and stop."""
    accelerator, model, optimizer, loader, scheduler, counter = parts
    losses = []
    for epoch in epochs:
        model.train()
        active = accelerator.skip_first_batches(loader, skip) if skip and epoch == epochs[0] else loader
        for index, (x, y) in enumerate(active):
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                counter.count += 1
            if save_to is not None and epoch == SAVE_EPOCH and index + 1 == ACCUMULATION:
                accelerator.save_state(str(save_to))
                return losses
    return losses


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def resumed(framework: str, layout: str, checkpoint: Path) -> dict:
    """A restarted script: everything afresh, load_state(checkpoint), train to the end."""
    parts = build(framework, layout)
    accelerator, model, _, _, scheduler, counter = parts
    accelerator.load_state(str(checkpoint))
    loaded = {"count": counter.count, "optimizer_steps": getattr(accelerator, "optimizer_steps", None)}
    losses = train(parts, range(SAVE_EPOCH, EPOCHS), skip=ACCUMULATION)
    state = accelerator.get_state_dict(model)
    return {
        "losses": losses,
        "params": {key: value.tolist() for key, value in state.items()},
        "lr": scheduler.get_last_lr()[0],
        "count": counter.count,
        "step": accelerator.step,
        "loaded": loaded,  # the registered counter (optimizer steps) and unison's optimizer_steps at load
    }


def main() -> None:
    framework, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    for layout in LAYOUTS:
        checkpoint = out / layout / "checkpoint"
        lines = Lines()
        if framework == "accelerate":
            train(build(framework, layout), range(EPOCHS), save_to=checkpoint)
            _reset_accelerate()
            result = resumed(framework, layout, checkpoint)
            _reset_accelerate()
        else:
            logging.getLogger("unison").addHandler(lines)
            result = resumed(framework, layout, checkpoint)
            logging.getLogger("unison").removeHandler(lines)
            result["lines"] = lines.lines
        (out / layout / f"{framework}_rank{rank}.json").write_text(json.dumps(result))
    if framework == "unison":  # Accelerate's plain folder (model.safetensors, optimizer.bin) into ZeRO-3
        result = resumed(framework, "fsdp", out / "plain" / "checkpoint")
        (out / "plain" / f"unison_zero3_rank{rank}.json").write_text(json.dumps(result))


def _force_fsdp(accelerator, plugin) -> None:
    """Accelerate 1.15 turns an fsdp_plugin into DistributedType.FSDP only on accelerators (GPU, XPU, ...):
    on CPU processes (MULTI_CPU) it drops the plugin without a word. Its FSDP2 code itself runs on CPU
    with gloo, so the state is set as Accelerate sets it on a GPU, and its own prepare / save_state /
    load_state then write and read its FSDP2 folders."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    # AcceleratorState() copies PartialState's fields in again each time it is built: set both
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def _reset_accelerate() -> None:
    """Let the next Accelerator of this process take another plugin, as a restarted process would (the
    process group stays; the processes' type goes back to what Accelerate gave it before _force_fsdp)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    state = PartialState()
    if state.distributed_type == DistributedType.FSDP:
        state.distributed_type = DistributedType.MULTI_CPU if state.num_processes > 1 else DistributedType.NO


if __name__ == "__main__":
    main()
