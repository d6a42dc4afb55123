"""Checkpoints through the Accelerator move between layouts: saved under ZeRO-3 (and a pipeline, and
tensor parallel 2) on 2 processes, loaded on 1 process, under ZeRO-3, HSDP and dp_shard 2 x tp 2 on 4,
tensor parallel 2, a pipeline and DDP.

tests/workers/layout_checkpoint_worker.py trains a tiny GPT 2 steps, calls save_state and save_model,
then trains a third step; each load restores the checkpoint under another layout and trains the same
third step. The restored weights must equal the saved ones exactly, and the third step must land
where the uninterrupted run did (SGD+momentum, so the momentum buffers crossed the move too).
"""

from __future__ import annotations

import pytest
import torch
from launching import WORKERS, launch_ok
from safetensors.torch import load_file

WORKER = WORKERS / "layout_checkpoint_worker.py"
pytestmark = pytest.mark.timeout(600)


def max_diff(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max((got[key] - want[key]).abs().max().item() for key in want)


LOADS = [  # (source layout, processes, target layout)
    ("zero3", 2, "zero3"),  # the same layout: bit-exact
    ("zero3", 1, "ddp"),  # one process
    ("zero3", 4, "zero3"),  # resharded over 4
    ("zero3", 4, "dp_replicate_size=2,dp_shard_size=2"),  # HSDP
    ("zero3", 2, "tp_size=2"),
    ("zero3", 2, "pp_size=2"),
    ("zero3", 2, "ddp"),
    ("pp_size=2", 1, "ddp"),
    ("pp_size=2", 2, "zero3"),
    ("tp_size=2", 1, "ddp"),  # the fused q|k|v's permuted rows (and momentum) back in the user's layout
    ("tp_size=2", 4, "dp_shard_size=2,tp_size=2"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three checkpoints, written by 2 processes in one launch: under ZeRO-3, as a 2-stage pipeline and
    under tensor parallel 2; then every load of LOADS, one launch per number of processes, the loads on
    2 processes in the saving launch (3 launches)."""
    directories = {
        layout: tmp_path_factory.mktemp(layout.replace("=", ""))
        for layout in ("zero3", "pp_size=2", "tp_size=2")
    }

    def loads(nproc: int) -> list:
        pairs = [(target, directories[source]) for source, n, target in LOADS if n == nproc]
        return ["load", *[arg for pair in pairs for arg in pair]]

    saves = [arg for layout, path in directories.items() for arg in (layout, path)]
    launch_ok(WORKER, 2, "save", *saves, *loads(2))
    for nproc in sorted({nproc for _, nproc, _ in LOADS} - {2}):
        launch_ok(WORKER, nproc, *loads(nproc))
    return directories


@pytest.mark.parametrize("source, nproc, target", LOADS)
def test_a_checkpoint_loads_under_another_layout_and_training_goes_on(saved, source, nproc, target):
    directory = saved[source]
    restored = torch.load(directory / f"restored_{nproc}_{target}.pt")
    assert max_diff(restored, torch.load(directory / "at_save.pt")) == 0.0
    after = torch.load(directory / f"loaded_{nproc}_{target}.pt")
    expected = torch.load(directory / "after_step.pt")
    if (source, nproc, target) == ("zero3", 2, "zero3"):
        assert max_diff(after, expected) == 0.0  # bit-exact resume on the same layout
    else:
        assert max_diff(after, expected) < 1e-5, (source, nproc, target)


@pytest.mark.parametrize("layout", ["zero3", "pp_size=2", "tp_size=2"])
def test_save_model_writes_the_consolidated_weights_from_a_sharded_or_split_layout(saved, layout):
    weights = load_file(saved[layout] / "weights" / "model.safetensors")
    at_save = torch.load(saved[layout] / "at_save.pt")
    # the tied embedding is stored once (under one of its names), as a single process writes it
    tied = {"transformer.wte.weight", "lm_head.weight"}
    assert len(tied & set(weights)) == 1
    for key, value in at_save.items():
        if key in tied:
            value_name = next(iter(tied & set(weights)))
            assert torch.equal(weights[value_name], value)
        else:
            assert torch.equal(weights[key], value), key
