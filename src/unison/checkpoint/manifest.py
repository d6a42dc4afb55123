"""A checkpoint's manifest: each file's size and CRC-32s, written last, verified before loading.

The manifest is what makes a checkpoint directory complete (unison.checkpoint.storage writes it last,
then renames the directory into place) and what a load checks every file against. The checksums are
split between the processes by who wrote each file (`checksumming_process`), so no process reads the
whole checkpoint; see storage's module docstring for why CRC-32 and why per process.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from ..state import PartialState
from .errors import CheckpointError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
CHUNK_BYTES = 8 * 2**20
"""Files are checksummed in chunks of this size (one CRC-32 each), so every core can work on one file."""
_MAX_THREADS = 32
_PER_PROCESS_FILE = re.compile(r"rng_state_(\d+)\.pt|__(\d+)_\d+\.distcp")
"""Files written by one process carry its rank: its RNG states (training_state) and its shards, which
torch's distributed checkpoint names `__<rank>_<n>.distcp` (sharded)."""


def checksumming_process(name: str, num_processes: int) -> int:
    """The process that checksums the file `name` (relative to the checkpoint) on save and verifies it
    on load: the process of the rank a per-process file carries (`rng_state_<rank>.pt`, DCP's
    `__<rank>_<n>.distcp`; modulo `num_processes` when fewer processes load than saved), else the main
    process, which writes the replicated files (and DCP's `.metadata`). So each process checksums what
    it wrote, still in its page cache, and its share grows with its own bytes, not the checkpoint's.
    """
    match = _PER_PROCESS_FILE.fullmatch(PurePosixPath(name).name)
    if match is None:
        return 0
    return int(match.group(1) or match.group(2)) % num_processes


def files_of_process(manifest: Mapping[str, Any], process_index: int, num_processes: int) -> list[str]:
    """The files of `manifest` that process `process_index` of `num_processes` verifies (see
    checksumming_process); together the processes verify every file once."""
    return sorted(
        name for name in manifest["files"] if checksumming_process(name, num_processes) == process_index
    )


def checksum_own_files(directory: Path, state: PartialState) -> dict[str, dict[str, Any]]:
    """Size and CRC-32s of the files under `directory` that this process checksums (see
    checksumming_process), each fsynced: name (relative, '/'-separated) -> its manifest entry.

    Called once every process has written its files; the others' files are listed but not read.
    """
    names = sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.is_file() and path.name != MANIFEST_NAME
    )
    own = [name for name in names if checksumming_process(name, state.num_processes) == state.process_index]
    return dict(zip(own, _checksum_files([directory / name for name in own], CHUNK_BYTES, sync=True)))


def write_manifest(directory: Path, metadata: dict[str, Any], files: dict[str, Any]) -> dict[str, Any]:
    """Write (and fsync) the manifest of `files` (every process's checksums), then fsync the folders."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "checksum": "crc32",
        "chunk_bytes": CHUNK_BYTES,
        "files": dict(sorted(files.items())),
        "metadata": metadata,
    }
    with open(directory / MANIFEST_NAME, "w") as file:
        json.dump(manifest, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    for folder in [directory, *(path for path in directory.rglob("*") if path.is_dir())]:
        fsync_directory(folder)
    return manifest


def _checksum_files(paths: list[Path], chunk_bytes: int, sync: bool) -> list[dict[str, Any]]:
    """Size and per-chunk CRC-32s of each file (optionally fsyncing each), computed in threads.

    zlib and fsync release the GIL, so the chunks are checksummed on every core (a 100 MB file is not
    one sequential pass) while the fsyncs wait on the disk: a save costs about the larger of the two.
    """
    threads = min(_MAX_THREADS, (os.cpu_count() or 1) + (len(paths) if sync else 0))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        syncs = [pool.submit(_fsync_file, path) for path in paths] if sync else []
        entries = [_checksum_file(path, chunk_bytes, pool) for path in paths]
        for done in syncs:
            done.result()
    return entries


def _checksum_file(path: Path, chunk_bytes: int, pool: ThreadPoolExecutor) -> dict[str, Any]:
    # mmap: a just-written file is in the page cache, so this checksums it without copying it.
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if not size:
            return {"size": 0, "crc32": []}
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            starts = range(0, size, chunk_bytes)
            crcs = list(pool.map(lambda start: zlib.crc32(view[start : start + chunk_bytes]), starts))
    return {"size": size, "crc32": [f"{crc:08x}" for crc in crcs]}


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def verify_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """Check every file listed in the manifest (present, same size, same CRC-32); return the manifest.

    Raises CheckpointError naming the first file that is missing, truncated or changed, or saying
    why the directory is not a complete checkpoint. One process checks everything here; a load by
    several processes splits the files between them (read_manifest, files_of_process, verify_files).
    """
    manifest = read_manifest(directory)
    verify_files(directory, manifest, sorted(manifest["files"]))
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint `directory`, checked for form (no file is read); CheckpointError
    saying why the directory is not a complete checkpoint of this format otherwise."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {directory}: the directory does not exist.")
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: it has no {MANIFEST_NAME}, which is written last, "
            "when every file has been saved (the save was interrupted, or this folder was made another "
            "way). Load another checkpoint, e.g. the newest complete one."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        version = manifest.get("format_version")
        chunk_bytes = int(manifest["chunk_bytes"])
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes}")
        for name, entry in manifest["files"].items():
            if not isinstance(entry["size"], int) or not isinstance(entry["crc32"], list):
                raise ValueError(f"the entry of {name} is {entry!r}")
    except (ValueError, AttributeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest_path} is not a valid checkpoint manifest ({error}).") from error
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} has format_version {version!r}, but this unison reads version "
            f"{FORMAT_VERSION}: the checkpoint was written by another unison version. Load it with that "
            "version."
        )
    return manifest


def verify_files(directory: str | os.PathLike, manifest: Mapping[str, Any], names: list[str]) -> None:
    """Check the files `names` of the checkpoint `directory` against `manifest` (present, same size,
    same CRC-32s); CheckpointError naming the first that is missing, truncated or changed."""
    directory = Path(directory)
    files, chunk_bytes = manifest["files"], int(manifest["chunk_bytes"])
    for name in names:
        if not (directory / name).is_file():
            raise CheckpointError(
                f"checkpoint file {directory / name} is missing: {MANIFEST_NAME} lists it, so the checkpoint "
                "was changed after it was saved. Restore the file or load another checkpoint."
            )
        size, expected = (directory / name).stat().st_size, files[name]["size"]
        if size != expected:
            raise CheckpointError(
                f"checkpoint file {directory / name} has {size} bytes but {MANIFEST_NAME} records {expected} "
                "(truncated?). Restore the file or load another checkpoint."
            )
    actual = _checksum_files([directory / name for name in names], chunk_bytes, sync=False)
    for name, found in zip(names, actual):
        expected = files[name]["crc32"]
        differing = [index for index, (a, b) in enumerate(zip(found["crc32"], expected)) if a != b]
        if differing or len(found["crc32"]) != len(expected):
            start = differing[0] * chunk_bytes if differing else 0
            raise CheckpointError(
                f"checkpoint file {directory / name} does not match its checksums in {MANIFEST_NAME} (first "
                f"difference in bytes {start}-{start + chunk_bytes - 1}): it was edited or corrupted after "
                "saving. Restore the file or load another checkpoint."
            )


def fsync_directory(directory: Path) -> None:
    """Make the directory's entries (new files, renames) durable, not only the files' contents."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
