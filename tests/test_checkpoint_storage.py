"""Checkpoint storage: atomic directories, manifest verification, listing/pruning, safe loading."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from launching import WORKERS, describe, launch, launch_ok
from slowness import budget

from unison.checkpoint import (
    MANIFEST_NAME,
    CheckpointError,
    ProjectConfiguration,
    checkpoint_path,
    files_of_process,
    list_checkpoints,
    load_object,
    newest_checkpoint,
    prune_checkpoints,
    save_object,
    temporary_path,
    verify_checkpoint,
    write_checkpoint,
)
from unison.checkpoint.manifest import CHUNK_BYTES

pytestmark = pytest.mark.usefixtures("fresh_state")


def save_simple(directory: Path, value: float, **metadata) -> None:
    with write_checkpoint(directory, metadata=metadata) as staging:
        save_object({"w": torch.full((64,), value)}, staging / "model.pt")


def loaded_value(directory: Path) -> float:
    return load_object(directory / "model.pt")["w"][0].item()


def test_round_trip_records_every_file_with_size_and_checksum(tmp_path):
    final = tmp_path / "checkpoints" / "checkpoint_3"
    state = {"weight": torch.randn(5, 7), "step": 3, "names": ["a", "b"]}
    with write_checkpoint(final, metadata={"step": 3, "world_size": 1}) as staging:
        assert staging == tmp_path / "checkpoints" / ".checkpoint_3.tmp" == temporary_path(final)
        assert not final.exists()
        save_object(state, staging / "model.pt")
        (staging / "shards").mkdir()
        (staging / "shards" / "part0.bin").write_bytes(b"\x00\x01\x02" * 100)
        (staging / "empty.txt").write_bytes(b"")
        (staging / "big.bin").write_bytes(os.urandom(CHUNK_BYTES * 2 + 12_345))  # three checksum chunks

    assert sorted(path.name for path in final.parent.iterdir()) == ["checkpoint_3"]
    manifest = verify_checkpoint(final)
    assert manifest["metadata"] == {"step": 3, "world_size": 1}
    assert json.loads((final / MANIFEST_NAME).read_text()) == manifest
    assert sorted(manifest["files"]) == ["big.bin", "empty.txt", "model.pt", "shards/part0.bin"]
    chunk = manifest["chunk_bytes"]
    for name, entry in manifest["files"].items():
        data = (final / name).read_bytes()
        crcs = [f"{zlib.crc32(data[start : start + chunk]):08x}" for start in range(0, len(data), chunk)]
        assert entry == {"size": len(data), "crc32": crcs}
    assert len(manifest["files"]["big.bin"]["crc32"]) == 3
    loaded = load_object(final / "model.pt")
    assert torch.equal(loaded["weight"], state["weight"])
    assert loaded["step"] == 3 and loaded["names"] == ["a", "b"]


def test_exception_in_body_renames_nothing_and_keeps_previous_checkpoints(tmp_path):
    save_simple(tmp_path / "checkpoint_1", 1.0)
    save_simple(tmp_path / "checkpoint_2", 2.0)
    for name in ("checkpoint_3", "checkpoint_2"):  # a new name, and the replacement of an existing one
        with pytest.raises(RuntimeError, match="disk full"):
            with write_checkpoint(tmp_path / name) as staging:
                save_object({"w": torch.full((64,), 9.0)}, staging / "model.pt")
                raise RuntimeError("disk full")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint_1", tmp_path / "checkpoint_2"]
    verify_checkpoint(tmp_path / "checkpoint_2")
    assert loaded_value(tmp_path / "checkpoint_2") == 2.0


def test_stale_temporary_directory_is_ignored_then_cleaned(tmp_path):
    save_simple(tmp_path / "checkpoint_1", 1.0)
    stale = temporary_path(tmp_path / "checkpoint_5")
    stale.mkdir()
    (stale / "junk.pt").write_bytes(b"half written")
    (stale / MANIFEST_NAME).write_text("{}")  # even a manifest does not make a hidden dir a checkpoint
    no_manifest = tmp_path / "checkpoint_9"  # a folder made some other way
    no_manifest.mkdir()
    (no_manifest / "model.pt").write_bytes(b"x")

    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint_1"]
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoint_1"
    with pytest.raises(CheckpointError, match=r"checkpoint_9 is not a complete checkpoint.*manifest"):
        verify_checkpoint(no_manifest)

    save_simple(tmp_path / "checkpoint_5", 5.0)
    assert not stale.exists()
    assert sorted(verify_checkpoint(tmp_path / "checkpoint_5")["files"]) == ["model.pt"]
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoint_5"


def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path):
    def fresh(name: str) -> Path:
        directory = tmp_path / name
        with write_checkpoint(directory) as staging:
            save_object({"w": torch.arange(10_000, dtype=torch.float32)}, staging / "model.pt")
            save_object({"seed": 1}, staging / "rng_state_0.pt")
        return directory

    truncated = fresh("truncated")
    with open(truncated / "model.pt", "r+b") as file:
        file.truncate(os.path.getsize(truncated / "model.pt") - 100)
    with pytest.raises(CheckpointError, match=r"truncated/model\.pt has \d+ bytes .*truncated\?"):
        verify_checkpoint(truncated)

    edited = fresh("edited")
    data = bytearray((edited / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one tensor value: same size, still loads
    (edited / "model.pt").write_bytes(bytes(data))
    assert load_object(edited / "model.pt")["w"].shape == (10_000,)
    with pytest.raises(
        CheckpointError,
        match=r"edited/model\.pt does not match its checksums .*bytes 0-.*edited or corrupted",
    ):
        verify_checkpoint(edited)

    missing = fresh("missing")
    (missing / "rng_state_0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing/rng_state_0\.pt is missing"):
        verify_checkpoint(missing)

    newer = fresh("newer")
    manifest = json.loads((newer / MANIFEST_NAME).read_text())
    (newer / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(CheckpointError, match=r"format_version 99.*reads version 1"):
        verify_checkpoint(newer)

    (newer / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"newer/manifest\.json is not a valid checkpoint manifest"):
        verify_checkpoint(newer)
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_checkpoint(tmp_path / "nowhere")


def test_each_process_verifies_the_files_it_wrote_and_together_they_verify_every_file():
    """Per-process files (RNG states, DCP shards) go to the process of their rank, modulo the processes
    that load them; replicated files and DCP's metadata to the main process, which wrote them."""
    names = ["counters.pt", "model_0.pt", "rng_state_0.pt", "rng_state_1.pt", "rng_state_3.pt"]
    names += ["model_0/.metadata", "model_0/__0_0.distcp", "model_0/__3_0.distcp", "optimizer_0/__1_0.distcp"]
    manifest = {"files": dict.fromkeys(names, {})}
    assert files_of_process(manifest, 1, 4) == ["optimizer_0/__1_0.distcp", "rng_state_1.pt"]
    assert files_of_process(manifest, 3, 4) == ["model_0/__3_0.distcp", "rng_state_3.pt"]
    assert files_of_process(manifest, 0, 4) == [
        "counters.pt",
        "model_0.pt",
        "model_0/.metadata",
        "model_0/__0_0.distcp",
        "rng_state_0.pt",
    ]
    shares = [files_of_process(manifest, rank, 2) for rank in range(2)]  # saved by 4, loaded by 2
    assert shares[1] == [
        "model_0/__3_0.distcp",
        "optimizer_0/__1_0.distcp",
        "rng_state_1.pt",
        "rng_state_3.pt",
    ]
    assert sorted(shares[0] + shares[1]) == sorted(names)
    assert files_of_process(manifest, 0, 1) == sorted(names)


