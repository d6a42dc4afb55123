"""Accelerator training through real launched processes, judged against single-process references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import launch_ok

WORKER = Path(__file__).parent / "workers" / "training_worker.py"
TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=["2proc", "3proc"])
def results(request, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp(f"training{request.param}")
    launch_ok(WORKER, request.param, str(out_dir))
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(request.param)]


def test_every_rank_reports(results):
    assert [r["rank"] for r in results] == list(range(len(results)))
    assert all(r["num_processes"] == len(results) for r in results)


def test_ddp_matches_single_process_with_the_global_batch(results):
    for rank_result in results:
        for run in rank_result["runs"]:
            assert run["diff_vs_global_batch"] < TOLERANCE, run


def test_ddp_matches_single_process_with_accumulation(results):
    for rank_result in results:
        for run in rank_result["runs"]:
            assert run["diff_vs_accumulation"] < TOLERANCE, run


def test_no_sync_inside_window_and_sync_at_its_end(results):
    for rank_result in results:
        for run in rank_result["runs"]:
            assert all(run["grads_agree_at_sync"]) and len(run["grads_agree_at_sync"]) == 5
            if run["accumulation"] == 1:
                assert run["grads_agree_inside_window"] == []
            else:
                # Each rank saw different samples, so un-synchronised gradients must differ.
                assert run["grads_agree_inside_window"] == [False] * 5


def test_scheduler_steps_once_per_optimizer_step(results):
    for rank_result in results:
        for run in rank_result["runs"]:
            assert run["optimizer_steps"] == 5
            assert run["scheduler_last_epoch"] == 5
            assert run["lr"] == pytest.approx((0.1 if run["optimizer"] == "sgd" else 1e-2) * 0.9**5)


def test_last_batch_of_loader_always_syncs(results):
    for rank_result in results:
        assert rank_result["end_of_loader_sync"] == [False, True, True]


def test_a_window_cut_short_by_the_loader_averages_its_own_micro_batches(results):
    """5 rounds at accumulation 3: the second update is the mean over its 2 micro-batches (r/k of it
    before), equal to one process on each window's samples in one batch."""
    for rank_result in results:
        assert rank_result["short_final_window"]["diff"] < 1e-6, rank_result["short_final_window"]


def test_gather_for_metrics_returns_exactly_the_dataset(results):
    for rank_result in results:
        assert rank_result["gather_for_metrics"]["tensor_rows_equal_dataset"]
        assert rank_result["gather_for_metrics"]["object_rows"] == list(range(0, 26, 2))
        # a list of tensors is a structure like a tuple: each tensor's rows are cut, not the list
        assert rank_result["gather_for_metrics"]["list_of_tensors"] == [
            [float(i) for i in range(0, 26, 2)],
            [float(i) for i in range(1, 26, 2)],
        ]


def test_gather_for_metrics_after_the_loop_returns_each_sample_once(results):
    """Each process concatenates its results and gathers once after the loop: the repeats that topped
    up the final round (at the end of each process's rows) are dropped, whoever dealt the data."""
    dataset = list(range(13))
    for rank_result in results:
        n, after = rank_result["num_processes"], rank_result["gather_after_the_loop"]
        for name in ("shard", "split", "dispatched", "iterable_shard"):
            assert after[name]["rows_here"] == -(-13 // (2 * n)) * 2, name  # repeats included
            assert after[name]["after"] == dataset, name
            assert after[name]["per_batch"] == dataset, name  # per batch: unchanged, in order
        shapes = after["shapes"]
        assert shapes["structure"] == {"pred": dataset, "label": [i + 100 for i in dataset]}
        assert shapes["objects"] == dataset
        assert shapes["scalar"] == n  # a length that fits no pass is gathered whole
        assert shapes["one_row_short"] == n * (after["shard"]["rows_here"] - 1)
        assert after["nested"] == dataset
        assert after["one_after_the_other"] == [dataset, list(range(16))]
        rows = after["shard"]["rows_here"]
        assert after["unprepared_after_per_batch"] == [n * rows, n * rows]  # every row of every process


def test_gather_for_metrics_after_two_loops_of_one_length_keeps_all_rows_and_warns_once(results):
    """The 13's and the 16's passes held as many rows per process, with other repeats: gathered after
    both loops, the results cannot be told apart, so every row comes back (as in Accelerate) with one
    warning on the main process that names the numbers and the fix."""
    for rank_result in results:
        n, after = rank_result["num_processes"], rank_result["gather_after_the_loop"]
        rows = after["both_loops_first"]["rows_here"]
        assert after["both_loops_first"]["first"] == n * rows
        if rank_result["rank"] != 0:
            assert after["warnings"] == []
            continue
        (warning,) = after["warnings"]
        assert f"got {rows} rows per process" in warning and f"all {n * rows} gathered rows" in warning
        assert "on each batch inside the evaluation loop" in warning, warning


def test_get_state_dict_unwrap_false_keeps_the_wrappers_keys(results):
    keys = results[0]["state_dict_keys"]  # the main process receives the consolidated dict
    assert keys["unwrapped"] and not any(key.startswith("module.") for key in keys["unwrapped"])
    assert keys["wrapped"] == keys["wrapper_state_dict"] == sorted("module." + k for k in keys["unwrapped"])
    assert keys["same_values"]


def test_bad_input_raises_on_every_rank(results):
    for rank_result in results:
        errors = rank_result["errors"]
        assert errors["ddp_kwargs_under_fsdp"].startswith("ValueError"), errors["ddp_kwargs_under_fsdp"]
        assert "find_unused_parameters=True" in errors["ddp_kwargs_under_fsdp"]
        assert "dp_shard=" in errors["ddp_kwargs_under_fsdp"] and "FSDP2" in errors["ddp_kwargs_under_fsdp"]
        under_tp = errors["ddp_kwargs_under_tp"]
        assert under_tp.startswith("ValueError") and "find_unused_parameters=True" in under_tp, under_tp
        assert "tp=" in under_tp and "no data-parallel replicas" in under_tp, under_tp
        assert (
            errors["accumulation_zero"].startswith("ValueError")
            and "gradient_accumulation_steps=0" in errors["accumulation_zero"]
        )
        assert errors["unknown_precision"].startswith("ValueError") and "'fp8'" in errors["unknown_precision"]
        assert (
            errors["conflicting_precision"].startswith("ValueError")
            and "bf16" in errors["conflicting_precision"]
        )
        assert (
            errors["unsupported_object"].startswith("TypeError")
            and "builtins.str" in errors["unsupported_object"]
        )
        assert (
            errors["prepared_twice"].startswith("ValueError")
            and "already prepared" in errors["prepared_twice"]
        )
