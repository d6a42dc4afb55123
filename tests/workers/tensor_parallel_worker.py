"""Launched worker: tensor parallel (unison.parallel.tensor) against a single-process reference.

Each run trains a tiny model for STEPS steps on a global batch of GLOBAL_BATCH sequences, then compares
the consolidated state dict (`get_model_state_dict(..., full_state_dict=True)`) with the same model
trained alone on the whole batch (computed here, once per model and optimizer). Every rank of a TP
group reads the same rows; with dp_shard x tp the dp ranks read different halves.

At 2 processes (tp=2): the GPT example (fused c_attn, tied wte/lm_head) with SGD+momentum and AdamW,
sequence parallel, loss parallel, both, accumulation 2, a user plan, the built-in plan with a plain
ColwiseParallel on c_attn (must NOT match: the fused q|k|v split matters), a Llama-like model (RMSNorm,
separate q/k/v with grouped key/value heads, rotary positions, SwiGLU), and a DCP checkpoint saved under
TP=2 and loaded into a plain model. At 4 processes: tp=4 on a 4-head GPT, dp_shard=2 x tp=2 with ZeRO-3
and ZeRO-2 (+ accumulation 2 with sequence and loss parallel, + DCP), and the head-count error; then
tp_plan_pipeline_worker.py's run (a user plan under pp=2 x tp=2), its files in OUT's folder's
plan_pipeline/.

Memory (AdamW, fp32, pure TP): per-rank bytes of parameters + gradients + AdamW moments from the local
shards, with the parameters the plan leaves replicated (norms, row-parallel biases) counted in full.

Process 0 writes a JSON report to the path given as the first argument.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from tiny_gpt import gpt_model, llama_model, local_bytes, make_optimizer, make_tiny_gpt, unique_params
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

from unison import PartialState
from unison.checkpoint import sharded
from unison.parallel.ddp import skip_gradient_sync
from unison.parallel.fused import keep_user_layout_in_optimizer
from unison.parallel.tensor import apply_tensor_parallel, tensor_parallel_plan, total_grad_norm
from unison.parallel.zero import apply_zero

STEPS = 5
GLOBAL_BATCH = 4
BLOCK = 16
VOCAB = 32
SEED = 1234


# ---------------------------------------------------------------------------------------------------
# Models


class TinyLlama(llama_model.LlamaForCausalLM):
    """The example Llama (Hugging Face's module names): 4 query heads sharing 2 key/value heads."""

    def __init__(self):
        super().__init__(
            llama_model.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                rope_theta=10000.0,
            )
        )


def make_model(name: str) -> nn.Module:
    if name == "gpt":
        return make_tiny_gpt(SEED, BLOCK)
    torch.manual_seed(SEED)
    if name == "gpt4heads":
        config = gpt_model.GPTConfig(block_size=BLOCK, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32)
        return gpt_model.GPT(config)
    return TinyLlama()


def mlp_only_plan() -> dict:
    """A user plan: only the MLPs split, attention and embeddings replicated."""
    return {
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
    }


def naive_fused_plan() -> dict:
    """The built-in plan with a plain column split of the fused q|k|v: wrong heads on each rank."""
    plan = tensor_parallel_plan(make_model("gpt"))
    plan["transformer.h.*.attn.c_attn"] = ColwiseParallel()
    return plan


# ---------------------------------------------------------------------------------------------------
# Training


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, BLOCK + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


_references: dict[tuple[str, str], tuple[nn.Module, torch.optim.Optimizer]] = {}


def reference_run(model_name: str, optimizer_name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer trained alone on the whole batch (once per pair)."""
    key = (model_name, optimizer_name)
    if key not in _references:
        model = make_model(model_name)
        optimizer = make_optimizer(optimizer_name, model.parameters())
        for x, y in batches():
            model(x, y)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        _references[key] = model, optimizer
    return _references[key]


def reference(model_name: str, optimizer_name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in reference_run(model_name, optimizer_name)[0].state_dict().items()}


def memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes; the optimizer's scalar `step` counters are not per-parameter state."""
    params = unique_params(model)
    moments = sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for key, value in state.items()
        if key != "step" and isinstance(value, torch.Tensor)
    )
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params),
        "optimizer": moments,
    }


