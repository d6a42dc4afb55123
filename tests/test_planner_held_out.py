"""The planner against published runs it was not tuned on (a held-out set).

The cost model was calibrated on Megatron-LM's Table 1 (Narayanan et al. 2021), Llama 3 405B and nanoGPT
(tests/test_cost_model.py, tests/test_planner_published.py). The runs below were chosen, with their
sources, and committed before the planner was run on any of them; the test then reports how many the
planner matches "within one step per degree" (every degree tp, pp, dp within a factor of 2 of the
published one, and a dimension used in one used in the other), and asserts that count.

Each run: its hardware, global batch and sequence, the parallelism its authors had (ZeRO or not), and
the layout they published. All train in bf16/fp16 mixed precision with fp32 master weights and full
activation recomputation (Korthikanti et al. used selective recomputation; the planner prices full only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from test_planner_published import degrees, within_one_step

from unison.planning import planner
from unison.planning.devices import DEVICES
from unison.planning.memory import ModelShape
from unison.planning.planner import Hardware, Workload


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    parameters_b: float  # as published, in billions
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    devices: int
    device: str  # devices.DEVICES key
    global_batch: int  # sequences per step
    zero: bool  # the parallelism the authors had: ZeRO/FSDP (True) or Megatron's TP/PP/DP only
    published: tuple[int, int, int]  # tp, pp, dp
    network: float | None = None  # bytes/s per device between nodes, where it differs from the table's


HELD_OUT = [
    Run(
        "BLOOM-176B", "Le Scao et al. 2022 (arXiv 2211.05100), section 3.4: 48 nodes of 8 A100 80GB, "
        "Megatron-DeepSpeed TP 4 x PP 12 x DP 8 with ZeRO-1, 2,048 sequences of 2,048; Omni-Path, "
        "4 x 100 Gb/s per node",
        176.2, 70, 14336, 112, 250880, 2048, 384, "a100-80gb", 2048, True, (4, 12, 8), 400e9 / 8 / 8,
    ),
    Run(
        "MT-NLG 530B", "Smith et al. 2022 (arXiv 2201.11990), section 2: 560 DGX A100 80GB, 8-way tensor "
        "and 35-way pipeline parallelism, data parallel to 4,480 GPUs, global batch 1,920 of 2,048 tokens",
        530.0, 105, 20480, 128, 51200, 2048, 4480, "a100-80gb", 1920, False, (8, 35, 16),
    ),
    Run(
        "GPT-NeoX-20B", "Black et al. 2022 (arXiv 2204.06745), section 3: 12 nodes of 8 A100 40GB, "
        "TP 2 x PP 4 x DP 12 with ZeRO-1, ~3.15M tokens per step (1,538 sequences; 1,536 here so dp 12 "
        "divides it)",
        20.6, 44, 6144, 64, 50432, 2048, 96, "a100-40gb", 1536, True, (2, 4, 12),
    ),
    Run(
        "Korthikanti 22B", "Korthikanti et al. 2022 (arXiv 2205.05198), Table 3: 8 A100 80GB, TP 8, "
        "global batch 4 of 2,048",
        22.0, 48, 6144, 64, 51200, 2048, 8, "a100-80gb", 4, False, (8, 1, 1),
    ),
    Run(
        "Korthikanti 175B", "Korthikanti et al. 2022, Table 3: 64 A100 80GB, TP 8 x PP 8, global batch 64",
        175.0, 96, 12288, 96, 51200, 2048, 64, "a100-80gb", 64, False, (8, 8, 1),
    ),
    Run(
        "Korthikanti 530B", "Korthikanti et al. 2022, Table 3: 280 A100 80GB, TP 8 x PP 35, global batch "
        "280",
        530.0, 105, 20480, 128, 51200, 2048, 280, "a100-80gb", 280, False, (8, 35, 1),
    ),
    Run(
        "Korthikanti 1T", "Korthikanti et al. 2022, Table 3: 512 A100 80GB, TP 8 x PP 64, global batch 512",
        1000.0, 128, 25600, 160, 51200, 2048, 512, "a100-80gb", 512, False, (8, 64, 1),
    ),
    Run(
        "OPT-175B", "Zhang et al. 2022 (arXiv 2205.01068), section 2.4: 992 A100 80GB, FSDP with "
        "Megatron-LM TP 8, ~2M tokens per step (992 sequences of 2,048 here, so dp 124 divides it)",
        175.0, 96, 12288, 96, 50272, 2048, 992, "a100-80gb", 992, True, (8, 1, 124),
    ),
]  # fmt: skip
"""OPT-175B is the run the issue named (the planner chose 31 pipeline stages for it): listed, but not
counted as held out."""
NAMED_IN_THE_ISSUE = {"OPT-175B"}


def facts(run: Run) -> planner.ModelFacts:
    """A GPT of the run's shape: 12·h² + 13·h per block, embeddings (V + s)·h (Megatron's count)."""
    block = 12 * run.hidden**2 + 13 * run.hidden
    parameters = run.layers * block + (run.vocab + run.seq) * run.hidden
    shape = ModelShape(
        parameters,
        parameters,
        blocks="transformer.h",
        layers=run.layers,
        hidden=run.hidden,
        vocab=run.vocab,
        largest_unit=run.vocab * run.hidden,
        block_linear_outputs=12 * run.hidden,
        block_parameters=block,
    )
    largest = run.vocab * run.hidden
    return planner.ModelFacts(shape, run.layers, block, run.heads, run.heads, "transformer.wte", largest)


def plan(run: Run) -> planner.Plan:
    nodes = max(1, run.devices // 8)
    spec = DEVICES[run.device]
    hardware = Hardware(run.devices, spec.memory, nodes, "nvlink", "infiniband")
    if run.network is not None:
        spec = dataclasses.replace(spec, inter_node_bandwidth=run.network)
    workload = Workload("bf16-mixed", None, run.seq, True, global_batch_size=run.global_batch, zero=run.zero)
    return planner.plan_for(facts(run), hardware, workload, spec)


@pytest.mark.parametrize("run", HELD_OUT, ids=[run.name for run in HELD_OUT])
def test_the_model_built_for_a_run_has_its_published_size(run):
    assert facts(run).shape.parameters / 1e9 == pytest.approx(run.parameters_b, rel=0.06)
    tp, pp, dp = run.published
    assert tp * pp * dp == run.devices and run.global_batch % dp == 0


def test_the_planner_matches_six_of_the_seven_held_out_runs_within_one_step():
    """Run once the set above was committed (docs/planner.md has the table): 6 of 7 within one step, 5 of
    them exact; GPT-NeoX-20B is the miss (ZeRO-3 over 96, predicted 1.2x faster than their TP 2 x PP 4 x
    ZeRO-1: the planner's known preference for sharded data parallelism where ZeRO is allowed)."""
    matched = {}
    for run in HELD_OUT:
        result = plan(run)
        matched[run.name] = within_one_step(degrees(result.config), run.published)
    held_out = [name for name in matched if name not in NAMED_IN_THE_ISSUE]
    assert sum(matched[name] for name in held_out) >= 6, matched
    assert matched["OPT-175B"]


def test_opt_175b_without_recomputation_prices_31_stages_of_96_blocks_as_they_run():
    """The issue's case. Without recomputation (OPT recomputed, and then gets its published layout) the
    layouts whose stages divide the 96 blocks either do not fit (pp 2 or 4 x TP 8 x ZeRO-1: 165%, 102%
    of a device), or reduce-scatter every micro-batch (ZeRO-2/3 under a pipeline), or gather the whole
    model for each of 8 micro-steps over InfiniBand (TP 8 x ZeRO-3 at micro-batch 1, all that fits);
    31 stages is the fastest left. They hold 3 or 4 blocks each and the pipeline runs at the 4-block
    stages' pace, 4 / 3.1 = 1.29x the even split, which the step prices as imbalance."""
    run = next(run for run in HELD_OUT if run.name == "OPT-175B")
    hardware = Hardware(run.devices, DEVICES[run.device].memory, run.devices // 8, "nvlink", "infiniband")
    workload = Workload("bf16-mixed", None, run.seq, False, global_batch_size=run.global_batch)
    result = planner.plan_for(facts(run), hardware, workload, "a100-80gb")
    assert result.config.pp_size == 31
    cost = result.cost
    assert (cost.compute + cost.imbalance) / cost.compute == pytest.approx(4 / (96 / 31), rel=0.02)