def test_list_newest_and_prune_order_steps_numerically(tmp_path):
    assert list_checkpoints(tmp_path / "absent") == [] and newest_checkpoint(tmp_path / "absent") is None
    for step in (10, 2, 1, 33):
        save_simple(checkpoint_path(tmp_path, step), float(step))
    (tmp_path / "checkpoint_x").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint")

    def steps() -> list[int]:
        return [int(path.name.split("_")[1]) for path in list_checkpoints(tmp_path)]

    assert steps() == [1, 2, 10, 33]
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoint_33"
    assert prune_checkpoints(tmp_path, total_limit=3) == [tmp_path / "checkpoint_1"]
    assert steps() == [2, 10, 33]
    assert prune_checkpoints(tmp_path, total_limit=5) == []
    assert prune_checkpoints(tmp_path, total_limit=1) == [
        tmp_path / "checkpoint_2",
        tmp_path / "checkpoint_10",
    ]
    assert steps() == [33] and loaded_value(tmp_path / "checkpoint_33") == 33.0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint_33", "checkpoint_x", "notes.txt"]
    with pytest.raises(ValueError, match=r"total_limit=0 is not allowed.*>= 1"):
        prune_checkpoints(tmp_path, total_limit=0)


def test_saving_again_under_the_same_name_replaces_the_checkpoint(tmp_path):
    final = tmp_path / "checkpoint_4"
    with write_checkpoint(final, metadata={"attempt": 1}) as staging:
        save_object({"w": torch.full((64,), 1.0)}, staging / "model.pt")
        save_object({"only": "first"}, staging / "extra.pt")
    save_simple(final, 2.0, attempt=2)
    manifest = verify_checkpoint(final)
    assert manifest["metadata"] == {"attempt": 2}
    assert sorted(path.name for path in final.iterdir()) == [MANIFEST_NAME, "model.pt"]
    assert loaded_value(final) == 2.0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint_4"]