def train(model, optimizer, rows: slice, accumulation: int, use_loss_parallel: bool, sharded_dp: bool):
    """STEPS steps; returns the memory held just after the last optimizer step."""
    held = {}
    for x, y in batches():
        x, y = x[rows], y[rows]
        micro = x.size(0) // accumulation
        for k in range(accumulation):
            part = slice(k * micro, (k + 1) * micro)
            final = k == accumulation - 1
            skip = skip_gradient_sync(model) if sharded_dp and not final else contextlib.nullcontext()
            # the loss (inside forward) and its backward both need the loss-parallel context
            with skip, loss_parallel() if use_loss_parallel else contextlib.nullcontext():
                loss = model(x[part], y[part])[1] / accumulation
                loss.backward()
        optimizer.step()
        held = memory(model, optimizer)
        optimizer.zero_grad()
    return held


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def run(
    spec: dict, meshes: dict, rank_in_dp: int, dp_size: int
) -> tuple[dict, nn.Module, torch.optim.Optimizer]:
    start = time.perf_counter()
    model_name = spec.get("model", "gpt")
    model = make_model(model_name)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = spec["plan"]() if "plan" in spec else None
    apply_tensor_parallel(
        model,
        meshes["tp"],
        plan=plan,
        sequence_parallel=spec.get("sp", False),
        loss_parallel=spec.get("lp", False),
    )
    result: dict = {}
    if model_name.startswith("gpt"):
        attn = model.transformer.h[0].attn.c_attn
        result["tied"] = model.transformer.wte.weight is model.lm_head.weight
        result["c_attn_is_dtensor"] = isinstance(attn.weight, DTensor)
        if isinstance(attn.weight, DTensor):
            # stored as a plain Shard(0) of its rows permuted so that each rank holds [q_r|k_r|v_r]; the
            # state dict gives the ORIGINAL matrix back
            result["c_attn_placements"] = str(attn.weight.placements)
            state = model.state_dict()
            weight, bias = "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"
            result["c_attn_state_equals_original"] = torch.equal(
                state[weight].full_tensor(), initial[weight]
            ) and torch.equal(state[bias].full_tensor(), initial[bias])
            result["c_attn_parameter_is_permuted"] = not torch.equal(
                attn.weight.full_tensor(), initial[weight]
            )
    if spec.get("zero"):
        apply_zero(model, spec["zero"], mesh=meshes["dp_shard"])
    per_rank = GLOBAL_BATCH // dp_size
    rows = slice(rank_in_dp * per_rank, (rank_in_dp + 1) * per_rank)
    optimizer_name = spec.get("optimizer", "sgd")
    optimizer = make_optimizer(optimizer_name, model.parameters())
    keep_user_layout_in_optimizer(optimizer)  # as prepare() does
    result["memory"] = train(
        model, optimizer, rows, spec.get("acc", 1), spec.get("lp", False), bool(spec.get("zero"))
    )
    full = full_state(model)
    result["seconds"] = time.perf_counter() - start
    expected = reference(model_name, optimizer_name)
    result["keys_match"] = sorted(full) == sorted(expected)
    result["max_abs_diff"] = max_diff(full, expected)
    return result, model, optimizer


def check_dcp_into_plain_model(model: nn.Module, model_name: str, directory: Path, rank: int) -> dict:
    """DCP-save the sharded state on every rank; process 0 loads it into a plain model, no process group."""
    dcp.save(get_model_state_dict(model), checkpoint_id=directory)
    full = full_state(model)
    dist.barrier()
    result = {}
    if rank == 0:
        plain = make_model(model_name)
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=directory, no_dist=True)
        result = {"keys_match": sorted(state) == sorted(full), "max_abs_diff": max_diff(state, full)}
    dist.barrier()
    return result


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    return {k: v for k, v in state.items() if k.startswith("state.") and not k.endswith(".step")}


