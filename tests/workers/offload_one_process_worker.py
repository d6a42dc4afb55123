"""Run as plain `python` (one process, no launcher): ZeRO-2/3 with offload=true on one process keeps
FSDP2 and its CPU offload, and trains exactly as plain one-process training.

For each of "zero2,offload=true" and "zero3,offload=true", against plain training in this process:
a small block model, SGD with momentum, a scheduler that changes the rate each step, clipping and
accumulation 2, STEPS optimizer steps: the losses and the final weights; the prepared parameters are
DTensors over a one-rank "dp_shard" mesh with FSDP2's CPUOffloadPolicy; save_state after
SAVE_AT optimizer steps, then a fresh model, optimizer and scheduler load it and finish the run (bit-
identical to the uninterrupted one); save_model writes the user's names; a model built inside
unison.init_empty_weights() and prepared gets the weights of the model built normally with the same
seed; so does one with GPT's tied embedding and an `_init_weights`, whose init ran once (this process
holds every tensor whole, so the replay writes into them in one pass: no dry pass); and the "runs
unsharded" note is not logged. Writes a JSON report to the first argument.
With --gpu (a device check by hand, not run by the tests) it runs on the GPU instead of the CPU.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from unison import Accelerator, AcceleratorState, init_empty_weights

ACCUMULATION = 2
STEPS = 3
SAVE_AT = 2  # optimizer steps before save_state
SEED = 7
LAYOUTS = ("zero2,offload=true", "zero3,offload=true")
CPU = "--gpu" not in sys.argv


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CountedLinear(torch.nn.Linear):
    """A Linear that counts its reset_parameters() calls (the init calls a replay makes)."""

    calls = 0

    def reset_parameters(self) -> None:
        CountedLinear.calls += 1
        super().reset_parameters()


class Tied(torch.nn.Module):
    """GPT's shape of init: the embedding takes the output layer's weight after both drew their own,
    then the root's `_init_weights(module)` over every module."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(16, 8)
        self.block = Block()
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = CountedLinear(8, 16, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.block(self.wte(x))))


def build(seed: int = SEED) -> Model:
    torch.manual_seed(seed)
    return Model()


_DATA = torch.Generator().manual_seed(100)
BATCHES = [(torch.randn(4, 8, generator=_DATA), torch.randn(4, 1, generator=_DATA)) for _ in range(6)]


def new_run(layout: str | None, model: torch.nn.Module) -> tuple[Accelerator, ...]:
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=CPU, parallelism=layout, gradient_accumulation_steps=ACCUMULATION)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler))


def train(accelerator, model, optimizer, scheduler, micro_steps: range) -> list[float]:
    losses = []
    for index in micro_steps:
        x, y = (t.to(accelerator.device) for t in BATCHES[index])
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def weights(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in accelerator.get_state_dict(model).items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[key].float() - b[key].float()).abs().max().item() for key in a)


def fsdp_facts(accelerator: Accelerator, model: torch.nn.Module) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    user = accelerator.unwrap_model(model)
    units = [m for m in user.modules() if isinstance(m, FSDPModule)]
    # private: FSDP2 has no public getter of a unit's offload policy (a test-only read)
    policies = {type(unit._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for unit in units}
    return {
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "fsdp_units": len(units),
        "offload_policies": sorted(policies),
        "mesh": list(accelerator.device_mesh.mesh_dim_names),
        "mesh_shape": list(accelerator.device_mesh.shape),
        "zero_stage": accelerator.parallelism.zero_stage,
        "offload": accelerator.parallelism.offload,
        "describe": accelerator.parallelism.describe(),
    }


class Notes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    torch.set_num_threads(1)
    notes = Notes()
    logging.getLogger("unison").addHandler(notes)
    logging.getLogger("unison").setLevel(logging.INFO)
    total = range(STEPS * ACCUMULATION)
    reference_run = new_run(None, build())
    reference_losses = train(*reference_run, total)
    reference = weights(reference_run[0], reference_run[1])
    user_names = sorted(build().state_dict())
    report: dict = {"reference_losses": reference_losses}
    for layout in LAYOUTS:
        notes.lines.clear()
        accelerator, model, optimizer, scheduler = new_run(layout, build())
        run: dict = {"facts": fsdp_facts(accelerator, model)}
        half = range(SAVE_AT * ACCUMULATION)
        losses = train(accelerator, model, optimizer, scheduler, half)
        with tempfile.TemporaryDirectory() as tmp:
            accelerator.save_state(Path(tmp) / "state")
            losses += train(accelerator, model, optimizer, scheduler, range(half.stop, total.stop))
            final = weights(accelerator, model)
            run["losses_diff"] = max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True))
            run["weights_diff"] = max_diff(final, reference)
            run["lr"] = scheduler.get_last_lr()

            saved = Path(accelerator.save_model(model, Path(tmp) / "model"))
            on_disk = load_file(saved)
            run["save_model_names"] = sorted(on_disk) == user_names
            run["save_model_diff"] = max_diff(on_disk, final)

            resumed, model2, optimizer2, scheduler2 = new_run(layout, build(seed=SEED + 1))
            resumed.load_state(Path(tmp) / "state")
            resumed_losses = train(resumed, model2, optimizer2, scheduler2, range(half.stop, total.stop))
            run["resume_losses_equal"] = resumed_losses == losses[half.stop :]
            run["resume_weights_diff"] = max_diff(weights(resumed, model2), final)
            run["resume_lr_equal"] = scheduler2.get_last_lr() == scheduler.get_last_lr()
            run["checkpoint_is_dcp"] = (Path(tmp) / "state" / "model_0" / ".metadata").is_file()

            plain, model3, optimizer3, scheduler3 = new_run(None, build(seed=SEED + 2))
            plain.load_state(Path(tmp) / "state")  # the same run continued without offload
            plain_losses = train(plain, model3, optimizer3, scheduler3, range(half.stop, total.stop))
            run["plain_resume_losses_equal"] = plain_losses == losses[half.stop :]
            run["plain_resume_weights_diff"] = max_diff(weights(plain, model3), final)

        torch.manual_seed(SEED)
        with init_empty_weights():
            meta_model = Model()
        meta_accelerator, meta_model, *_ = new_run(layout, meta_model)
        run["meta_dtensor"] = fsdp_facts(meta_accelerator, meta_model)["all_dtensor"]
        run["meta_init_diff"] = max_diff(weights(meta_accelerator, meta_model), build().state_dict())

        torch.manual_seed(SEED)
        expected = Tied().state_dict()
        torch.manual_seed(SEED)
        with init_empty_weights():
            tied = Tied()
        CountedLinear.calls = 0  # its construction on meta called it once, as the normal build did
        tied_accelerator, tied, *_ = new_run(layout, tied)
        run["meta_tied_init_calls"] = CountedLinear.calls
        run["meta_tied_diff"] = max_diff(weights(tied_accelerator, tied), expected)
        run["meta_tied_kept"] = tied.wte.weight is tied.lm_head.weight
        run["notes"] = list(notes.lines)
        report[layout] = run
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