def test_metadata_must_be_json_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match=r"metadata .* cannot be written to manifest\.json"):
        with write_checkpoint(tmp_path / "checkpoint_1", metadata={"when": object()}):
            pytest.fail("the body must not run")
    assert list(tmp_path.iterdir()) == []


class NotAllowed:
    """A user class: weights_only loading must refuse to construct it."""


def test_load_object_refuses_arbitrary_classes_naming_the_file(tmp_path):
    path = tmp_path / "custom.pt"
    torch.save({"thing": NotAllowed()}, path)
    with pytest.raises(CheckpointError, match=r"custom\.pt holds an object .*weights_only=True.*NotAllowed"):
        load_object(path)
    save_object({"t": torch.ones(2, dtype=torch.bfloat16), "n": 3}, tmp_path / "plain.pt")
    loaded = load_object(tmp_path / "plain.pt", map_location="cpu")
    assert loaded["n"] == 3 and torch.equal(loaded["t"], torch.ones(2, dtype=torch.bfloat16))


def test_project_configuration_has_accelerates_defaults_and_checks_total_limit(tmp_path):
    config = ProjectConfiguration()
    assert (
        config.project_dir,
        config.logging_dir,
        config.automatic_checkpoint_naming,
        config.total_limit,
        config.iteration,
        config.save_on_each_node,
    ) == (None, None, False, None, 0, False)
    with pytest.raises(ValueError, match="no project_dir"):
        _ = config.checkpoints_dir
    config.set_directories(tmp_path)
    assert config.checkpoints_dir == tmp_path / "checkpoints" and config.logging_dir == str(tmp_path)
    named = ProjectConfiguration(project_dir="runs/a", logging_dir="logs", total_limit=2)
    assert named.logging_dir == "logs" and named.checkpoints_dir == Path("runs/a/checkpoints")
    named.set_directories("runs/b")  # Accelerator(project_config=named, project_dir="runs/b")
    assert (named.project_dir, named.logging_dir) == ("runs/b", "logs")
    following = ProjectConfiguration(project_dir="runs/a")  # logging_dir not given: it follows
    following.set_directories("runs/b")
    assert (following.project_dir, following.logging_dir) == ("runs/b", "runs/b")
    assert following == ProjectConfiguration(project_dir="runs/b")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=rf"total_limit={bad!r} is not allowed"):
            ProjectConfiguration(project_dir="p", total_limit=bad)
    # what unison cannot honour is refused, not ignored; automatic naming is what it always does
    for bad in (-1, 3):
        with pytest.raises(
            ValueError, match=rf"iteration={bad}\): unison names checkpoints by optimizer step"
        ):
            ProjectConfiguration(iteration=bad)
    with pytest.raises(ValueError, match=r"save_on_each_node=True\): .* shared by the nodes"):
        ProjectConfiguration(save_on_each_node=True)
    assert ProjectConfiguration(project_dir="p", automatic_checkpoint_naming=True).checkpoints_dir == Path(
        "p/checkpoints"
    )