def check_checkpoints_cross_layouts(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> dict:
    """The AdamW GPT trained under tp=2 (fused c_attn rows permuted in its parameters) saved through
    unison's DCP parts, read on every rank into a plain model and optimizer (no process group); and
    the plain reference's model and optimizer, saved by process 0 alone, loaded into a fresh tp=2
    model and optimizer. Each must equal what was saved bit for bit, in the original layout."""
    sharded.save_model_state(model, directory / "tp_model")
    sharded.save_optimizer_state(model, optimizer, directory / "tp_optimizer")
    reference_model, reference_optimizer = reference_run("gpt", "adamw")
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    if dist.get_rank() == 0:
        dcp.save(get_model_state_dict(reference_model), checkpoint_id=directory / "plain_model", no_dist=True)
        state = get_optimizer_state_dict(reference_model, reference_optimizer, options=flat)
        dcp.save(state, checkpoint_id=directory / "plain_optimizer", no_dist=True)
    dist.barrier()
    result = {}
    # tp=2 -> plain
    plain = make_model("gpt")
    plain_optimizer = make_optimizer("adamw", plain.parameters())
    model_state = get_model_state_dict(plain)
    dcp.load(model_state, checkpoint_id=directory / "tp_model", no_dist=True)
    optimizer_state = get_optimizer_state_dict(plain, plain_optimizer, options=flat)
    dcp.load(optimizer_state, checkpoint_id=directory / "tp_optimizer", no_dist=True)
    saved_optimizer = full_optimizer_state(model, optimizer)
    result["tp_to_plain_model"] = max_diff(model_state, full_state(model))
    result["tp_to_plain_optimizer"] = max_diff(optimizer_state, saved_optimizer)
    # the state is the original layout's, not the parameters' permuted rows: near the plain run's
    result["tp_optimizer_vs_reference"] = max_diff(
        saved_optimizer, full_optimizer_state(reference_model, reference_optimizer)
    )
    # plain -> tp=2
    tp_model = apply_tensor_parallel(make_model("gpt"), model.transformer.h[0].attn.c_attn.weight.device_mesh)
    tp_optimizer = make_optimizer("adamw", tp_model.parameters())
    keep_user_layout_in_optimizer(tp_optimizer)
    sharded.apply_model_state(tp_model, sharded.read_model_state(tp_model, directory / "plain_model"))
    loaded = sharded.read_optimizer_state(tp_model, tp_optimizer, directory / "plain_optimizer")
    sharded.apply_optimizer_state(tp_model, tp_optimizer, loaded)
    result["plain_to_tp_model"] = max_diff(full_state(tp_model), reference("gpt", "adamw"))
    result["plain_to_tp_optimizer"] = max_diff(
        full_optimizer_state(tp_model, tp_optimizer),
        full_optimizer_state(reference_model, reference_optimizer),
    )
    return result


def error_of(action) -> str | None:
    """The message of the ValueError `action` raises (None if it raises none)."""
    try:
        action()
    except ValueError as error:
        return str(error)
    return None


def check_grad_norm(meshes: dict, rank_in_dp: int, dp_size: int, zero: int | None) -> dict:
    """total_grad_norm over a TP (x FSDP) model against the plain model's norm, after one backward."""
    x, y = batches()[0]
    plain = make_model("gpt")
    plain(x, y)[1].backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in unique_params(plain)]))
    model = apply_tensor_parallel(make_model("gpt"), meshes["tp"])
    if zero:
        apply_zero(model, zero, mesh=meshes["dp_shard"])
    rows = slice(rank_in_dp * GLOBAL_BATCH // dp_size, (rank_in_dp + 1) * GLOBAL_BATCH // dp_size)
    model(x[rows], y[rows])[1].backward()
    return {"got": total_grad_norm(model.parameters()).item(), "want": want.item()}


def collectives_per_step(model: nn.Module) -> dict:
    """Collectives one forward + backward of the GPT under TP issues (for the guide's table), and
    under "fused" those issued inside the fused q|k|v projections (their weights must not move)."""
    x, y = batches()[0]
    with CommDebugMode() as comm:
        model(x, y)[1].backward()
    model.zero_grad()
    counts = {str(op).rsplit(".", 1)[-1]: count for op, count in comm.get_comm_counts().items()}
    fused: dict[str, int] = {}  # "pass op" -> count inside the c_attn modules
    for module, passes in comm.comm_module_counts.items():
        if module.endswith("c_attn"):
            for step, ops in passes.items():
                for op, count in ops.items():
                    key = f"{step} {str(op).rsplit('.', 1)[-1]}"
                    fused[key] = fused.get(key, 0) + count
    counts["fused"] = fused
    return counts


# ---------------------------------------------------------------------------------------------------


def two_processes(rank: int, out_dir: Path) -> dict:
    meshes = {"tp": init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]}
    specs = {
        "gpt_sgd": {},
        "gpt_adamw": {"optimizer": "adamw"},
        "gpt_sgd_sp": {"sp": True},
        "gpt_sgd_lp": {"lp": True},
        "gpt_adamw_sp_lp": {"optimizer": "adamw", "sp": True, "lp": True},
        "gpt_sgd_acc2": {"acc": 2},
        "gpt_sgd_user_plan": {"plan": mlp_only_plan},
        "gpt_sgd_naive_fused": {"plan": naive_fused_plan},
        "llama_sgd": {"model": "llama"},
        "llama_adamw_sp_lp": {"model": "llama", "optimizer": "adamw", "sp": True, "lp": True},
    }
    extra = {
        "flags_with_plan_error": error_of(
            lambda: apply_tensor_parallel(
                make_model("gpt"), meshes["tp"], plan=mlp_only_plan(), sequence_parallel=True
            )
        ),
        "grad_norm": check_grad_norm(meshes, 0, 1, zero=None),
    }
    runs = {}
    for name, spec in specs.items():
        runs[name], model, optimizer = run(spec, meshes, 0, 1)
        if name == "gpt_adamw":
            extra["checkpoints"] = check_checkpoints_cross_layouts(model, optimizer, out_dir / "cross")
        if name == "gpt_sgd":
            extra["dcp_tp2_to_plain"] = check_dcp_into_plain_model(model, "gpt", out_dir / "dcp_tp2", rank)
            extra["collectives"] = collectives_per_step(model)
        if name == "gpt_sgd_sp":
            extra["collectives_sp"] = collectives_per_step(model)
    return {"runs": runs, **extra}


