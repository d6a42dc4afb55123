"""Sharded checkpoints (unison.checkpoint.sharded) across layouts, and consolidated weights from any layout.

One 2-process launch of tests/workers/sharded_checkpoint_worker.py saves checkpoints under ZeRO-3,
ZeRO-1, DDP and pipeline stages (gloo, CPU) and loads them under other layouts; one 4-process launch
loads the 2-process checkpoints; this process loads them once more, alone (no process group), through
an Accelerator. Every load is compared with the full state written at the save (`*_expected.pt`).
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from launching import WORKERS, launch_ok
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_gpt import make_tiny_gpt
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from unison import Accelerator
from unison.checkpoint import MANIFEST_NAME, CheckpointError, sharded
from unison.checkpoint.weights import consolidated_state_dict, save_consolidated_weights

WORKER = WORKERS / "sharded_checkpoint_worker.py"
SEED, BLOCK = 1234, 16  # the worker's model
ZERO1_LR_AT_SAVE = 1e-2 * 0.5**2  # the worker's ZeRO-1 run: lr 1e-2, halved by its scheduler after 2 steps


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    launch_ok(WORKER, 2, out)
    return out


@pytest.fixture(scope="module")
def two(saved):
    return json.loads((saved / "report_2.json").read_text())["ranks"]


@pytest.fixture(scope="module")
def four(saved):
    launch_ok(WORKER, 4, saved)
    return json.loads((saved / "report_4.json").read_text())["ranks"]


def assert_loaded_exactly(result: dict, context) -> None:
    for part in ("model", "optimizer"):
        assert result[part]["keys_match"] and result[part]["equal"], (context, part, result[part])


def test_same_layout_resume_is_bit_exact(two):
    """Saved at step 2 and resumed, two more steps: every shard and optimizer state torch.equal to the
    run that never stopped (ZeRO-3, ZeRO-1 and tensor parallel on 2 processes; pipeline stages load
    their own state back)."""
    for rank, report in enumerate(two):
        assert_loaded_exactly(report["zero3_to_zero3_loaded"], rank)
        assert report["zero3_counters"] == 2
        assert report["pipeline_to_pipeline"]["equal"], (rank, report["pipeline_to_pipeline"])
        for layout in ("zero3", "zero1", "tp"):
            assert report[f"{layout}_resume"]["keys_match"], (rank, layout)
            assert report[f"{layout}_resume"]["equal"], (rank, layout, report[f"{layout}_resume"])


def test_zero3_checkpoint_loads_under_tensor_parallel_ddp_zero1_and_pipeline_stages(two):
    for rank, report in enumerate(two):
        assert report["tp_has_dtensors"]
        for layout in ("tp", "ddp", "zero1", "pipeline"):
            assert_loaded_exactly(report[f"zero3_to_{layout}"], (rank, layout))
        for layout in ("ddp", "zero1"):  # and training goes on as the uninterrupted ZeRO-3 run
            trained = report[f"zero3_to_{layout}_then_trained"]
            assert trained["keys_match"] and trained["max_abs_diff"] < 1e-6, (rank, layout, trained)
        # ZeRO-1: each process holds the optimizer state of its share of the parameters
        shares = [set(r["zero3_to_zero1"]["optimizer_params"]) for r in two]
        assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 28


def test_zero1_resumes_the_rate_its_scheduler_set_and_a_loaded_zero1_still_follows_its_scheduler(two):
    """ZeroRedundancyOptimizer hands a scheduler's rate to its inner optimizer only at the next step: the
    checkpoint, written between the two, must hold the scheduler's rate, not the one of the step before.
    And a ZeRO-1 optimizer that loads a plain file keeps reading the group dicts the user's scheduler
    writes into (torch's load_state_dict replaces them)."""
    for rank, report in enumerate(two):
        assert report["zero1_resumed_lr"] == ZERO1_LR_AT_SAVE, rank
        assert report["zero1_resume"]["equal"], (rank, report["zero1_resume"])
        assert report["zero1_to_zero3"]["lr"] == ZERO1_LR_AT_SAVE, rank
        assert report["ddp_to_zero1_scheduled_lr"] == [5e-3, 5e-3], rank


def test_zero1_and_plain_ddp_checkpoints_load_into_zero3_and_zero1(two):
    for rank, report in enumerate(two):
        assert_loaded_exactly(report["zero1_to_zero3"], rank)
        assert_loaded_exactly(report["ddp_to_zero3"], rank)
        assert_loaded_exactly(report["ddp_to_zero1"], rank)
        # DDP keeps the plain single-file format
        assert report["ddp_files"] == [
            "counters.pt",
            MANIFEST_NAME,
            "model_0.pt",
            "optimizer_0.pt",
            "rng_state_0.pt",
            "rng_state_1.pt",
        ]


def test_plain_optimizer_state_into_a_pipeline_stage_is_refused_before_anything_is_applied(two):
    for report in two:
        assert "parameter groups of [28] parameters" in report["ddp_to_pipeline"], report["ddp_to_pipeline"]
        assert report["ddp_to_pipeline_untouched"]


def test_files_on_disk_are_one_dcp_file_per_process_listed_in_the_manifest(saved):
    manifest = json.loads((saved / "zero3" / MANIFEST_NAME).read_text())
    for part in ("model_0", "optimizer_0"):
        for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
            assert f"{part}/{name}" in manifest["files"], (part, name)
    assert "model_0.pt" not in manifest["files"]
    assert manifest["metadata"]["world_size"] == 2


def test_four_processes_load_two_process_checkpoints(four):
    for rank, report in enumerate(four):
        for source in ("zero3", "zero1"):
            for target in ("zero3", "zero1"):
                assert_loaded_exactly(report[f"{source}_to_{target}"], (rank, source, target))
        for target in ("zero3", "zero1"):  # the rate the ZeRO-1 run's scheduler had set at the save
            assert report[f"zero1_to_{target}"]["lr"] == ZERO1_LR_AT_SAVE, (rank, target)
        assert_loaded_exactly(report["zero3_to_zero3_x_tp"], rank)  # a 2-D (dp, tp) mesh
    shares = [set(r["zero3_to_zero1"]["optimizer_params"]) for r in four]
    assert sum(map(len, shares)) == 28 and len(set.union(*shares)) == 28


def test_pipeline_stages_hold_their_keys_and_consolidate_to_the_whole_model(two):
    assert [report["pipeline_rank_keys"] for report in two] == [
        14,
        15,
    ]  # embeddings + block 0 | block 1 + head
    assert two[0]["pipeline_consolidated"]["keys_match"] and two[0]["pipeline_consolidated"]["equal"]
    assert two[0]["pipeline_tied"]  # the embedding and the head, on two stages, are one tensor again
    assert "model_0" in two[0]["pipeline_files"] and "model_0.pt" not in two[0]["pipeline_files"]


def test_damaged_shard_is_refused_naming_the_file_before_anything_is_applied(two):
    for report in two:
        assert "zero3_damaged/model_0/__1_0.distcp does not match its checksums" in report["damaged"]
        assert report["damaged_untouched"]


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("source", ["zero3", "zero1", "pipeline"])
def test_one_process_loads_a_checkpoint_written_by_two(saved, source):
    accelerator = Accelerator(cpu=True)
    model = make_tiny_gpt(SEED, BLOCK)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.5))
    accelerator.load_state(saved / source)
    expected = torch.load(saved / f"{source}_expected.pt", weights_only=True)
    state = model.state_dict()
    assert sorted(state) == sorted(expected["model"])
    assert all(torch.equal(state[k], expected["model"][k]) for k in state)
    loaded = get_optimizer_state_dict(
        model, optimizer.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    assert loaded["param_groups"][0]["lr"] == expected["lr"]  # the saved hyper-parameters, not this run's
    for name, values in loaded["state"].items():
        for key, value in values.items():
            assert torch.equal(value, expected["optimizer"][name][key]), (name, key)
    assert accelerator.optimizer_steps == 2


@pytest.mark.parametrize(
    ("layout", "single"), [("zero3", "plain"), ("tp", "plain"), ("pipeline", "pipeline_plain")]
)
def test_consolidated_safetensors_equal_the_single_process_file(saved, layout, single):
    """From ZeRO-3, tensor parallel 2 and two pipeline stages: the file one process writes for the same
    weights (pipeline: the tied embedding and head, held by two stages, written once)."""
    plain = saved / f"weights_{single}" / "model.safetensors"
    sharded_file = saved / f"weights_{layout}" / "model.safetensors"
    want, got = load_file(plain), load_file(sharded_file)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    with safe_open(plain, "pt") as a, safe_open(sharded_file, "pt") as b:
        assert a.metadata() == b.metadata()
        assert len(a.keys()) == len(make_tiny_gpt(SEED, BLOCK).state_dict()) - 1  # tied weights once
    assert sharded_file.read_bytes() == plain.read_bytes()


# -- in this process ---------------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_state")
def test_optimizer_saved_before_its_first_step_keeps_no_state_and_restores_hyper_parameters(tmp_path):
    """torch's helper creates a fresh optimizer's state by a zero-learning-rate step (Adam's counter then
    reads 1); the save undoes it, and the load gives a fresh optimizer the saved hyper-parameters only."""
    model = make_tiny_gpt(SEED, BLOCK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.123)
    sharded.save_optimizer_state(model, optimizer, tmp_path / "optimizer")
    assert not optimizer.state
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    loaded = sharded.read_optimizer_state(model, fresh, tmp_path / "optimizer")
    assert not loaded.has_state and not fresh.state  # read: nothing applied yet
    sharded.apply_optimizer_state(model, fresh, loaded)
    assert fresh.param_groups[0]["lr"] == 0.123 and not fresh.state


@pytest.mark.usefixtures("fresh_state")
def test_metadata_that_would_run_code_is_refused(tmp_path):
    model = make_tiny_gpt(SEED, BLOCK)
    sharded.save_model_state(model, tmp_path / "model")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "model" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"io\.open is not part of a DCP checkpoint's metadata"):
        sharded.read_model_state(model, tmp_path / "model")
    assert not marker.exists()


@pytest.mark.usefixtures("fresh_state")
def test_one_process_layouts_and_consolidated_state(tmp_path):
    model = make_tiny_gpt(SEED, BLOCK)
    optimizer = torch.optim.AdamW(model.parameters())
    (layout,) = sharded.model_layouts([model], [optimizer])
    assert layout == sharded.ModelLayout(sharded=False, optimizers=(0,))
    state = consolidated_state_dict(model)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # tied, as in state_dict()
    path = save_consolidated_weights(model, tmp_path)
    assert sorted(load_file(path)) == sorted(k for k in state if k != "transformer.wte.weight")
