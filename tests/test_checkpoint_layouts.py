"""Checkpoints through the Accelerator move between layouts: saved under ZeRO-3 (and a pipeline, and
tensor parallel 2) on 2 processes, loaded on 1 process, under ZeRO-3, HSDP and dp_shard 2 x tp 2 on 4,
tensor parallel 2, a pipeline and DDP.

tests/workers/layout_checkpoint_worker.py trains a tiny GPT 2 steps, calls save_state and save_model,
then trains a third step; each load restores the checkpoint under another layout and trains the same
third step. The restored weights must equal the saved ones exactly, and the third step must land
where the uninterrupted run did (SGD+momentum, so the momentum buffers crossed the move too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from launching import WORKERS, launch_ok
from safetensors import safe_open
from safetensors.torch import load_file
from slowness import budget

from unison.checkpoint import verify_checkpoint
from unison.checkpoint.dcp_reading import SafeFileSystemReader
from unison.checkpoint.export import export_checkpoint

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


@pytest.mark.parametrize("layout", ["zero3", "pp_size=2", "tp_size=2"])
def test_an_asynchronous_save_writes_the_synchronous_checkpoints_bytes(saved, layout):
    """save_state(async_save=True) of the same state, written while the next step changed every weight:
    every file the same size with the same CRC-32s as the synchronous checkpoint's (their manifests say
    so, each verified against its files), but DCP's `.metadata`, which names its own directory: there
    the tensors' sizes, dtypes and places in the files are the same."""
    sync = verify_checkpoint(saved[layout] / "checkpoint")
    background = verify_checkpoint(saved[layout] / "checkpoint_async")
    dcp_metadata = {name for name in sync["files"] if name.endswith("/.metadata")}
    assert dcp_metadata and set(background["files"]) == set(sync["files"])
    assert {k: v for k, v in background["files"].items() if k not in dcp_metadata} == {
        k: v for k, v in sync["files"].items() if k not in dcp_metadata
    }
    for name in dcp_metadata:
        part = name.removesuffix("/.metadata")
        read = [
            SafeFileSystemReader(saved[layout] / c / part).read_metadata()
            for c in ("checkpoint", "checkpoint_async")
        ]
        assert read[0].state_dict_metadata == read[1].state_dict_metadata, name
        assert read[0].storage_data == read[1].storage_data, name
    assert background["metadata"] == sync["metadata"]
    assert not list(saved[layout].glob(".*.tmp"))  # nothing left half-written


@pytest.mark.parametrize("layout", ["zero3", "pp_size=2", "tp_size=2"])
def test_export_writes_on_one_process_the_file_save_model_wrote_in_the_run(saved, layout, tmp_path):
    """`unison export` reads the 2-process checkpoint alone (no group, no model class): the same names, the
    tied embedding once (the pipeline held a copy on each stage, DCP stored both), the same tensors."""
    result = export_checkpoint(saved[layout] / "checkpoint", tmp_path)
    assert result.weights == tmp_path / "model.safetensors" and result.config is None  # no HF config
    in_run = saved[layout] / "weights" / "model.safetensors"
    exported, written = load_file(result.weights), load_file(in_run)
    assert sorted(exported) == sorted(written)
    assert all(torch.equal(exported[key], written[key]) for key in written)
    with safe_open(result.weights, "pt") as a, safe_open(in_run, "pt") as b:
        assert a.metadata() == b.metadata()  # which tied name was dropped, as save_model records it
    assert result.names == result.tensors + 1  # lm_head.weight is transformer.wte.weight


def test_the_export_command_writes_bf16_shards_under_accelerates_name(saved, tmp_path):
    """`unison merge-weights` (Accelerate's spelling) with --dtype bf16 and a shard size: an index and its
    shards, every weight in bf16, the tied one once; a wrong path is one line naming it, exit 1."""
    result = subprocess.run(
        [sys.executable, "-m", "unison", "merge-weights", saved["tp_size=2"] / "checkpoint", tmp_path / "out"]
        + ["--dtype", "bf16", "--max-shard-size", "20KB"],
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    weights = {}
    for name in files:
        weights.update(load_file(tmp_path / "out" / name))
    at_save = torch.load(saved["tp_size=2"] / "at_save.pt")
    assert sorted(weights) == sorted(set(at_save) - {"lm_head.weight"})  # re-tied by the model on load
    for key, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, at_save[key].to(torch.bfloat16)), key
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in weights.values())
    index_path = tmp_path / "out" / "model.safetensors.index.json"
    assert f"wrote {index_path}: {len(weights)} tensors" in result.stdout, result.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "unison", "export", tmp_path / "nothing", tmp_path / "out2"],
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1, missing.stderr
    assert f"no checkpoint at {tmp_path / 'nothing'}" in missing.stderr


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_weights_are_readable_as_the_umask_says_not_by_their_owner_alone(tmp_path, umask):
    """safetensors creates its files 0600; transformers' save_pretrained leaves them readable by the group
    (0644 under the usual umask 022): the exported folder, its shards and save_model's file are made what
    `open()` would have made them (in-process: no launch needed for the file mode)."""
    from unison.checkpoint.weights import split_into_shards, write_shards, write_weights

    state = {"a.weight": torch.ones(64, 64), "b.weight": torch.zeros(64, 64)}
    previous = os.umask(umask)
    try:
        single = write_weights(state, tmp_path / "one")
        index = write_shards(split_into_shards(state, 20_000), tmp_path / "shards", safe_serialization=True)
    finally:
        os.umask(previous)
    files = [single, *(path for path in index.parent.iterdir() if path.suffix == ".safetensors")]
    assert len(files) == 3
    assert {oct(path.stat().st_mode & 0o777) for path in files} == {oct(0o666 & ~umask)}
