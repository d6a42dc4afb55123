"""Launched worker: pipeline parallelism (unison.parallel.pipeline) against a single-process reference.

Every run trains a tiny GPT (examples/gpt/model.py, tied wte/lm_head) for STEPS steps on a batch of
BATCH sequences, split into micro-batches by the pipeline schedule, and compares with the same model
trained alone on the whole batch (computed here, in every process): the parameters this rank holds,
the loss `step` returns on every rank, the gradient norm over `norm_parameters`, and the tied copies of
wte/lm_head on the first and last stage (equal to each other, bit for bit).

argv[1]: JSON report path (written by process 0); argv[2]: "pp" (2 processes: schedules, splits,
accumulation, DCP, errors) or "mesh" (4 processes: pp=4, and pp=2 x dp=2 with FSDP2 on each stage).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from tiny_gpt import gpt_model, make_optimizer, make_tiny_gpt
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from unison import PartialState
from unison.parallel.pipeline import build_pipeline, split_model

STEPS = 5
BATCH = 8
BLOCK = 16
SEED = 1234
TIED = ("transformer.wte.weight", "lm_head.weight")


def make_model(n_layer: int) -> torch.nn.Module:
    if n_layer == 2:
        return make_tiny_gpt(SEED, BLOCK)
    torch.manual_seed(SEED)
    config = gpt_model.GPTConfig(block_size=BLOCK, vocab_size=32, n_layer=n_layer, n_head=2, n_embd=32)
    return gpt_model.GPT(config)


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    """The GPT returns (logits, None): the loss reads output[0]."""
    return F.cross_entropy(output[0].flatten(0, 1), target.flatten())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 32, (STEPS, BATCH, BLOCK + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


_REFERENCES: dict = {}


def reference(n_layer: int, optimizer_name: str) -> dict:
    """Parameters after STEPS steps, the loss of every step, the first step's gradient norm, eval loss."""
    key = (n_layer, optimizer_name)
    if key not in _REFERENCES:
        model = make_model(n_layer)
        optimizer = make_optimizer(optimizer_name, model.parameters())
        losses, grad_norm = [], None
        for x, y in batches():
            loss = loss_fn(model(x), y)
            loss.backward()
            if grad_norm is None:
                grad_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        x, y = batches()[0]
        _REFERENCES[key] = {
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": losses,
            "grad_norm": grad_norm,
            "eval_loss": loss_fn(model(x), y).item(),
        }
    return _REFERENCES[key]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tied_copies_diff(model: torch.nn.Module) -> float | None:
    """Largest difference between the copies of the tied weight on the ranks of this pipeline (all
    processes of the world take part; None where the layout holds one copy)."""
    state = model.state_dict()
    mine = [full(state[k]).detach() for k in TIED if k in state]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    copies = [t for ts in everyone for t in ts]
    if len(copies) < 2:
        return None
    return max((c - copies[0]).abs().max().item() for c in copies)


def train(
    n_layer: int,
    schedule: str,
    microbatches: int,
    optimizer_name: str = "sgd",
    accumulation: int = 1,
    split_points: list[str] | None = None,
    pp_mesh=None,
    dp_mesh=None,
) -> tuple[dict, torch.nn.Module]:
    """One pipeline training run; with a dp mesh, FSDP2 shards each stage and each dp rank reads its
    share of the batch."""
    group = pp_mesh.get_group() if pp_mesh is not None else dist.group.WORLD
    pp_rank, pp_size = dist.get_rank(group), dist.get_world_size(group)
    stages = split_model(make_model(n_layer), pp_rank, pp_size, split_points, schedule)
    dp_rank, dp_size = 0, 1
    if dp_mesh is not None:  # ZeRO-3 on each stage: every block, then the stage's root
        dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
        for _, stage in stages:
            for block in stage.transformer.h:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(stage, mesh=dp_mesh)
    model = build_pipeline(stages, pp_mesh, schedule, microbatches)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    losses, grad_norm = [], None
    rows = BATCH // dp_size
    for x, y in batches():
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
        chunk = rows // accumulation
        step_loss = 0.0
        for k in range(accumulation):
            part = slice(k * chunk, (k + 1) * chunk)
            step_loss += model.step(x[part], y[part], loss_fn, divide_by=accumulation).item() / accumulation
        if dp_size > 1:  # the mean over dp ranks, as the reference sees the whole batch
            step_loss = torch.tensor(step_loss)
            dist.all_reduce(step_loss, group=dp_mesh.get_group())
            step_loss = step_loss.item() / dp_size
        if grad_norm is None:  # each weight counted once over the pipeline ranks
            squares = sum(full(p.grad).pow(2).sum() for p in model.norm_parameters())
            dist.all_reduce(squares, group=group)
            grad_norm = squares.sqrt().item()
        losses.append(step_loss)
        optimizer.step()
        optimizer.zero_grad()
    expected = reference(n_layer, optimizer_name)
    state = {k: full(v).detach() for k, v in model.state_dict().items()}
    x, y = batches()[0]
    if dp_size > 1:
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
    eval_loss = model.evaluate(x, y, loss_fn).item()
    report = {
        "schedule_class": type(model.schedule).__name__,
        "stage_indices": [s.stage_index for s in model.stage_modules],
        "keys": sorted(state),
        "max_abs_diff": max((state[k] - expected["state"][k]).abs().max().item() for k in state),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, expected["losses"])),
        "grad_norm_diff": abs(grad_norm - expected["grad_norm"]),
        "tied_copies_diff": tied_copies_diff(model),
        "eval_loss_diff": None if dp_size > 1 else abs(eval_loss - expected["eval_loss"]),
        "full_keys": sorted(expected["state"]),
    }
    return report, model


