"""Launched worker: models whose forward returns its tensors in containers torch's traversal does not walk
(unison.parallel.outputs), under every layout that hooks outputs, against one process.

For each container KIND (a SimpleNamespace, a plain object with attributes, a dataclass, a frozen
dataclass, a dict holding a SimpleNamespace) and each LAYOUT (zero3, zero2, ddp with
find_unused_parameters, ddp with static_graph, plain ddp): a tiny model (Linear 8->16, two residual
blocks of Linear 16->16, head Linear 16->4) whose blocks and root both return the container, STEPS SGD
steps with the Accelerator on this rank's half of a global batch, then one evaluation forward under
torch.no_grad(). The reference trains a copy of the same model in plain torch on the whole batch. Per run:
the largest difference of the losses (each rank's against the reference's loss on that rank's half), of
the final parameters and of the evaluation outputs, and whether the forward handed back the container's
own types (training, evaluation, and, under DDP, the unwrapped model called on its own).
Then a model returning an object with __slots__ under zero3 and under ddp+find_unused: the refusal's text.

Every process writes OUT/<rank>.json (OUT: the first argument).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from unison import Accelerator, AcceleratorState, DistributedDataParallelKwargs, GradientState

STEPS = 3
GLOBAL_BATCH = 8
LAYOUTS = {
    "zero3": ("zero3", None),
    "zero2": ("zero2", None),
    "ddp_find_unused": ("ddp", {"find_unused_parameters": True}),
    "ddp_static_graph": ("ddp", {"static_graph": True}),
    "ddp": ("ddp", None),
}


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class FrozenOutput:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "kept"


class Box:
    """A plain object holding its tensors in attributes."""

    def __init__(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self.logits, self.hidden, self.note = logits, hidden, "kept"


class Slotted:
    __slots__ = ("hidden", "logits", "note")

    def __init__(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self.logits, self.hidden, self.note = logits, hidden, "kept"


def pack(kind: str, logits: torch.Tensor, hidden: torch.Tensor):
    if kind == "namespace":
        return types.SimpleNamespace(logits=logits, hidden=hidden, note="kept")
    if kind == "object":
        return Box(logits, hidden)
    if kind == "dataclass":
        return Output(logits, hidden)
    if kind == "frozen_dataclass":
        return FrozenOutput(logits, hidden)
    if kind == "nested":
        return {"out": types.SimpleNamespace(logits=logits, hidden=hidden, note="kept"), "step": 1}
    if kind == "slots":
        return Slotted(logits, hidden)
    raise ValueError(kind)


def unpack(output) -> types.SimpleNamespace:
    return output["out"] if isinstance(output, dict) else output


def same_types(kind: str, output) -> bool:
    """Whether `output` is the container `pack(kind, ...)` makes, its non-tensor attribute kept."""
    expected = type(pack(kind, torch.zeros(1), torch.zeros(1)))
    if type(output) is not expected:
        return False
    if kind == "nested":
        return (
            type(output["out"]) is types.SimpleNamespace
            and output["step"] == 1
            and output["out"].note == "kept"
        )
    return output.note == "kept" and all(isinstance(t, torch.Tensor) for t in (output.logits, output.hidden))


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.fc = kind, nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.fc(x)) + x
        return pack(self.kind, h, h * 2)  # the hidden "state" is unused by the next block and the loss


class Model(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Linear(8, 16)
        self.layers = nn.ModuleList([Block(kind) for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = unpack(layer(h)).logits
        return pack(self.kind, self.head(h), h)


def fresh_accelerator(layout: str) -> Accelerator:
    AcceleratorState._reset_state()  # a fresh Accelerator per run; the process group stays
    GradientState._reset_state()
    parallelism, ddp_options = LAYOUTS[layout]
    handlers = [DistributedDataParallelKwargs(**ddp_options)] if ddp_options else []
    return Accelerator(cpu=True, parallelism=parallelism, kwargs_handlers=handlers)


def full(parameter: torch.Tensor) -> torch.Tensor:
    """The whole parameter (collective for a ZeRO-2/3 shard: every process calls it in the same order)."""
    return parameter.full_tensor().detach() if isinstance(parameter, DTensor) else parameter.detach()


def data() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    inputs = [torch.randn(GLOBAL_BATCH, 8, generator=generator) for _ in range(STEPS)]
    targets = [torch.randn(GLOBAL_BATCH, 4, generator=generator) for _ in range(STEPS)]
    return inputs, targets, torch.randn(GLOBAL_BATCH, 8, generator=generator)


def run(layout: str, kind: str) -> dict:
    accelerator = fresh_accelerator(layout)
    rank, world = accelerator.process_index, accelerator.num_processes
    half = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    torch.manual_seed(0)
    model = Model(kind)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs, targets, evaluation = data()
    loss_gap, types_kept = 0.0, True
    for x, y in zip(inputs, targets):
        logits = unpack(reference(x)).logits
        reference_loss = (logits[half] - y[half]).square().mean()  # this rank's half, for the comparison
        (logits - y).square().mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        output = model(x[half])
        types_kept &= same_types(kind, output)
        loss = (unpack(output).logits - y[half]).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        loss_gap = max(loss_gap, abs(loss.item() - reference_loss.item()))
    trained = {name: full(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
    expected = dict(reference.named_parameters())
    parameter_gap = max((trained[k] - expected[k]).abs().max().item() for k in expected)
    with torch.no_grad():
        evaluated = model(evaluation[half])
        evaluation_gap = (
            (unpack(evaluated).logits - unpack(reference(evaluation)).logits[half]).abs().max().item()
        )
    result = {
        "loss_gap": loss_gap,
        "parameter_gap": parameter_gap,
        "evaluation_gap": evaluation_gap,
        "types_kept": bool(types_kept),
        "evaluation_types_kept": same_types(kind, evaluated),
        "keys_match": sorted(trained) == sorted(expected),
    }
    if layout.startswith("ddp"):  # the user's module on its own: untouched (no DDP forward around it)
        result["unwrapped_types_kept"] = same_types(kind, accelerator.unwrap_model(model)(evaluation[half]))
    return result


def refusal(layout: str) -> str:
    accelerator = fresh_accelerator(layout)
    torch.manual_seed(0)
    model = accelerator.prepare(Model("slots"))
    try:
        model(torch.randn(4, 8))
    except TypeError as error:
        return str(error)
    return "not refused"


def main() -> None:
    out = Path(sys.argv[1])
    report: dict = {"runs": {}, "refusals": {}}
    started = time.perf_counter()
    for layout in LAYOUTS:
        for kind in ("namespace", "object", "dataclass", "frozen_dataclass", "nested"):
            report["runs"][f"{layout}/{kind}"] = run(layout, kind)
    for layout in ("zero3", "ddp_find_unused"):
        report["refusals"][layout] = refusal(layout)
    report["seconds"] = time.perf_counter() - started
    rank = AcceleratorState().process_index
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
