"""Tensor parallel (unison.parallel.tensor): fidelity to a single-process reference, memory, checkpoints.

One launch of tests/workers/tensor_parallel_worker.py on 2 processes (tp=2) and one on 4 (tp=4, and
dp_shard=2 x tp=2 under ZeRO-3 and ZeRO-2, then a user plan under pp=2 x tp=2); the checks below read
their reports. Plan detection and
the errors raised before any communication are tested in-process.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from launching import WORKERS, launch_ok
from tensor_parallel_worker import TinyLlama
from tiny_gpt import gpt_model, make_tiny_gpt
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from unison.parallel.tensor import FusedColwiseParallel, check_tensor_parallel, tensor_parallel_plan

BLOCK = 16
TOLERANCE = {"sgd": 1e-5, "adamw": 1e-4}  # SGD+momentum tight; Adam amplifies rounding (engine notes)


def _launch(tmp_path_factory, nproc: int) -> dict:
    out = tmp_path_factory.mktemp(f"tp{nproc}") / "report.json"
    launch_ok(WORKERS / "tensor_parallel_worker.py", nproc, out)
    return {**json.loads(out.read_text()), "plan_pipeline": out.parent / "plan_pipeline"}


@pytest.fixture(scope="module")
def report2(tmp_path_factory):
    return _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def report4(tmp_path_factory):
    return _launch(tmp_path_factory, 4)


def _check_run(report: dict, name: str) -> None:
    tolerance = TOLERANCE["adamw" if "adamw" in name else "sgd"]
    for rank, everything in enumerate(report["ranks"]):
        run = everything["runs"][name]
        assert run["keys_match"], (rank, name, run)
        assert run["max_abs_diff"] < tolerance, (rank, name, run)
        if "tied" in run:  # the GPT: wte and lm_head stay one parameter
            assert run["tied"], (rank, name, run)
        if run.get("c_attn_is_dtensor"):
            # the fused q|k|v is a plain row split of its permuted rows; its state dict is the original
            assert run["c_attn_placements"] == "(Shard(dim=0),)", (rank, name, run)
            assert run["c_attn_parameter_is_permuted"], (rank, name, run)
            assert run["c_attn_state_equals_original"], (rank, name, run)


@pytest.mark.parametrize(
    "name",
    [
        "gpt_sgd",
        "gpt_adamw",
        "gpt_sgd_sp",
        "gpt_sgd_lp",
        "gpt_adamw_sp_lp",
        "gpt_sgd_acc2",
        "gpt_sgd_user_plan",
        "llama_sgd",
        "llama_adamw_sp_lp",
    ],
)
def test_tp2_matches_single_process_reference(report2, name):
    _check_run(report2, name)


@pytest.mark.parametrize(
    "name",
    [
        "tp4_sgd",
        "tp4_adamw",
        "dp2_tp2_zero3_sgd",
        "dp2_tp2_zero3_adamw",
        "dp2_tp2_zero2_sgd",
        "dp2_tp2_zero3_sgd_acc2_sp_lp",
    ],
)
def test_tp4_and_dp_by_tp_match_single_process_reference(report4, name):
    _check_run(report4, name)


def test_a_plain_column_split_of_the_fused_qkv_trains_a_different_model(report2):
    """The checks above can fail: with ColwiseParallel on c_attn, rank 0 takes q and half of k as heads."""
    for everything in report2["ranks"]:
        assert everything["runs"]["gpt_sgd_naive_fused"]["max_abs_diff"] > 1e-3


def test_user_plan_leaves_the_rest_replicated(report2):
    for everything in report2["ranks"]:
        assert everything["runs"]["gpt_sgd_user_plan"]["c_attn_is_dtensor"] is False


@pytest.mark.parametrize("key", ["dcp_tp2_to_plain", "dcp_dp2_tp2_to_plain"])
def test_dcp_checkpoint_loads_into_a_plain_model_in_the_original_layout(report2, report4, key):
    report = report2 if key in report2["ranks"][0] else report4
    loaded = report["ranks"][0][key]
    assert loaded["keys_match"], loaded
    assert loaded["max_abs_diff"] == 0.0, loaded


def test_the_fused_qkv_weight_never_moves(report2):
    """Inside the fused projections no collective runs in forward, and in backward only the all-reduce of
    their input's gradient (activations, as for every column-parallel layer): no all-gather or
    reduce-scatter of the weight or its gradient. (Redistributing the weight to torch's _StridedShard in
    every forward, as before, all-gathered it there in both passes: benchmarks/tp_traffic.py.)"""
    for everything in report2["ranks"]:
        fused = everything["collectives"]["fused"]
        assert fused == {"backward all_reduce": 2}, fused  # 2 layers
        assert everything["collectives"]["all_gather_into_tensor"] == 1  # the head's logits only


def test_checkpoints_of_permuted_fused_rows_move_between_tp_and_one_process(report2):
    """AdamW state and weights saved under tp=2 read into a plain model bit for bit (and the state is the
    original layout's: near the plain run's), and a plain run's load into tp=2 bit for bit."""
    for everything in report2["ranks"]:
        loaded = everything["checkpoints"]
        assert loaded["tp_to_plain_model"] == 0.0 and loaded["tp_to_plain_optimizer"] == 0.0, loaded
        assert loaded["plain_to_tp_model"] == 0.0 and loaded["plain_to_tp_optimizer"] == 0.0, loaded
        assert loaded["tp_optimizer_vs_reference"] < TOLERANCE["adamw"], loaded


