"""Launched worker: sharded checkpoints (unison.checkpoint.sharded) saved and loaded across layouts.

    sharded_checkpoint_worker.py OUT_DIR

On 2 processes it trains a tiny GPT (examples/gpt/model.py, AdamW) under several layouts, built with
torch's own engines directly (apply_zero for ZeRO-3, DDP + ZeroRedundancyOptimizer for ZeRO-1,
parallelize_module for tensor parallel, a pipeline stage emulated by keeping one half of the model's
modules under their original names), saves `SAVE_AT` steps through `save_training_state` into OUT_DIR
and loads the checkpoints under other layouts with `load_training_state`. `Run` holds what the
Accelerator hands to training_state (a TrainingParts of one model and its optimizer).

Next to each checkpoint process 0 writes `<name>_expected.pt`: the full model state dict and the full,
parameter-name-keyed optimizer state at the save, which every load is compared with (the 4-process
run of this script and the single-process test load the 2-process checkpoints too).

Process 0 writes `report_<world size>.json` into OUT_DIR.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_gpt import make_tiny_gpt
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from unison import PartialState
from unison.checkpoint import CheckpointError, TrainingParts, load_training_state, save_training_state
from unison.checkpoint.weights import consolidated_state_dict, save_consolidated_weights, save_model_weights
from unison.optim import AcceleratedOptimizer
from unison.parallel.ddp import unwrap
from unison.parallel.zero import apply_zero, shard_optimizer_state

SAVE_AT = 2  # optimizer steps before the save
MORE = 2  # steps after it, with and without the save/load in between
GLOBAL_BATCH = 4
BLOCK = 16
SEED = 1234


class Run(TrainingParts):
    """One model and its optimizer, handed to training_state as the Accelerator hands its parts."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        schedulers = [] if scheduler is None else [scheduler]
        super().__init__(models=[model], optimizers=[AcceleratedOptimizer(optimizer)], schedulers=schedulers)

    @property
    def model(self) -> nn.Module:
        return self.models[0]

    @property
    def optimizer(self) -> AcceleratedOptimizer:
        return self.optimizers[0]

    def step_schedule(self) -> None:
        """What the loop does after each optimizer step: the scheduler (if any) sets the next rate."""
        for scheduler in self.schedulers:
            scheduler.step()


# -- layouts ---------------------------------------------------------------------------------------
def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def plain() -> Run:
    model = make_tiny_gpt(SEED, BLOCK)
    return Run(model, adamw(model.parameters()))


def ddp() -> Run:
    model = DistributedDataParallel(make_tiny_gpt(SEED, BLOCK))
    return Run(model, adamw(model.parameters()))


def zero1() -> Run:
    model = apply_zero(make_tiny_gpt(SEED, BLOCK), 1)
    return Run(model, shard_optimizer_state(adamw(model.parameters())))


def zero1_scheduled() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """ZeRO-1 as prepare() builds it: the scheduler is the user's, built on the user's optimizer, and
    reaches the ZeroRedundancyOptimizer only through the param-group dicts the two share."""
    model = apply_zero(make_tiny_gpt(SEED, BLOCK), 1)
    user = adamw(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(user, lambda step: 0.5**step)
    return model, shard_optimizer_state(user), scheduler


def zero3() -> Run:
    model = apply_zero(make_tiny_gpt(SEED, BLOCK), 3)
    return Run(model, adamw(model.parameters()))


_TP_MESH = None
TP_PLAN = {
    "mlp.c_fc": ColwiseParallel(),
    "mlp.c_proj": RowwiseParallel(),
    "attn.c_proj": RowwiseParallel(input_layouts=Replicate()),  # its input (attention's output) is whole
}


def tensor_parallel() -> Run:
    """The MLPs and the attention output projection split over all processes (c_attn replicated)."""
    global _TP_MESH
    if _TP_MESH is None:
        _TP_MESH = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = make_tiny_gpt(SEED, BLOCK)
    for block in model.transformer.h:
        parallelize_module(block, _TP_MESH, TP_PLAN)
    # foreach kernels refuse a mix of DTensor and plain parameters
    return Run(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False))


