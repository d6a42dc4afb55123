"""ZeRO-2/3 with offload=true on one process (one GPU, a model bigger than it) keeps FSDP2 and its CPU
offload instead of degrading to plain training.

One run of tests/workers/offload_one_process_worker.py as plain `python` (no launcher: the
`python train.py` case) trains both layouts against plain one-process training in the same process;
the checks below read its report. The layout rules are checked in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launching import REPO_ROOT, WORKERS
from slowness import budget

from unison.parallel.apply import data_parallel_engine
from unison.parallel.config import ParallelismConfig
from unison.parallel.mesh import mesh_layout

LAYOUTS = ("zero2,offload=true", "zero3,offload=true")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload") / "report.json"
    result = subprocess.run(
        [sys.executable, str(WORKERS / "offload_one_process_worker.py"), str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=budget(300),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("spec", LAYOUTS)
def test_offload_on_one_process_is_fsdp2_with_cpu_offload(report, spec):
    facts = report[spec]["facts"]
    assert facts["all_dtensor"] and facts["fsdp_units"] == 4, facts  # 3 blocks + the root
    assert facts["offload_policies"] == ["CPUOffloadPolicy"], facts
    assert (facts["mesh"], facts["mesh_shape"]) == (["dp_shard"], [1]), facts
    assert (facts["zero_stage"], facts["offload"]) == (int(spec[4]), True), facts
    notes = report[spec]["notes"]
    assert not any("no second process to shard over" in line for line in notes), notes
    assert any("offload=true on the CPU" in line for line in notes), notes


@pytest.mark.parametrize("spec", LAYOUTS)
def test_offload_on_one_process_trains_as_plain_training(report, spec):
    """SGD with momentum, a rate changed every step, clipping and accumulation 2."""
    run = report[spec]
    assert run["losses_diff"] <= 1e-6 and run["weights_diff"] <= 1e-6, run
    assert run["lr"] == [0.05], run  # the scheduler stepped once per optimizer step (0.2 / 4)


@pytest.mark.parametrize("spec", LAYOUTS)
def test_offload_on_one_process_checkpoints(report, spec):
    run = report[spec]
    assert run["checkpoint_is_dcp"], run
    assert run["resume_losses_equal"] and run["resume_weights_diff"] == 0.0 and run["resume_lr_equal"], run
    # the same checkpoint continued without offload (plain training) gives the same run
    assert run["plain_resume_losses_equal"] and run["plain_resume_weights_diff"] == 0.0, run
    assert run["save_model_names"] and run["save_model_diff"] == 0.0, run


@pytest.mark.parametrize("spec", LAYOUTS)
def test_offload_on_one_process_materialises_a_meta_model_as_built_normally(report, spec):
    run = report[spec]
    assert run["meta_dtensor"] and run["meta_init_diff"] == 0.0, run


@pytest.mark.parametrize("spec", LAYOUTS)
def test_offload_on_one_process_runs_a_meta_models_init_once_in_place(report, spec):
    """The process holds every tensor whole: the replay's one pass writes into them, each init call
    once (the dry pass and the per-group pass ran each twice), with GPT's tie as the normal build."""
    run = report[spec]
    assert run["meta_tied_init_calls"] == 1, run
    assert run["meta_tied_diff"] == 0.0 and run["meta_tied_kept"], run


@pytest.mark.parametrize("spec", LAYOUTS)
def test_offload_on_one_process_keeps_the_stage_and_a_one_rank_dp_shard(spec):
    asked = ParallelismConfig.from_string(spec)
    resolved = asked.validate(1)
    assert (resolved.zero_stage, resolved.offload, resolved.dp_shard_size) == (asked.zero_stage, True, 1)
    assert mesh_layout(resolved) == (("dp_shard",), (1,))
    assert data_parallel_engine(resolved) == "fsdp"
    assert resolved.describe() == f"single process (ZeRO-{asked.zero_stage}, offloaded)"
    assert asked.unsharded_note(1) is None
    explicit = ParallelismConfig(zero_stage=asked.zero_stage, dp_shard_size=1, offload=True).validate(1)
    assert mesh_layout(explicit) == (("dp_shard",), (1,))
    blocks = ParallelismConfig(zero_stage=asked.zero_stage, offload=True, zero_blocks="h").validate(1)
    assert blocks.zero_blocks == "h"  # FSDP2 shards the named blocks, as on several processes
