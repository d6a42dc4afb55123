"""Every parallel layout through the ordinary loop (`prepare`, `accumulate`, `backward`): the same numbers.

One launch of tests/workers/strategy_worker.py per world size trains a tiny GPT under each layout of
that size (four runs each: SGD+momentum, SGD with accumulation 2, AdamW, summed token losses with
num_items) and compares the consolidated parameters with a single-process reference computed in the
worker; the per-rank bytes of the AdamW run are compared with design.md §3's formulas.
"""

from __future__ import annotations

import json

import pytest
from launching import WORKERS, launch_ok

from unison.memory import PRECISIONS, model_state_bytes

# layout (a parallelism= string) -> (memory formula, devices the formula divides by)
LAYOUTS = {
    2: {
        "ddp": ("ddp", 2),
        "zero1": ("zero1", 2),
        "zero2": ("zero2", 2),
        "zero3": ("zero3", 2),
    },
    4: {
        "ddp": ("ddp", 4),
        "zero1": ("zero1", 4),
        "zero2": ("zero2", 4),
        "zero3": ("zero3", 4),
        # HSDP: replicas over dp_replicate, each sharded over its dp_shard group of 2
        "dp_replicate_size=2,dp_shard_size=2": ("zero3", 2),
        "dp_replicate_size=2,dp_shard_size=2,zero_stage=2": ("zero2", 2),
        "dp_replicate_size=2,dp_shard_size=2,zero_stage=1": ("zero1", 2),
    },
}
TOLERANCE = {"sgd": 1e-5, "sgd_acc2": 1e-5, "items_acc2": 1e-5, "adamw": 1e-4}
CASES = [(world, layout) for world, layouts in LAYOUTS.items() for layout in layouts]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategies")
    result = {}
    for world, layouts in LAYOUTS.items():
        launch_ok(WORKERS / "strategy_worker.py", world, out / f"{world}.json", *layouts, timeout=600)
        result[world] = json.loads((out / f"{world}.json").read_text())
    return result


@pytest.mark.parametrize("world, layout", CASES)
def test_parameters_match_the_single_process_reference(reports, world, layout):
    runs = reports[world]["layouts"][layout]["runs"]
    for name, run in runs.items():
        assert run["keys_match"], (layout, name)
        assert run["max_abs_diff"] < TOLERANCE[name], (layout, name, run["max_abs_diff"])


@pytest.mark.parametrize("world, layout", CASES)
def test_per_rank_memory_follows_the_design_formulas(reports, world, layout):
    """fp32 AdamW: parameters + gradients + optimizer state per rank within 5% of design.md §3."""
    fp32 = next(p for p in PRECISIONS if p.name == "fp32")
    psi = reports[world]["parameters"]
    strategy, devices = LAYOUTS[world][layout]
    expected = model_state_bytes(strategy, fp32, psi, psi, devices)
    for rank, memory in enumerate(reports[world]["layouts"][layout]["memory_per_rank"]):
        measured = (memory["params"], memory["grads"], memory["optimizer"])
        assert abs(sum(measured) - sum(expected)) <= 0.05 * sum(expected), (layout, rank, measured, expected)
        for got, want in zip(measured, expected, strict=True):
            # ZeroRedundancyOptimizer splits by whole tensors, so one part may be a little uneven
            assert abs(got - want) <= 0.07 * want, (layout, rank, measured, expected)


def test_each_layout_runs_on_the_engine_it_names(reports):
    engines = {
        layout: {run["engine"] for run in entry["runs"].values()}
        for layouts in reports.values()
        for layout, entry in layouts["layouts"].items()
    }
    assert engines["ddp"] == engines["zero1"] == {"DistributedDataParallel"}
    assert engines["zero2"] == engines["zero3"] == {"FSDPGPT"}
    assert engines["dp_replicate_size=2,dp_shard_size=2"] == {"FSDPGPT"}