def zero3_x_tensor_parallel() -> Run:
    """4 processes on a (dp 2, tp 2) mesh: tensor parallel inside each pair, ZeRO-3 across the pairs."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = make_tiny_gpt(SEED, BLOCK)
    for block in model.transformer.h:
        parallelize_module(block, mesh["tp"], TP_PLAN)
    model = apply_zero(model, 3, mesh=mesh["dp"])
    return Run(model, adamw(model.parameters()))


def pipeline_stage(stage: int) -> Run:
    """Stage 0: embeddings + block 0; stage 1: block 1, final norm, head. Original parameter names."""
    model = make_tiny_gpt(SEED, BLOCK)
    if stage == 0:
        model.transformer.h[1] = nn.Identity()
        model.transformer.ln_f = nn.Identity()
        model.lm_head = nn.Identity()
    else:
        model.transformer.wte = nn.Identity()
        model.transformer.wpe = nn.Identity()
        model.transformer.h[0] = nn.Identity()
    model.tied_names = [("transformer.wte.weight", "lm_head.weight")]  # as unison's PipelineModel names them
    return Run(model, adamw(model.parameters()))


# -- training --------------------------------------------------------------------------------------
def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(
        0, 32, (count, GLOBAL_BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(SEED)
    )
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def train(run: Run, steps: range, split: bool) -> None:
    """`steps` optimizer steps on the global batches; split: each process takes its share of a batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world if split else GLOBAL_BATCH
    for x, y in batches(steps.stop)[steps.start :]:
        if split:
            x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        run.model(x, y)[1].backward()
        run.optimizer.step()
        run.step_schedule()
        run.optimizer.zero_grad()


def train_pipeline_stage(run: Run, reference: Run, steps: range) -> None:
    """Emulated pipeline training: the stage's parameters get the gradients the whole model computes."""
    grads_of = dict(reference.model.named_parameters(remove_duplicate=False))
    for x, y in batches(steps.stop)[steps.start :]:
        reference.model(x, y)[1].backward()
        for name, param in run.model.named_parameters():
            param.grad = grads_of[name].grad.clone()
        reference.optimizer.step()
        run.optimizer.step()
        reference.optimizer.zero_grad()
        run.optimizer.zero_grad()


# -- what to compare -------------------------------------------------------------------------------
def full_optimizer_state(run: Run) -> dict:
    """This process's optimizer state keyed by parameter name, unsharded (ZeRO-1: its own share)."""
    inner = run.optimizer.optimizer
    inner = getattr(inner, "optim", inner)
    module = unwrap(run.model)
    state = get_optimizer_state_dict(module, inner, options=StateDictOptions(full_state_dict=True))
    return {name: {k: v.cpu() for k, v in values.items()} for name, values in state["state"].items()}


def local_tensors(run: Run) -> dict[str, torch.Tensor]:
    """Everything this process holds, as it holds it (local shards): parameters and optimizer state."""
    out = {}
    for name, param in unwrap(run.model).named_parameters():
        out[f"param.{name}"] = (param.to_local() if isinstance(param, DTensor) else param).detach().clone()
    inner = run.optimizer.optimizer
    inner = getattr(inner, "optim", inner)
    index = {id(p): name for name, p in unwrap(run.model).named_parameters()}
    for param, values in inner.state.items():
        for key, value in values.items():
            out[f"state.{index[id(param)]}.{key}"] = (
                value.to_local() if isinstance(value, DTensor) else value
            ).clone()
    return out


def diff(got: dict, want: dict) -> dict:
    """{"keys_match", "equal", "max_abs_diff"} of two flat or nested dicts of tensors."""

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    got, want = flat(got), flat(want)
    if sorted(got) != sorted(want):
        return {
            "keys_match": False,
            "equal": False,
            "max_abs_diff": None,
            "only_got": sorted(set(got) - set(want))[:5],
            "only_want": sorted(set(want) - set(got))[:5],
        }
    delta = max((got[k].double() - want[k].double()).abs().max().item() for k in want)
    return {
        "keys_match": True,
        "equal": all(torch.equal(got[k], want[k]) for k in want),
        "max_abs_diff": delta,
    }


def subset(tree: dict, keys) -> dict:
    return {k: tree[k] for k in keys}


def expected_at_save(run: Run, path: Path) -> dict:
    """Full model and optimizer state now; written by process 0 next to the checkpoint."""
    model = consolidated_state_dict(run.model, all_ranks=True)  # may share memory with the live model
    expected = {
        "model": {key: value.clone() for key, value in model.items()},
        "optimizer": gather_optimizer_state(full_optimizer_state(run)),
        "lr": run.optimizer.param_groups[0]["lr"],
    }
    if dist.get_rank() == 0:
        torch.save(expected, path)
    return expected


