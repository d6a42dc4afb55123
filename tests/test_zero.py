"""ZeRO-1/2/3 (unison.parallel.zero): fidelity to a single-process reference and per-rank memory.

One launch of tests/workers/zero_worker.py on 2 processes (gloo, CPU) runs nine trainings of a tiny
GPT; the checks below read its report. The block finder and argument errors are tested in-process.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from launching import WORKERS, launch_ok
from torch.distributed.fsdp import MixedPrecisionPolicy

from unison.parallel.blocks import find_blocks
from unison.parallel.zero import apply_zero, resolve_blocks, shard_optimizer_state
from unison.planning.memory import PRECISIONS, model_state_bytes

NPROC = 2


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero") / "report.json"
    launch_ok(WORKERS / "zero_worker.py", NPROC, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_sgd_momentum_matches_single_process_reference(report, stage, accumulation):
    for rank, runs in enumerate(report["ranks"]):
        run = runs[f"zero{stage}_sgd_acc{accumulation}"]
        assert run["keys_match"], (rank, run)
        assert run["max_abs_diff"] < 1e-5, (rank, run)
        # full_state_dict without all_ranks: the tensors on process 0 only
        assert (run["rank0_only_keys"] > 0) == (rank == 0), (rank, run)
        assert run["is_dtensor"] == (stage != 1)
        # accumulation 2: the first micro-step's backward communicated nothing
        assert run["skipped_sync"] is (True if accumulation == 2 else None), (rank, run)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adamw_matches_reference_and_memory_follows_design_formulas(report, stage):
    """fp32 AdamW (8 bytes of state per parameter): params + grads + state per rank within 5%."""
    fp32 = next(p for p in PRECISIONS if p.name == "fp32")
    psi = report["parameters"]
    expected = model_state_bytes(f"zero{stage}", fp32, psi, psi, report["world"])
    for rank, runs in enumerate(report["ranks"]):
        run = runs[f"zero{stage}_adamw_acc1"]
        assert run["max_abs_diff"] < 1e-4, (rank, run)
        memory = run["memory"]
        # ZeRO-2 keeps gathered parameters from forward to backward: the formula's full 4Ψ
        params = memory["params_gathered"] if stage == 2 else memory["param_shard_bytes"]
        measured = (params, memory["grads"], memory["optimizer"])
        for name, got, want in zip(("parameters", "gradients", "optimizer"), measured, expected, strict=True):
            assert abs(got - want) <= 0.05 * want, (stage, rank, name, got, want)
        assert abs(sum(measured) - sum(expected)) <= 0.05 * sum(expected)


def test_a_frozen_model_is_sharded_under_zero3_too(report):
    """A teacher or reference model (no trainable parameters) was left whole on every rank."""
    for rank, runs in enumerate(report["ranks"]):
        teacher = runs["frozen_teacher"]
        assert teacher["all_dtensor"], (rank, teacher)
        assert teacher["local_fraction"] == pytest.approx(1 / report["world"], abs=0.02), (rank, teacher)
        assert teacher["max_abs_diff"] < 1e-6, (rank, teacher)


def test_find_blocks_picks_the_largest_uniform_list_and_user_blocks_override():
    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, width)

    model = nn.Module()
    model.small = nn.ModuleList([Block(2), Block(2)])
    model.layers = nn.ModuleList([Block(8), Block(8), Block(8)])
    model.head = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))  # mixed classes: skipped
    name, blocks = find_blocks(model)
    assert name == "layers" and blocks is model.layers
    assert resolve_blocks(model, None) == list(model.layers)
    assert resolve_blocks(model, "small") == list(model.small)
    assert resolve_blocks(model, [model.head]) == [model.head]
    assert find_blocks(nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="no submodule"):
        resolve_blocks(model, "missing")
    with pytest.raises(ValueError, match="not submodules"):
        resolve_blocks(model, [nn.Linear(2, 2)])


def test_argument_errors_are_raised_before_any_communication():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="stage=4"):
        apply_zero(model, 4)
    with pytest.raises(ValueError, match="mixed_precision_policy"):
        apply_zero(model, 1, mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"stage=1 runs the model under DDP, which takes no .*compute_dtype"):
        apply_zero(model, 1, compute_dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"both mixed_precision_policy and compute_dtype=torch.bfloat16.*Pass one"
    ):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        apply_zero(model, 3, mixed_precision_policy=policy, compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"stage=1 runs the model whole under DDP, so blocks="):
        apply_zero(model, 1, blocks="layers")
    with pytest.raises(
        ValueError, match=r"stage=3 runs on FSDP2, which takes no DDP options \(bucket_cap_mb\)"
    ):
        apply_zero(model, 3, ddp_kwargs={"bucket_cap_mb": 50})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="before its first step"):
        shard_optimizer_state(optimizer)
