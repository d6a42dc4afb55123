"""fp16 with its loss scaler under pipeline parallelism, as Megatron-LM runs it.

The last stage backpropagates the loss times the scaler's scale, every stage unscales its own
gradients, and the found-inf flag is all-reduced (MAX) over the processes, so that every stage skips a
step, or takes it, together (and the scheduler with it).

One launch of tests/workers/pipeline_fp16_worker.py (2 processes, pp_size=2: 1F1B, GPipe, interleaved)
runs the unison loop with clipping, accumulation 2 and a per-step LambdaLR, against one process of
plain torch with torch.autocast(fp16) and torch.amp.GradScaler("cpu") on the same micro-batches.

Tolerance: fp16 rounding makes any two correct fp16 runs differ (other micro-batch boundaries, other
summation orders), so the bound is measured in the same run, as in tests/test_mixed_precision_sharded.py:
the pipeline must be no further from the one-process fp16 run than 2x that run's distance to the same
loop in fp32 (measured: 0.03-0.1x; the distance itself was 8-9e-5 after 4-8 steps).
"""

from __future__ import annotations

import json

import pytest
from launching import WORKERS, launch_ok
from pipeline_fp16_worker import RUNS


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_fp16") / "report.json"
    launch_ok(WORKERS / "pipeline_fp16_worker.py", 2, out, *RUNS)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", RUNS)
def test_fp16_pipeline_trains_as_one_process_under_autocast_and_grad_scaler(report, name):
    run = report["runs"][name]
    assert "error" not in run, run
    noise = run["fp16_vs_fp32_one_process"]  # what fp16 alone changes one process
    assert 0 < noise < 1e-3, run
    assert run["vs_fp16"] <= 2 * noise, run
    assert run["vs_fp32"] <= 2 * noise, run
    assert run["loss_diff"] < 1e-4, run
    assert run["lr"] == pytest.approx(run["expected_lr"]), run  # the scheduler skipped what torch skipped
    # the scaler's decisions, window by window, on both stages: those of the one-process scaler
    for rank in (0, 1):
        assert run["skipped"][rank] == run["expected_skipped"], run
        assert run["scales"][rank] == run["expected_scales"], run
        assert run["changed"][rank] == [not skipped for skipped in run["expected_skipped"]], run


def test_an_overflow_in_one_stage_skips_the_step_on_every_stage(report):
    run = report["runs"]["1f1b_overflow"]
    assert "error" not in run, run
    own, skipped = run["own_overflow"], run["skipped"]
    # the first window overflows in the first stage only (the second's gradients are finite) ...
    assert own[0][0] and not own[1][0], run
    # ... and both skip it, leave their parameters and halve their scale, as the one-process scaler does
    assert skipped[0][0] and skipped[1][0] and not run["changed"][0][0] and not run["changed"][1][0], run
    assert run["scales"][0][0] == run["scales"][1][0] == 7 * 2.0**16 / 2, run
    assert 2 <= sum(run["expected_skipped"]) < len(run["expected_skipped"]), run  # some skipped, not all


def test_the_scaler_agrees_on_an_overflow_of_one_rank(report):
    """LayoutGroupedGradScaler.agree_across_processes alone: rank 1's gradient holds an inf, rank 0's
    not; neither steps, and both halve the scale."""
    assert report["one_sided_overflow"] == {"unchanged": [True, True], "scales": [2.0, 2.0]}