def test_two_processes_write_one_checkpoint_and_a_killed_save_leaves_the_previous_intact(tmp_path):
    checkpoints_dir, out_dir = tmp_path / "checkpoints", tmp_path / "out"
    out_dir.mkdir()
    results = []
    runner = threading.Thread(
        target=lambda: results.append(
            launch(WORKERS / "checkpoint_storage_worker.py", 2, checkpoints_dir, out_dir, timeout=240)
        )
    )
    runner.start()
    ready = [out_dir / f"ready{rank}.json" for rank in range(2)]
    deadline = time.monotonic() + budget(200)
    while not all(path.exists() for path in ready) and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)  # let both writers finish writing their announcements
    announced = [json.loads(path.read_text()) for path in ready if path.exists()]
    # The elastic agent starts each worker in its own session, so killing the launch's process group
    # would not reach them: kill every process of the launch by pid, as a node failure would.
    for pid in [entry["pid"] for entry in announced] + [entry["launcher_pid"] for entry in announced[:1]]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    runner.join(timeout=60)
    assert results, "the launch did not end after SIGKILL"
    assert len(announced) == 2, describe(results[0])
    assert results[0].returncode == -signal.SIGKILL, describe(results[0])

    final = checkpoints_dir / "checkpoint_1"
    expected_files = ["model.pt", "rng_state_0.pt", "rng_state_1.pt"]
    for rank in range(2):
        record = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert record["manifest_files"] == expected_files, record
        assert record["metadata"] == {"step": 1, "writer_rank": 0}, record  # the main process wrote it
        assert record["listed"] == ["checkpoint_1"] and record["entries"] == ["checkpoint_1"], record
    manifest = verify_checkpoint(final)
    assert sorted(manifest["files"]) == expected_files
    for rank in range(2):
        saved = load_object(final / f"rng_state_{rank}.pt")
        assert saved["rank"] == rank and torch.equal(saved["values"], torch.arange(1000) * (rank + 1))
    assert torch.equal(load_object(final / "model.pt")["weight"], torch.linspace(0, 1, 4096))

    # The killed save: no checkpoint_2, only its hidden leftover, which listing ignores.
    staging = temporary_path(checkpoints_dir / "checkpoint_2")
    assert sorted(path.name for path in checkpoints_dir.iterdir()) == [staging.name, "checkpoint_1"]
    assert sorted(path.name for path in staging.iterdir()) == ["rng_state_0.pt", "rng_state_1.pt"]
    assert list_checkpoints(checkpoints_dir) == [final] and newest_checkpoint(checkpoints_dir) == final


def test_a_step_that_fails_on_one_process_fails_on_every_process(tmp_path):
    """Rank 0's replicated write, save_model's file, rank 1's read, a file damaged where rank 1 alone
    verifies it: each failure reaches both ranks, nothing is renamed into place or applied, and a script
    that catches it meets its peers in the next collective (the group timeout is 20 s: a hang fails the
    launch). A rank that sees no checkpoint follows rank 0's choice instead of starting fresh alone."""
    launch_ok(
        WORKERS / "checkpoint_failure_worker.py", 2, tmp_path, launch_args=["--timeout", "20"], timeout=120
    )
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, record in enumerate(records):
        assert [record[f"{step}_then"] for step in ("save_state", "save_model", "load_state")] == [3.0] * 3
        saving, exporting, loading = record["save_state"], record["save_model"], record["load_state"]
        assert "No space left on device" in saving and not record["broken_renamed"], saving
        assert "not_a_directory" in exporting, exporting
        if rank == 0:  # its own errors; rank 1's read failure reported
            assert saving.startswith("OSError: ") and not exporting.startswith("CheckpointError"), exporting
            assert loading.startswith("CheckpointError: ") and "failed on process(es) [1]" in loading, loading
        else:  # rank 0's failures reported; its own read error
            assert saving.startswith("CheckpointError: ") and "failed on process(es) [0]" in saving, saving
            assert exporting.startswith("CheckpointError: ") and "failed on process(es) [0]" in exporting
            assert loading.startswith("RuntimeError: CUDA out of memory (simulated)"), loading
        assert record["lagging_view_loaded"].endswith("shared/checkpoints/checkpoint_0"), record
        assert record["lagging_view_then"] == 3.0
        # process 1 verifies its own RNG file; what it finds stops both, before anything is applied
        damaged = record["damaged_rank1_file"]
        assert damaged.startswith("CheckpointError: ") and "damaged/rng_state_1.pt does not match" in damaged
        assert record["damaged_untouched"], record