def four_processes(rank: int, out_dir: Path) -> dict:
    tp4 = {"tp": init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))["tp"]}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dp_tp = {"tp": mesh["tp"], "dp_shard": mesh["dp_shard"]}
    dp_rank = mesh["dp_shard"].get_local_rank()
    extra = {
        # n_head=2 cannot be split 4 ways: refused on every rank before any communication
        "heads_error": error_of(lambda: apply_tensor_parallel(make_model("gpt"), tp4["tp"])),
        "mesh_2d_error": error_of(lambda: apply_tensor_parallel(make_model("gpt"), mesh)),
        "grad_norm": check_grad_norm(dp_tp, dp_rank, 2, zero=3),
    }
    runs = {}
    for name, spec in {
        "tp4_sgd": {"model": "gpt4heads"},
        "tp4_adamw": {"model": "gpt4heads", "optimizer": "adamw"},
    }.items():
        runs[name], _, _ = run(spec, tp4, 0, 1)
    for name, spec in {
        "dp2_tp2_zero3_sgd": {"zero": 3},
        "dp2_tp2_zero3_adamw": {"zero": 3, "optimizer": "adamw"},
        "dp2_tp2_zero2_sgd": {"zero": 2},
        "dp2_tp2_zero3_sgd_acc2_sp_lp": {"zero": 3, "acc": 2, "sp": True, "lp": True},
    }.items():
        runs[name], model, _ = run(spec, dp_tp, dp_rank, 2)
        if name == "dp2_tp2_zero3_sgd":
            extra["dcp_dp2_tp2_to_plain"] = check_dcp_into_plain_model(
                model, "gpt", out_dir / "dcp_dp2_tp2", rank
            )
    return {"runs": runs, **extra}


def replicated_numel(model: nn.Module) -> int:
    """Parameters the built-in GPT plan leaves whole on every rank: LayerNorms and row-parallel biases."""
    return sum(
        p.numel() for name, p in model.named_parameters() if ".ln_" in name or name.endswith("c_proj.bias")
    )


def main() -> None:
    state = PartialState()
    rank, world = state.process_index, state.num_processes
    out = Path(sys.argv[1])
    mine = two_processes(rank, out.parent) if world == 2 else four_processes(rank, out.parent)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        gpt = make_model("gpt")
        out.write_text(
            json.dumps(
                {
                    "world": world,
                    "parameters": sum(p.numel() for p in unique_params(gpt)),
                    "replicated_parameters": replicated_numel(gpt),
                    "ranks": everyone,
                }
            )
        )
    if world == 4:
        import tp_plan_pipeline_worker

        (out.parent / "plan_pipeline").mkdir(exist_ok=True)
        tp_plan_pipeline_worker.run(out.parent / "plan_pipeline")


if __name__ == "__main__":
    main()