def compare_loaded(run: Run, expected: dict) -> dict:
    """The loaded run's full model state and its optimizer state (this process's share for ZeRO-1)."""
    model = consolidated_state_dict(run.model, all_ranks=True)
    optimizer = full_optimizer_state(run)
    return {
        "model": diff(model, expected["model"]),
        "optimizer": diff(optimizer, subset(expected["optimizer"], optimizer)),
        "optimizer_params": sorted(optimizer),
        "lr": run.optimizer.param_groups[0]["lr"],
    }


# -- the scenarios ---------------------------------------------------------------------------------
def two_processes(out: Path) -> dict:
    report: dict = {}
    steps, more = range(SAVE_AT), range(SAVE_AT, SAVE_AT + MORE)

    # ZeRO-3: save at SAVE_AT, then the same layout resumes bit-exactly
    run = zero3()
    train(run, steps, split=True)
    save_training_state(run, out / "zero3")
    zero3_expected = expected_at_save(run, out / "zero3_expected.pt")
    train(run, more, split=True)
    uninterrupted = local_tensors(run)
    resumed = zero3()
    load_training_state(resumed, out / "zero3")
    report["zero3_to_zero3_loaded"] = compare_loaded(resumed, zero3_expected)
    report["zero3_counters"] = resumed.optimizer.num_steps_taken
    save_consolidated_weights(resumed.model, out / "weights_zero3")
    train(resumed, more, split=True)
    report["zero3_resume"] = diff(local_tensors(resumed), uninterrupted)

    # ZeRO-3 -> tensor parallel 2, DDP 2 and ZeRO-1 2
    tp = tensor_parallel()
    load_training_state(tp, out / "zero3")
    report["zero3_to_tp"] = compare_loaded(tp, zero3_expected)
    report["tp_has_dtensors"] = any(isinstance(p, DTensor) for p in tp.model.parameters())
    save_consolidated_weights(tp.model, out / "weights_tp")
    for name, build in (("ddp", ddp), ("zero1", zero1)):
        target = build()
        load_training_state(target, out / "zero3")
        report[f"zero3_to_{name}"] = compare_loaded(target, zero3_expected)
        train(target, more, split=True)  # and it trains on like the uninterrupted ZeRO-3 run
        report[f"zero3_to_{name}_then_trained"] = diff(
            consolidated_state_dict(target.model, all_ranks=True),
            consolidated_state_dict(run.model, all_ranks=True),
        )
    # ... and into pipeline stages: the head (stage 1) finds the tied embedding's optimizer state
    target = pipeline_stage(dist.get_rank())
    load_training_state(target, out / "zero3")
    tied = {
        **zero3_expected["optimizer"],
        "lm_head.weight": zero3_expected["optimizer"]["transformer.wte.weight"],
    }
    report["zero3_to_pipeline"] = compare_loaded(
        target, {"model": zero3_expected["model"], "optimizer": tied}
    )
    if dist.get_rank() == 0:  # what one process writes for the same weights
        single = make_tiny_gpt(SEED, BLOCK)
        single.load_state_dict(zero3_expected["model"])
        save_model_weights(single, out / "weights_plain")

    # ZeRO-1 with a scheduler: saved after its step (the inner optimizer has the previous rate until the
    # next optimizer step), its own resume, and its checkpoint into ZeRO-3
    run = Run(*zero1_scheduled())
    train(run, steps, split=True)
    save_training_state(run, out / "zero1")
    zero1_expected = expected_at_save(run, out / "zero1_expected.pt")
    train(run, more, split=True)
    uninterrupted = local_tensors(run)
    resumed = Run(*zero1_scheduled())
    load_training_state(resumed, out / "zero1")
    report["zero1_resumed_lr"] = resumed.optimizer.param_groups[0]["lr"]
    train(resumed, more, split=True)
    report["zero1_resume"] = diff(local_tensors(resumed), uninterrupted)
    target = zero3()
    load_training_state(target, out / "zero1")
    report["zero1_to_zero3"] = compare_loaded(target, zero1_expected)

    # DDP (plain files) -> ZeRO-3
    run = ddp()
    train(run, steps, split=True)
    save_training_state(run, out / "ddp")
    ddp_expected = expected_at_save(run, out / "ddp_expected.pt")
    target = zero3()
    load_training_state(target, out / "ddp")
    report["ddp_files"] = sorted(p.name for p in (out / "ddp").iterdir())
    report["ddp_to_zero3"] = compare_loaded(target, ddp_expected)
    model, optimizer, scheduler = zero1_scheduled()  # the DDP run saved no scheduler
    target = Run(model, optimizer)  # ZeroRedundancyOptimizer reads a plain optimizer state dict itself
    load_training_state(target, out / "ddp")
    report["ddp_to_zero1"] = compare_loaded(target, ddp_expected)
    scheduler.step()  # the rate the next step takes: the user's scheduler still sets it
    report["ddp_to_zero1_scheduled_lr"] = [target.optimizer.param_groups[0]["lr"], scheduler.get_last_lr()[0]]

    # tensor parallel: its own resume
    run = tensor_parallel()
    train(run, steps, split=False)
    save_training_state(run, out / "tp")
    train(run, more, split=False)
    uninterrupted = local_tensors(run)
    resumed = tensor_parallel()
    load_training_state(resumed, out / "tp")
    train(resumed, more, split=False)
    report["tp_resume"] = diff(local_tensors(resumed), uninterrupted)

    # a plain run's optimizer state is keyed by position: it does not fit a stage's optimizer
    target = pipeline_stage(dist.get_rank())
    before = local_tensors(target)
    try:
        load_training_state(target, out / "ddp")
        report["ddp_to_pipeline"] = "loaded"
    except CheckpointError as error:
        report["ddp_to_pipeline"] = str(error)
    report["ddp_to_pipeline_untouched"] = diff(local_tensors(target), before)["equal"]

    # pipeline stages: each process holds half of the keys
    reference, stage = plain(), pipeline_stage(dist.get_rank())
    train_pipeline_stage(stage, reference, steps)
    save_training_state(stage, out / "pipeline")
    if dist.get_rank() == 0:
        torch.save(
            {
                "model": reference.model.state_dict(),
                "optimizer": full_optimizer_state(reference),
                "lr": reference.optimizer.param_groups[0]["lr"],
            },
            out / "pipeline_expected.pt",
        )
    resumed = pipeline_stage(dist.get_rank())
    load_training_state(resumed, out / "pipeline")
    report["pipeline_to_pipeline"] = diff(local_tensors(resumed), local_tensors(stage))
    gathered = consolidated_state_dict(stage.model)
    if dist.get_rank() == 0:
        report["pipeline_consolidated"] = diff(gathered, reference.model.state_dict())
        report["pipeline_tied"] = gathered["lm_head.weight"] is gathered["transformer.wte.weight"]
        save_model_weights(reference.model, out / "weights_pipeline_plain")
    save_consolidated_weights(stage.model, out / "weights_pipeline")
    report["pipeline_rank_keys"] = len(stage.model.state_dict())
    report["pipeline_files"] = sorted(p.name for p in (out / "pipeline").iterdir())

    # a damaged shard is refused, naming the file, before anything is applied
    if dist.get_rank() == 0:
        shutil.copytree(out / "zero3", out / "zero3_damaged")
        shard = out / "zero3_damaged" / "model_0" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    target = zero3()
    before = local_tensors(target)
    try:
        load_training_state(target, out / "zero3_damaged")
        report["damaged"] = "loaded"
    except CheckpointError as error:
        report["damaged"] = str(error)
    report["damaged_untouched"] = diff(local_tensors(target), before)["equal"]
    return report


