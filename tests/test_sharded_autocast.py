"""ZeRO-2/3 in bf16 and fp16 compute what one process computes under autocast, on a 12-block model too.

FSDP2's plain MixedPrecisionPolicy(param_dtype=bf16) gathered embeddings and norms in bf16 and cast every
block's input to bf16: the residual stream ran in bf16 where autocast keeps it fp32, and after 6 steps of
a 12-block GPT the sharded run was 3.1e-3 from one-process autocast where DDP (autocast on each process)
was 5.7e-4 (2 blocks: 1.9e-3 and 7.3e-4). Now each unit gathers in bf16 only what autocast casts to
bf16 (parallel/precision_units.py), and the sharded step is DDP's step bit for bit, so exactly as far
from the one-process run (the worker says why it runs without clipping and reduces once per
accumulation window: only fp32 summation order would differ).

One launch of tests/workers/sharded_autocast_worker.py (2 processes, 2 and 12 blocks).
"""

from __future__ import annotations

import json

import pytest
import torch.nn as nn
from launching import WORKERS, launch_ok

from unison.parallel.precision_units import computes_in_half

DEPTHS = (2, 12)
DTYPES = ("no", "bf16", "fp16")
SHARDED = [(depth, layout, "bf16") for depth in DEPTHS for layout in ("zero2", "zero3")]
SHARDED += [(depth, "zero3", "fp16") for depth in DEPTHS]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded_autocast") / "report.json"
    launch_ok(WORKERS / "sharded_autocast_worker.py", 2, path, *DEPTHS, timeout=600)
    return json.loads(path.read_text())


@pytest.mark.parametrize(("depth", "layout", "precision"), SHARDED)
def test_sharded_half_precision_is_no_further_from_one_process_autocast_than_ddp(
    report, depth, layout, precision
):
    run, ddp = report[f"{depth}/{layout}/{precision}"], report[f"{depth}/ddp/{precision}"]
    assert 0 < ddp["vs_one_process"] < 5e-3  # half precision's own noise: the scale of the comparison
    assert run["vs_one_process"] <= ddp["vs_one_process"], (run, ddp)
    assert run["vs_ddp"] == 0, run  # the same computation as autocast on each process, not only as close


@pytest.mark.parametrize(("depth", "layout", "precision"), SHARDED)
def test_the_residual_stream_stays_fp32_and_master_weights_too(report, depth, layout, precision):
    run = report[f"{depth}/{layout}/{precision}"]
    assert run["stream"] == ["torch.float32"]  # every block's input and output, as under autocast
    assert run["dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("depth", DEPTHS)
def test_the_all_gathers_stay_about_halved(report, depth):
    """The blocks' projections travel in bf16, embeddings and norms (what autocast reads in fp32) in fp32,
    the norms once per step: 0.528 of the fp32 bytes at 2 blocks (the 32 x 32 embeddings weigh), 0.505
    at 12."""
    fp32 = report[f"{depth}/zero3/no"]["bytes"]["all_gather"]
    for precision in DTYPES[1:]:
        ratio = report[f"{depth}/zero3/{precision}"]["bytes"]["all_gather"] / fp32
        assert 0.5 < ratio <= (0.53 if depth == 2 else 0.506), (depth, precision, ratio)
    reduced = {report[f"{depth}/zero3/{precision}"]["bytes"]["reduce_scatter"] for precision in DTYPES}
    assert len(reduced) == 1  # gradients reduced in fp32 in all three


def test_a_block_that_reads_its_norms_weights_itself_trains_as_under_ddp(report):
    """The norms' fp32 unit is gathered when the model's forward starts, not only when a norm's forward
    runs: a fused add-and-norm kernel reading `norm.weight` would otherwise meet a sharded DTensor."""
    assert report["fused_norms/zero3/bf16"]["vs_ddp"] == 0


class _LoggingLinear(nn.Linear):
    def forward(self, x):  # a subclass may do anything with its weight: counted as fp32
        return super().forward(x)


def test_only_plain_matmul_type_modules_are_gathered_in_half_precision():
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D  # GPT-2's projections

    half = [nn.Linear(2, 2), nn.MultiheadAttention(4, 2).out_proj, nn.Conv2d(1, 1, 1), Conv1D(2, 2)]
    full = [nn.LayerNorm(2), nn.Embedding(3, 2), nn.MultiheadAttention(4, 2), _LoggingLinear(2, 2)]
    assert [computes_in_half(m) for m in half] == [True] * 4
    assert [computes_in_half(m) for m in full] == [False] * 4
