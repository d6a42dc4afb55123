"""Context parallelism (unison.parallel.context): cp_size alone and beside dp_shard, tp and dp_replicate,
trained through prepare() and maybe_context_parallel, against one process with the whole sequences.

Two launches of tests/workers/context_parallel_worker.py: 2 processes (cp=2, ZeRO-2 and -3 over cp) and
4 (dp_shard=2 x cp=2, tp=2 x cp=2, dp_replicate=2 x cp=2, one after the other). Refusals are tested
in-process.
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import WORKERS, launch_ok

from unison import Accelerator
from unison.parallel.apply import data_parallel_engine, fsdp_stage
from unison.parallel.config import ParallelismConfig
from unison.parallel.context import check_buffers

TOLERANCE = 1e-5  # SGD + momentum, 3 steps (engine notes: tight comparisons)
FOUR = ("dp_shard_size=2,cp_size=2", "tp_size=2,cp_size=2", "dp_replicate_size=2,cp_size=2+items")


def _launch(tmp_path_factory, nproc: int, *layouts: str) -> dict:
    out = tmp_path_factory.mktemp(f"cp{nproc}") / "report.json"
    launch_ok(WORKERS / "context_parallel_worker.py", nproc, out, *layouts)
    return json.loads(out.read_text())["ranks"]


@pytest.fixture(scope="module")
def report2(tmp_path_factory):
    return _launch(tmp_path_factory, 2, "cp_size=2", "cp_size=2,zero_stage=3", "cp_size=2+items")


@pytest.fixture(scope="module")
def report4(tmp_path_factory):
    return _launch(tmp_path_factory, 4, *FOUR)


def _check(ranks: list[dict], layout: str, cp_ranks: list[int], same_batch: list[list[int]]) -> None:
    runs = [rank[layout] for rank in ranks]
    main = runs[0]
    assert main["keys_match"], main
    assert main["max_abs_diff"] < TOLERANCE, main
    for index, run in enumerate(runs):
        if not layout.endswith("+items"):  # (with items, the losses are sums over each rank's part)
            # each step's loss averaged over the cp (and dp) ranks is the loss of the whole sequences
            assert run["losses"] == pytest.approx(run["want_losses"], abs=TOLERANCE), (index, run)
        assert run["local_shape"] == [2, 8] and run["restored_shape"] == [2, 16], (index, run)
        assert "divide by cp_size=2" in run["uneven_error"], (index, run)
        assert run["gathered_rows"] == 2 * run["dp_size"], (index, run)  # each batch row once
        # clip_grad_norm_ sees the whole gradient (averaged over cp and dp), and the clipped steps match
        assert run["norms"] == pytest.approx(run["want_norms"], rel=1e-5), (index, run)
    assert [run["cp_rank"] for run in runs] == cp_ranks
    for group in same_batch:  # context-parallel (and tensor-parallel) peers read one batch
        assert all(runs[rank]["batches"] == runs[group[0]]["batches"] for rank in group), (layout, group)
    groups = {json.dumps(runs[group[0]]["batches"]) for group in same_batch}
    assert len(groups) == len(same_batch), layout  # data-parallel ranks read different ones


@pytest.mark.parametrize("layout", ["cp_size=2", "cp_size=2,zero_stage=3"])  # FSDP2 over cp: ZeRO-2, -3
def test_context_parallel_alone_matches_one_process(report2, layout):
    _check(report2, layout, cp_ranks=[0, 1], same_batch=[[0, 1]])


def test_context_parallel_normalises_a_summed_loss_by_the_tokens_of_every_part(report2):
    """backward(sum, num_items=count of this rank's part): the counts are summed over the cp ranks."""
    _check(report2, "cp_size=2+items", cp_ranks=[0, 1], same_batch=[[0, 1]])


@pytest.mark.parametrize(
    "layout, cp_ranks, same_batch",
    [
        (FOUR[0], [0, 1, 0, 1], [[0, 1], [2, 3]]),  # mesh (dp_shard, cp): FSDP2 over the flattened 4
        (FOUR[1], [0, 0, 1, 1], [[0, 1, 2, 3]]),  # mesh (cp, tp): one batch for all
        (FOUR[2], [0, 1, 0, 1], [[0, 1], [2, 3]]),  # (dp_replicate, cp): HSDP over cp; num_items
    ],
)
def test_context_parallel_beside_other_dimensions_matches_one_process(report4, layout, cp_ranks, same_batch):
    _check(report4, layout, cp_ranks, same_batch)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            ParallelismConfig(cp_size=2, pp_size=2),
            "cp_size=2 with pp_size=2: context parallelism beside pipeline",
        ),
        (ParallelismConfig(cp_size=2, zero_stage=1), "cp_size=2 with zero_stage=1"),
    ],
)
def test_unsupported_combinations_are_refused_before_any_work(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate(4)


def test_zero_stage_3_shards_over_the_cp_ranks_alone():
    config = ParallelismConfig(cp_size=2, zero_stage=3).validate(2)
    assert (config.dp_shard_size, config.cp_size) == (1, 2)
    assert (data_parallel_engine(config), fsdp_stage(config)) == ("fsdp", 3)
    assert data_parallel_engine(ParallelismConfig(cp_size=2).validate(2)) == "fsdp"  # ZeRO-2 over cp


def test_buffers_are_checked_before_sharding():
    with pytest.raises(ValueError, match="was given no buffers"):
        check_buffers([], [], 2)
    with pytest.raises(ValueError, match="2 buffers but 1 buffer_seq_dims"):
        check_buffers([torch.zeros(2, 4), torch.zeros(2, 4)], [1], 2)
    with pytest.raises(ValueError, match=r"buffers\[0\] is a Parameter"):
        check_buffers([torch.nn.Parameter(torch.zeros(2, 4))], [1], 2)
    with pytest.raises(ValueError, match=r"shape \(2, 5\) and buffer_seq_dims\[0\]=1"):
        check_buffers([torch.zeros(2, 5)], [1], 2)
    with pytest.raises(ValueError, match=r"buffer_seq_dims\[0\]=2"):
        check_buffers([torch.zeros(2, 4)], [2], 2)
    check_buffers([torch.zeros(2, 4), torch.zeros(4)], [1, 0], 2)


def test_without_context_parallel_the_block_runs_as_it_is(fresh_state):
    accelerator = Accelerator(cpu=True)
    tokens = torch.arange(6).view(1, 6)
    with accelerator.maybe_context_parallel(buffers=[tokens], buffer_seq_dims=[1]):
        assert tokens.shape == (1, 6)
    assert accelerator.context_parallel_rank == 0