def dcp_round_trip(model: torch.nn.Module, folder: Path) -> dict:
    """PP state -> DCP -> plain model, and plain model -> DCP -> PP state (the sgd/2-layer reference)."""
    expected = reference(2, "sgd")["state"]
    dcp.save(model.state_dict(), checkpoint_id=folder / "from_pp")
    plain = make_model(2)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=folder / "from_pp")
    plain.load_state_dict(state)
    into_plain = max((v - expected[k]).abs().max().item() for k, v in plain.state_dict().items())

    trained = make_model(2)
    trained.load_state_dict(expected)
    dcp.save(trained.state_dict(), checkpoint_id=folder / "from_plain")
    fresh = build_pipeline(split_model(make_model(2), dist.get_rank(), 2), None, "1f1b", 2)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=folder / "from_plain")
    fresh.load_state_dict(state)
    into_pp = max((v - expected[k]).abs().max().item() for k, v in fresh.state_dict().items())
    return {"into_plain": into_plain, "into_pp": into_pp}


def error_messages(model: torch.nn.Module) -> dict:
    """Errors raised by every rank before any communication (a rank that went on would hang)."""
    x, y = batches()[0]
    messages = {}
    fresh = build_pipeline(split_model(make_model(2), dist.get_rank(), 2), None, "1f1b", 2)
    attempts = {
        # the first call fixes the regular batch size; only later batches (a short last one) may differ
        "indivisible": lambda: fresh.step(x[:7], y[:7], loss_fn),
        "shape_change": lambda: model.step(x[:, :8], y[:, :8], loss_fn),  # another sequence length
        "direct_call": lambda: model(x),
        "interleaved_microbatches": lambda: build_pipeline(
            split_model(make_model(4), dist.get_rank(), 2, schedule="interleaved"), None, "interleaved", 5
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except (ValueError, RuntimeError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def run_pp(folder: Path) -> dict:
    runs = {}
    for schedule, m in (("gpipe", 2), ("1f1b", 1), ("1f1b", 2), ("1f1b", 4)):
        runs[f"{schedule}_m{m}_sgd"], model = train(2, schedule, m)
        if (schedule, m) == ("gpipe", 2):
            runs["dcp"] = dcp_round_trip(model, folder)
    runs["1f1b_m4_adamw"], _ = train(2, "1f1b", 4, "adamw")
    runs["1f1b_m2_sgd_acc2"], _ = train(2, "1f1b", 2, accumulation=2)
    runs["gpipe_m2_adamw_acc2"], _ = train(2, "gpipe", 2, "adamw", accumulation=2)
    runs["interleaved_m2_sgd"], _ = train(4, "interleaved", 2)
    runs["interleaved_m4_adamw"], _ = train(4, "interleaved", 4, "adamw")
    runs["split_h3_sgd"], model = train(4, "1f1b", 2, split_points=["transformer.h.3"])
    runs["balanced_4layer_sgd"], _ = train(4, "1f1b", 2)
    runs["errors"] = error_messages(model)
    return runs


def ddp_refusal(pp_mesh, dp_mesh) -> str | None:
    stages = split_model(make_model(2), pp_mesh.get_local_rank(), 2)
    wrapped = [(i, DistributedDataParallel(s, process_group=dp_mesh.get_group())) for i, s in stages]
    try:
        build_pipeline(wrapped, pp_mesh, "1f1b", 2)
    except TypeError as error:
        return str(error)
    return None


def run_mesh() -> dict:
    runs = {"pp4_1f1b_m4_sgd": train(4, "1f1b", 4)[0]}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    for optimizer_name in ("sgd", "adamw"):
        runs[f"pp2_fsdp2_{optimizer_name}"], _ = train(
            2, "1f1b", 2, optimizer_name, pp_mesh=mesh["pp"], dp_mesh=mesh["dp_shard"]
        )
    runs["ddp_refused"] = ddp_refusal(mesh["pp"], mesh["dp_shard"])
    return runs


def main() -> None:
    state = PartialState()
    out = Path(sys.argv[1])
    runs = run_pp(out.parent) if sys.argv[2] == "pp" else run_mesh()
    everyone = [None] * state.num_processes
    dist.all_gather_object(everyone, runs)
    if state.process_index == 0:
        out.write_text(json.dumps({"world": state.num_processes, "ranks": everyone}))


if __name__ == "__main__":
    main()