@pytest.mark.parametrize("fixture, name, tp", [("report2", "gpt_adamw", 2), ("report4", "tp4_adamw", 4)])
def test_memory_per_rank_is_the_sharded_share_plus_what_stays_replicated(request, fixture, name, tp):
    """fp32 AdamW: 4 B param + 4 B grad + 8 B moments; the plan replicates only norms and row biases."""
    report = request.getfixturevalue(fixture)
    psi, replicated = report["parameters"], report["replicated_parameters"]
    per_rank = (psi - replicated) // tp + replicated
    for rank, everything in enumerate(report["ranks"]):
        memory = everything["runs"][name]["memory"]
        assert memory == {"params": 4 * per_rank, "grads": 4 * per_rank, "optimizer": 8 * per_rank}, rank
        ratio = sum(memory.values()) / (16 * psi / tp)  # design.md §3: ~16 Ψ / T
        assert 1.0 <= ratio < 1.05, (rank, ratio)


def test_sequence_parallel_turns_activation_all_reduces_into_reduce_scatters(report2):
    """One forward + backward: without SP, every row-parallel output is all-reduced; with SP it is
    reduce-scattered over the sequence, and the only all-reduces left are the norms' weight gradients
    (each rank saw a slice of the sequence)."""
    norm_tensors = sum(1 for name, _ in make_tiny_gpt(0, BLOCK).named_parameters() if ".ln_" in name)
    for everything in report2["ranks"]:
        plain, sequence = everything["collectives"], everything["collectives_sp"]
        assert plain.get("all_reduce", 0) > 0 and "reduce_scatter_tensor" not in plain, plain
        assert sequence.get("reduce_scatter_tensor", 0) > 0, sequence
        assert sequence.get("all_reduce", 0) == norm_tensors, sequence


@pytest.mark.parametrize("fixture", ["report2", "report4"])
def test_total_grad_norm_over_mixed_layouts_matches_the_plain_model(request, fixture):
    for everything in request.getfixturevalue(fixture)["ranks"]:
        norm = everything["grad_norm"]
        assert norm["got"] == pytest.approx(norm["want"], rel=1e-5), norm


def test_errors_raised_on_every_rank_before_communication(report2, report4):
    for everything in report2["ranks"]:
        assert "sequence_parallel=True" in everything["flags_with_plan_error"]
    for everything in report4["ranks"]:
        assert "tp=4" in everything["heads_error"] and "has 2" in everything["heads_error"]
        assert "mesh['tp']" in everything["mesh_2d_error"]


# ---------------------------------------------------------------------------------------------------
# In-process: plans and validation (no process group needed)


def test_gpt_plan_uses_the_fused_style_and_shards_the_tied_pair_over_the_vocabulary():
    plan = tensor_parallel_plan(make_tiny_gpt(0, BLOCK))
    assert set(plan) == {
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.*.attn.c_attn",
        "transformer.h.*.attn.c_proj",
        "transformer.h.*.mlp.c_fc",
        "transformer.h.*.mlp.c_proj",
        "lm_head",
    }
    assert type(plan["transformer.h.*.attn.c_attn"]) is FusedColwiseParallel
    assert plan["transformer.h.*.attn.c_attn"].parts == 3
    assert type(plan["transformer.wte"]) is RowwiseParallel and type(plan["lm_head"]) is ColwiseParallel
    assert plan["lm_head"].use_local_output and plan["lm_head"].output_layouts == (Replicate(),)


def test_sequence_and_loss_parallel_plans():
    plan = tensor_parallel_plan(make_tiny_gpt(0, BLOCK), sequence_parallel=True, loss_parallel=True)
    for norm in ("transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"):
        assert type(plan[norm]) is SequenceParallel
    for parent in ("transformer.h.*.attn", "transformer.h.*.mlp"):
        assert type(plan[parent]) is PrepareModuleInput
    assert plan["transformer.h.*.mlp.c_proj"].output_layouts == (Shard(1),)
    assert plan["transformer.wpe"].output_layouts == (Shard(0),)  # positions are a (T,) vector
    assert plan["lm_head"].output_layouts == (Shard(-1),) and not plan["lm_head"].use_local_output


