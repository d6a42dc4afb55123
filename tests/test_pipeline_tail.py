"""Pipeline parallelism over an epoch whose last batch is short (drop_last=False, PyTorch's default).

One launch of tests/workers/pipeline_tail_worker.py (2 processes, pp_size=2): the ordinary unison loop
with accumulation 2, clipping, a scheduler that changes the lr every step and an evaluation loader with
the same short tail, against the same loop done by hand on one model. The tail runs in a schedule of
its own, cut into equal micro-batches (`microbatches_for`, tested here in-process). With data-parallel
replicas of the pipeline and even_batches=False, a loader whose last round is short is refused at
prepare() (`check_loader_rounds_even` of parallel/join.py, in-process here).
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import WORKERS, launch_ok
from pipeline_tail_worker import RUNS
from torch.utils.data import DataLoader, TensorDataset

from unison.parallel.config import ParallelismConfig
from unison.parallel.join import check_loader_rounds_even
from unison.parallel.pipeline import microbatches_for


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_tail") / "report.json"
    launch_ok(WORKERS / "pipeline_tail_worker.py", 2, out, *RUNS)
    return json.loads(out.read_text())["runs"]


@pytest.mark.parametrize("name", RUNS)
def test_a_short_last_batch_trains_and_evaluates_as_one_process(report, name):
    run = report[name]
    assert "error" not in run, run
    samples = RUNS[name][1]
    windows = -(-samples // 8)  # batches of 4, accumulation 2: the last window may hold one
    assert run["batches"] == -(-samples // 4) and run["lr"] == pytest.approx(0.5 / (1 + windows)), run
    assert run["max_abs_diff"] < 1e-6, run  # SGD+momentum, parameter for parameter
    assert run["loss_diff"] < (1e-4 if name.endswith("items") else 1e-6), run  # summed losses: ~30 tokens
    assert run["norm_diff"] < 1e-5, run  # what clip_grad_norm_ returned in each window
    assert run["eval_diff"] < 1e-6, run  # forward_loss of every evaluation batch, the short one too
    assert 0 < run["clipped"] < windows, run  # clipping acted in some windows, not in all


@pytest.mark.parametrize(
    ("rows", "micro_rows", "pp_size", "interleaved", "expected"),
    [
        (4, 2, 2, False, 2),  # the regular batch: its own micro-batch count
        (2, 2, 2, False, 1),  # 18 samples in 4s, 2 micro-batches: the tail of 2 in one
        (2, 1, 2, False, 2),  # 2 samples, 4 micro-batches of 1: 2 micro-batches
        (3, 2, 2, False, 3),  # 3 samples, micro-batches of 2: 3 of 1, not 1 of 3 (more memory)
        (6, 4, 2, False, 2),
        (5, 2, 2, True, 1),  # interleaved: 5 would run in 2 rounds, which 5 does not divide
        (7, 8, 4, True, 1),
    ],
)
def test_microbatches_for_a_short_batch(rows, micro_rows, pp_size, interleaved, expected):
    assert microbatches_for(rows, micro_rows, pp_size, interleaved) == expected


def loader(samples: int, drop_last: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(samples, 2)), batch_size=4, drop_last=drop_last)


def test_unequal_last_batches_across_pipeline_replicas_are_refused():
    layout = ParallelismConfig(pp_size=2, dp_shard_size=2).validate(4)
    with pytest.raises(
        ValueError, match=r"18 samples in batches of 4 end on a round of 2 samples, not 8"
    ) as error:
        check_loader_rounds_even(loader(18), layout, False)
    assert "pp=2" in str(error.value) and "dp_shard=2" in str(error.value)
    assert "even_batches=True" in str(error.value) and "drop_last=True" in str(error.value)
    with pytest.raises(ValueError, match="round of 2 samples, not 4"):  # split_batches: 4 is the global batch
        check_loader_rounds_even(loader(18), layout, True)
    with pytest.raises(ValueError, match="round of 6 samples, not 8.*last batches differ in size"):
        check_loader_rounds_even(loader(14), layout, False)  # 2 batches each, but one of 2 rows
    check_loader_rounds_even(loader(16), layout, False)  # even rounds
    check_loader_rounds_even(loader(18, drop_last=True), layout, False)  # the short round is dropped
