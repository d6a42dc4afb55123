"""Launched worker (2 processes): models built on the meta device (unison.init_empty_weights) under
ZeRO-3, TP 2 and PP 2 (and DDP, which materialises it whole), against the same model built normally;
and each rank's peak memory. With --own-init-only (4 processes): the model's own init under those
three and PP 2 x TP 2, and process 0's weights under PP 2 x TP 2.

Fidelity: for each layout, process 0 builds the tiny GPT with real weights (seeded) and process 1 builds
it inside init_empty_weights(); prepare() broadcasts process 0's weights into the shards. Both train
STEPS SGD+momentum steps through the ordinary loop; every rank also trains the model built normally in
one process (the reference) and the final full state dicts are compared; a DDP checkpoint loads into
the meta-built model of each layout exactly (the streamed resume). With every process on meta,
prepare() runs the model's own init on the shards: checked finite, the same on a second build with the
same seed, and the copies of the tied embedding equal on every rank.

Memory: each phase resets the process's peak resident set (Linux: "5" into /proc/self/clear_refs) and
reads VmHWM after it, minus the resident set at the reset: the most this rank held at once during
the phase. Measured for a model of MEMORY_LAYERS x 2 Linear(WIDTH, WIDTH) (MEMORY_BYTES of fp32) under
ZeRO-3: built normally on every rank (today's path), built on meta on every rank (own init), built on
process 0 only (broadcast); and resuming a DDP checkpoint (replicated files) into ZeRO-3.

Process 0 writes a JSON report to the path given as the first argument.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peak_memory import Peak, on_every_process
from tiny_gpt import gpt_model, make_tiny_gpt
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState, init_empty_weights

STEPS = 4
GLOBAL_BATCH = 4
BLOCK = 16
SEED = 1234
LAYOUTS = ("zero3", "tp_size=2", "pp_size=2", "ddp")  # ddp: materialised whole, then wrapped
PP_TP = "pp_size=2,tp_size=2"  # 4 processes only: the tied wte / lm_head on both ends, vocabulary-sharded
WIDTH = 1024
MEMORY_LAYERS = 8  # 2 x 8 Linear(1024, 1024) with bias: 67 MB of fp32


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, WIDTH)
        self.down = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(torch.nn.Module):
    """Many equal blocks in a ModuleList (ZeRO-3 shards block by block)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(MEMORY_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


MEMORY_BYTES = MEMORY_LAYERS * 2 * (WIDTH * WIDTH + WIDTH) * 4


def memory_report() -> dict:
    rank = dist.get_rank()
    report: dict = {"model_bytes": MEMORY_BYTES}

    def prepared(build_real: bool) -> None:
        torch.manual_seed(SEED)
        if build_real:
            model = Stack()
        else:
            with init_empty_weights():
                model = Stack()
        model = Accelerator(cpu=True, parallelism="zero3").prepare(model)
        del model

    for name, real_on in (("built_normally", (0, 1)), ("meta_init", ()), ("meta_broadcast", (0,))):
        with Peak() as peak:
            prepared(rank in real_on)
        report[name] = on_every_process(peak.bytes)
    # resume: a DDP run's replicated checkpoint (model and momentum files) into ZeRO-3
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ckpt"
        torch.manual_seed(SEED)
        ddp = Accelerator(cpu=True, parallelism="ddp")
        model = Stack()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = ddp.prepare(model, optimizer)
        model(torch.ones(2, WIDTH)).sum().backward()
        optimizer.step()
        shared = [str(directory)]
        dist.broadcast_object_list(shared, src=0)
        ddp.save_state(shared[0])
        del model, optimizer, ddp
        zero3 = Accelerator(cpu=True, parallelism="zero3")
        with init_empty_weights():
            model = Stack()
        model = zero3.prepare(model)
        optimizer = zero3.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        with Peak() as peak:
            zero3.load_state(shared[0])
        report["resume_ddp_into_zero3"] = on_every_process(peak.bytes)
        dist.barrier()
        if rank == 0:
            reference = torch.load(Path(shared[0]) / "model_0.pt", weights_only=True)
        full = zero3.get_state_dict(model)
        if rank == 0:
            report["resume_max_abs_diff"] = max(
                (full[k] - reference[k]).abs().max().item() for k in reference
            )
        del model, optimizer, zero3
        dist.barrier()
    return report


def batches() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 32, (STEPS * GLOBAL_BATCH, BLOCK + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def mean_loss(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0].flatten(0, 1), targets.flatten())


class PlainGPT(gpt_model.GPT):
    """The tiny GPT with its modules' own reset_parameters() as its whole init."""

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass


def tiny_config() -> gpt_model.GPTConfig:
    return gpt_model.GPTConfig(block_size=BLOCK, vocab_size=32, n_layer=2, n_head=2, n_embd=32)


def reference(model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    model = make_tiny_gpt(SEED, BLOCK) if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    inputs, targets = batches().tensors
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        mean_loss(model(inputs[rows]), targets[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def build(real: bool) -> torch.nn.Module:
    if real:
        return make_tiny_gpt(SEED, BLOCK)
    torch.manual_seed(SEED)
    with init_empty_weights():
        return make_tiny_gpt(SEED, BLOCK)


def train(
    layout: str,
    real: bool,
    model: torch.nn.Module | None = None,
    initial: dict | None = None,
    grad_layouts: list | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """STEPS steps of the model built by `build(real)` (or `model`) under `layout`: the final full
    state dict and loss; `initial`, when given, receives the full state dict right after prepare();
    `grad_layouts`, the names of DTensor parameters whose gradient, after a step's backward, is not
    in the parameter's placements (a vocabulary-sharded table's gradient kept full size)."""
    accelerator = Accelerator(cpu=True, parallelism=layout)
    model = build(real) if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loader = DataLoader(batches(), batch_size=GLOBAL_BATCH // accelerator.parallelism.dp_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if initial is not None:
        # copies: a replicated DTensor's full tensor is its local tensor, which the steps then update
        initial.update({k: v.clone() for k, v in accelerator.get_state_dict(model).items()})
    loss = torch.tensor(float("nan"))
    for inputs, targets in loader:
        if accelerator.parallelism.pp_size > 1:
            loss = accelerator.forward_backward(model, inputs, targets, mean_loss)
        else:
            loss = mean_loss(model(inputs), targets)
            accelerator.backward(loss)
        if grad_layouts is not None:
            grad_layouts.extend(
                name
                for name, p in model.named_parameters()
                if hasattr(p.grad, "placements") and p.grad.placements != p.placements
            )
        optimizer.step()
        optimizer.zero_grad()
    return accelerator.get_state_dict(model), loss.item()


def initialised(layout: str) -> tuple[dict[str, torch.Tensor], bool]:
    """Every process on meta: the model's own init on the shards, gathered whole; and whether the
    copies of the tied embedding (one per pipeline end under PP) are equal on every rank."""
    accelerator = Accelerator(cpu=True, parallelism=layout)
    model = accelerator.prepare(build(real=False))
    local = dict(accelerator.unwrap_model(model).named_parameters(remove_duplicate=False))
    tied = local.get("transformer.wte.weight", local.get("lm_head.weight"))
    tied = tied.full_tensor() if hasattr(tied, "full_tensor") else tied.detach()
    copies = [torch.empty_like(tied) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tied.contiguous())
    return accelerator.get_state_dict(model), all(torch.equal(copies[0], c) for c in copies)


def own_init(layouts: tuple[str, ...]) -> dict[str, dict[str, dict[str, float]]]:
    """Every process builds the model on meta after the same seed (and draws something else before
    prepare(), as a script may): the largest difference to the model built normally in one process,
    right after prepare() ("init") and after STEPS steps ("trained")."""
    found: dict[str, dict[str, dict[str, float]]] = {}
    for kind, model_class in (("gpt", gpt_model.GPT), ("plain", PlainGPT)):
        torch.manual_seed(SEED)
        normal = model_class(tiny_config())
        expected_init = {k: v.clone() for k, v in normal.state_dict().items()}
        expected_trained = reference(normal)
        for layout in layouts:
            torch.manual_seed(SEED)
            with init_empty_weights():
                model = model_class(tiny_config())
            torch.rand(7)  # the generator moves on before prepare(): the init still starts where it was
            initial: dict = {}
            mismatched: list = []
            trained, _ = train(layout, real=False, model=model, initial=initial, grad_layouts=mismatched)
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, sorted(set(mismatched)))
            if dist.get_rank() == 0:
                found.setdefault(kind, {})[layout] = {
                    "grads_not_in_parameter_layout": sorted({n for names in everyone for n in names}),
                    "init": max((initial[k] - expected_init[k]).abs().max().item() for k in expected_init),
                    "trained": max(
                        (trained[k] - expected_trained[k]).abs().max().item() for k in expected_trained
                    ),
                    "keys_match": sorted(initial) == sorted(expected_init),
                }
    return found


def resumed_into(layouts: tuple[str, ...], directory: str) -> dict[str, float]:
    """A DDP run's checkpoint (model only: a plain optimizer state cannot enter pipeline stages) loaded
    into a meta-built model under each layout (the streamed path): the largest difference to it."""
    ddp = Accelerator(cpu=True, parallelism="ddp")
    saved_model = ddp.prepare(make_tiny_gpt(SEED + 1, BLOCK))
    ddp.save_state(directory)
    saved = ddp.get_state_dict(saved_model)
    differences = {}
    for layout in layouts:
        accelerator = Accelerator(cpu=True, parallelism=layout)
        model = accelerator.prepare(build(real=False))
        accelerator.load_state(directory)
        full = accelerator.get_state_dict(model)
        if dist.get_rank() == 0:
            differences[layout] = max((full[k] - saved[k]).abs().max().item() for k in saved)
    return differences


def errors() -> dict[str, str]:
    """Inconsistent builds are refused on every process, before any work."""
    found = {}
    torch.manual_seed(SEED)
    model = make_tiny_gpt(SEED, BLOCK)
    if dist.get_rank() == 1:
        model.lm_head.to(device="meta")  # lm_head.weight alone on meta (its tie to wte breaks), the rest real
    try:
        Accelerator(cpu=True, parallelism="zero3").prepare(model)
    except ValueError as error:
        found["partial"] = str(error)
    with init_empty_weights():
        model = make_tiny_gpt(SEED, BLOCK)
    if dist.get_rank() == 1:
        model = make_tiny_gpt(SEED, BLOCK)
    try:
        Accelerator(cpu=True, parallelism="zero3").prepare(model)
    except ValueError as error:
        found["real_off_zero"] = str(error)
    with init_empty_weights():  # a parameter the model's init does not reach, on the last stage only
        model = make_tiny_gpt(SEED, BLOCK)
        model.lm_head.extra = torch.nn.Parameter(torch.empty(3))
    try:
        Accelerator(cpu=True, parallelism="pp_size=2").prepare(model)
    except ValueError as error:
        found["unset_on_one_stage"] = str(error)
    return found


def main() -> None:
    out = Path(sys.argv[1])
    state = PartialState(cpu=True)
    if "--own-init-only" in sys.argv:
        start = time.perf_counter()
        report = {"own_init": own_init((*LAYOUTS[:3], PP_TP))}
        # the other source of values: process 0's weights, broadcast into the pipeline x TP shards
        full, _ = train(PP_TP, real=state.process_index == 0)
        report["seconds"] = time.perf_counter() - start
        if state.is_main_process:  # the full state dict is gathered on process 0
            expected = reference()
            report["from_process_0"] = {
                "max_abs_diff": max((full[k] - expected[k]).abs().max().item() for k in expected),
                "keys_match": sorted(full) == sorted(expected),
            }
            out.write_text(json.dumps(report, indent=1))
        return
    start = time.perf_counter()
    report: dict = {"memory": memory_report(), "layouts": {}, "seconds": {}}
    report["seconds"]["memory"] = time.perf_counter() - start
    expected = reference()
    for layout in LAYOUTS:
        start = time.perf_counter()
        full, loss = train(layout, real=state.process_index == 0)
        (first, tied_equal), (second, _) = initialised(layout), initialised(layout)
        report["seconds"][layout] = time.perf_counter() - start
        if state.is_main_process:
            report["layouts"][layout] = {
                "max_abs_diff": max((full[k] - expected[k]).abs().max().item() for k in expected),
                "keys_match": sorted(full) == sorted(expected),
                "loss": loss,
                "init_finite": all(bool(torch.isfinite(v).all()) for v in first.values()),
                "init_deterministic": all(torch.equal(first[k], second[k]) for k in first),
                "init_differs_from_zero": all(
                    bool(v.abs().sum() > 0) for k, v in first.items() if "weight" in k
                ),
                "init_tied_copies_equal": tied_equal,
            }
    with tempfile.TemporaryDirectory() as tmp:
        directory = [str(Path(tmp) / "ddp")]
        dist.broadcast_object_list(directory, src=0)
        report["resumed_from_ddp"] = resumed_into(LAYOUTS[:3], directory[0])
        dist.barrier()
    report["errors"] = _gathered_errors(errors())
    start = time.perf_counter()
    report["own_init"] = own_init(LAYOUTS)
    report["seconds"]["own_init"] = time.perf_counter() - start
    if state.is_main_process:
        out.write_text(json.dumps(report, indent=1))


def _gathered_errors(found: dict[str, str]) -> list[dict[str, str]]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return everyone


if __name__ == "__main__":
    main()