def test_sequence_parallel_on_a_pipeline_stage_but_not_past_an_unknown_module():
    later_stage = make_tiny_gpt(0, BLOCK)  # a later pipeline stage: no embeddings, receives shards
    del later_stage.transformer["wte"], later_stage.transformer["wpe"]
    plan = tensor_parallel_plan(later_stage, sequence_parallel=True)
    assert "transformer.wte" not in plan and type(plan["transformer.ln_f"]) is SequenceParallel
    renamed = make_tiny_gpt(0, BLOCK)  # an embedding the layout does not know would see whole sequences
    renamed.transformer["tok"] = renamed.transformer.pop("wte")
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs.*transformer.tok"):
        tensor_parallel_plan(renamed, sequence_parallel=True)
    no_final_norm = make_tiny_gpt(0, BLOCK)
    del no_final_norm.transformer["ln_f"]
    with pytest.raises(ValueError, match="final_norm"):
        tensor_parallel_plan(no_final_norm, sequence_parallel=True)


def test_llama_plan_from_module_names():
    plan = tensor_parallel_plan(TinyLlama(), sequence_parallel=True)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert type(plan[f"model.layers.*.self_attn.{name}"]) is ColwiseParallel
    for name in ("gate_proj", "up_proj"):
        assert type(plan[f"model.layers.*.mlp.{name}"]) is ColwiseParallel
    assert type(plan["model.layers.*.self_attn.o_proj"]) is RowwiseParallel
    assert type(plan["model.layers.*.mlp.down_proj"]) is RowwiseParallel
    assert type(plan["model.layers.*.input_layernorm"]) is SequenceParallel
    assert type(plan["model.norm"]) is SequenceParallel
    assert type(plan["model.embed_tokens"]) is RowwiseParallel
    check_tensor_parallel(TinyLlama(), 2, plan)
    with pytest.raises(ValueError, match="tp=4 must divide the number of attention key/value heads"):
        check_tensor_parallel(TinyLlama(), 4)  # 4 query heads share 2 key/value heads


def test_model_without_a_known_layout_is_asked_for_a_plan():
    with pytest.raises(ValueError, match=r"matches no built-in layout.*tp_plan=\{"):
        tensor_parallel_plan(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))


def test_known_names_on_other_module_types_are_refused():
    class Conv1D(nn.Module):  # Hugging Face GPT-2's transposed Linear
        def __init__(self, n_out: int, n_in: int):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(n_in, n_out))

    model = make_tiny_gpt(0, BLOCK)
    for block in model.transformer.h:
        block.attn.c_attn = Conv1D(96, 32)
    with pytest.raises(ValueError, match="c_attn is a Conv1D.*nn.Linear"):
        tensor_parallel_plan(model)


def test_degree_must_divide_heads_and_every_split_size():
    model = make_tiny_gpt(0, BLOCK)  # 2 heads, width 32, vocabulary 32
    with pytest.raises(ValueError, match=r"tp=4 must divide the number of attention heads.*has 2.*\[1, 2\]"):
        check_tensor_parallel(model, 4)
    with pytest.raises(ValueError, match=r"tp=3 must divide every size.*transformer.h.0.attn.c_attn"):
        check_tensor_parallel(model, 3)
    odd_vocabulary = gpt_model.GPT(
        gpt_model.GPTConfig(block_size=BLOCK, vocab_size=33, n_layer=2, n_head=2, n_embd=32)
    )
    with pytest.raises(ValueError, match=r"transformer.wte .*num_embeddings \(vocabulary\) = 33.*50304"):
        check_tensor_parallel(odd_vocabulary, 2)
    # a user plan that leaves attention whole does not need tp to divide the heads
    mlp_only = {
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
    }
    assert set(check_tensor_parallel(model, 4, mlp_only)) == set(mlp_only)


def test_user_plan_errors():
    model = make_tiny_gpt(0, BLOCK)
    with pytest.raises(ValueError, match="'transformer.h.*.mlp.fc' matches no submodule"):
        check_tensor_parallel(model, 2, {"transformer.h.*.mlp.fc": ColwiseParallel()})
    with pytest.raises(TypeError, match="not a tensor-parallel plan"):
        check_tensor_parallel(model, 2, {"lm_head": "colwise"})
    with pytest.raises(ValueError, match="lm_head.weight and transformer.wte.weight are one tied parameter"):
        check_tensor_parallel(model, 2, {"lm_head": ColwiseParallel()})
    with pytest.raises(ValueError, match="parts=1"):
        FusedColwiseParallel(parts=1)


def test_a_user_plan_under_pipeline_parallelism_gives_each_stage_its_own_keys(report4):
    """pp=2 x tp=2 with a plan naming modules of both stages: every rank prepares (the first stage's
    key no longer fails the other stage) and the first step's loss is the one-process loss (in the
    4-process launch, after its runs: tests/workers/tp_plan_pipeline_worker.py)."""
    for rank in range(4):
        record = json.loads((report4["plan_pipeline"] / f"rank{rank}.json").read_text())
        assert abs(record["loss"] - record["reference"]) < 1e-5, record