def gather_optimizer_state(mine: dict) -> dict:
    """The union of every process's optimizer state (ZeRO-1: each holds its share of the parameters)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: values for piece in everyone for name, values in piece.items()}


def four_processes(out: Path) -> dict:
    report = {}
    zero3_expected = torch.load(out / "zero3_expected.pt", weights_only=True)
    zero1_expected = torch.load(out / "zero1_expected.pt", weights_only=True)
    for source, expected in (("zero3", zero3_expected), ("zero1", zero1_expected)):
        for name, build in (("zero3", zero3), ("zero1", zero1)):
            target = build()
            load_training_state(target, out / source)
            report[f"{source}_to_{name}"] = compare_loaded(target, expected)
    target = zero3_x_tensor_parallel()
    load_training_state(target, out / "zero3")
    report["zero3_to_zero3_x_tp"] = compare_loaded(target, zero3_expected)
    return report


def main() -> None:
    state = PartialState()
    out = Path(sys.argv[1])
    report = two_processes(out) if state.num_processes == 2 else four_processes(out)
    everyone = [None] * state.num_processes
    dist.all_gather_object(everyone, report)
    if state.is_main_process:
        (out / f"report_{state.num_processes}.json").write_text(json.dumps({"ranks": everyone}, indent=1))


if __name__ == "__main__":
    main()
