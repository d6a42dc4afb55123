"""Checkpoint directories on disk: written atomically, listed by step, verified before loading.

A checkpoint is a directory whose files are written into a hidden sibling `.<name>.tmp` and renamed
into place only once every process has written its files and the main process has added
`manifest.json` (each file's size and CRC-32 checksums). A crash or SIGKILL mid-save therefore leaves
at most a hidden temporary directory, never a half-written checkpoint that looks complete; the next
save of that name removes the leftover. Loading verifies the manifest first, so a truncated or edited file is
refused with its name instead of surfacing later as an unpickling error or silently wrong weights.
Objects are read with `torch.load(weights_only=True)`: loading a checkpoint never executes code.

Each process checksums the files it wrote, and on load verifies its share of them (see
`checksumming_process`); the main process only gathers the results, a few bytes per 8 MiB. A 70B
model with Adam is ~1.1 TB: checksummed by one process (about 3 GB/s per core) it would take minutes
while every other process waited in a collective under the group timeout. Split by process, each
process's checksums cost about what writing or reading its own shards costs, and they run at the same
time on every process, so the waits stay as short as the processes' work is even.

CRC-32 rather than a cryptographic hash: it is there to catch accidental damage (truncation, a flipped
byte, a file edited by hand), not an attacker (weights_only loading is the guard against that), and it
is the fastest checksum the standard library has (100 MB: crc32 25 ms, sha256 58 ms, blake2b 119 ms on
the 2-core development VM). One CRC per 8 MiB chunk lets every core checksum a part of a large file, so
a save or load stays near the cost of a plain torch.save/torch.load.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..state import PartialState
from .errors import CheckpointError
from .manifest import (
    MANIFEST_NAME,
    checksum_own_files,
    fsync_directory,
    write_manifest,
)

logger = logging.getLogger("unison")

CHECKPOINT_PREFIX = "checkpoint_"
_CHECKPOINT_NAME = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)")
NEARLY_FULL_BYTES = 2**20
"""A failed save on a file system with less free space than this is said to have run out of space (a
full disk leaves the failed file's partial bytes behind: the space left is then about nothing)."""


@dataclass
class ProjectConfiguration:
    """Where a project's checkpoints and logs go (Accelerate's fields and defaults).

    `save_state()` without a directory always names the checkpoint itself:
    `project_dir/checkpoints/checkpoint_<optimizer step>`, keeping at most `total_limit` of them (the
    oldest are removed); `load_state()` without one loads the newest complete one. So
    automatic_checkpoint_naming=True, which asks Accelerate for that, changes nothing here (scripts
    that set it run as they are). Two fields this layout cannot honour are refused rather than
    ignored: `iteration` (names count optimizer steps, so a resumed run names its saves on from where
    it is; a save counter to start from has no meaning) and `save_on_each_node` (process 0 writes
    each checkpoint into one directory every process reads: a filesystem shared by the nodes).
    logging_dir follows project_dir unless it is given; it is where experiment trackers write, and
    unison has none yet (Accelerate's `init_trackers`), so nothing is written there today.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    async_save: bool = False  # unison's: save_state() writes in the background (docs/checkpointing.md)
    _logging_dir_given: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        self._logging_dir_given = self.logging_dir is not None
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None:
            _check_total_limit(self.total_limit)
        if self.iteration != 0 or isinstance(self.iteration, bool):
            raise ValueError(
                f"ProjectConfiguration(iteration={self.iteration!r}): unison names checkpoints by optimizer "
                "step (checkpoints/checkpoint_<step>), and a resumed run goes on from the step it loaded, "
                "so there is no save counter to set. Leave iteration at 0."
            )
        if self.save_on_each_node:
            raise ValueError(
                "ProjectConfiguration(save_on_each_node=True): unison writes each checkpoint once, from "
                "process 0, into a directory every process reads, which needs a filesystem shared by the "
                "nodes; it does not write a copy per node. Leave save_on_each_node=False and put "
                "project_dir on a shared filesystem."
            )

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set project_dir, and logging_dir with it unless logging_dir was given explicitly."""
        self.project_dir = None if project_dir is None else os.fspath(project_dir)
        if not self._logging_dir_given:
            self.logging_dir = self.project_dir

    @property
    def checkpoints_dir(self) -> Path:
        """`project_dir/checkpoints`, the folder automatic checkpoint naming saves into."""
        if self.project_dir is None:
            raise ValueError(
                "ProjectConfiguration has no project_dir, so there is no checkpoints folder: pass "
                "ProjectConfiguration(project_dir='runs/my_run', ...) or give save_state/load_state a path."
            )
        return Path(self.project_dir) / "checkpoints"


def _check_total_limit(total_limit: Any) -> None:
    if isinstance(total_limit, bool) or not isinstance(total_limit, int) or total_limit < 1:
        raise ValueError(
            f"total_limit={total_limit!r} is not allowed: it is the number of checkpoints to keep and must "
            "be an integer >= 1 (keeping none would delete the checkpoint just saved). Pass None to keep all."
        )


def checkpoint_path(checkpoints_dir: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint for `step`: `checkpoints_dir/checkpoint_<step>`."""
    return Path(checkpoints_dir) / f"{CHECKPOINT_PREFIX}{step}"


def temporary_path(final_dir: str | os.PathLike) -> Path:
    """The hidden sibling a checkpoint is written into before it is renamed to `final_dir`."""
    final_dir = Path(final_dir)
    return final_dir.parent / f".{final_dir.name}.tmp"


def _aside_path(final_dir: Path) -> Path:
    """Where an existing directory is moved while its replacement is renamed in, then deleted."""
    return final_dir.parent / f".{final_dir.name}.old"


def raise_if_any_process_failed(
    error: Exception | None, action: str, result: Any = None, group: Any = None
) -> list[Any]:
    """Make one process's failure in a step of a save or load the failure of that step everywhere.

    Collective: every process says whether its part of `action` raised (`error`). A process whose part
    failed raises its own exception; the others raise a CheckpointError naming the processes that
    failed. Without this, the failure of one process (a full disk under rank 0's replicated files, an
    out-of-memory read on one GPU) would leave its peers waiting in the next barrier, or, if the
    script catches the error, pair their next collective with another one. It only helps between the
    collectives of a step: a failure inside a collective ends the run through the group's timeout.
    When no process failed, returns every process's `result` in rank order: the same all-gather brings
    the main process what each process computed (its files' checksums), with no collective of its own.
    `group`: the process group to agree over (None: the default one; an asynchronous save's background
    writer has a group of its own, so its collectives never pair with the training loop's).
    """
    state = PartialState()
    reports = [(None if error is None else f"{type(error).__name__}: {error}", result)]
    if state.num_processes > 1:
        everyone: list[tuple[str | None, Any] | None] = [None] * state.num_processes
        torch.distributed.all_gather_object(everyone, reports[0], group=group)
        reports = everyone
    if error is not None:
        raise error
    failed = [rank for rank, (report, _) in enumerate(reports) if report is not None]
    if failed:
        raise CheckpointError(
            f"{action} failed on process(es) {failed}, so on every process ({reports[failed[0]][0]}; each "
            "failed process's own traceback says more). Nothing was applied or renamed into place."
        )
    return [result for _, result in reports]


# -- writing -------------------------------------------------------------------------------------
def _refuse_different_directories(final_dir: Path, state: PartialState) -> None:
    """Every process must name the same checkpoint directory (Accelerate lets each write its own; unison
    writes one checkpoint that all processes fill): refused on every process before anything is written."""
    if state.num_processes == 1:
        return
    named: list[str | None] = [None] * state.num_processes
    torch.distributed.all_gather_object(named, str(final_dir.absolute()))
    if len(set(named)) > 1:
        listing = ", ".join(f"process {rank}: {path}" for rank, path in enumerate(named))
        raise CheckpointError(
            f"the processes were asked to save into different directories ({listing}): one checkpoint is "
            "written by all processes together, so pass every process the same path (e.g. one computed on "
            "the main process and broadcast, or from project_dir)."
        )


@contextlib.contextmanager
def write_checkpoint(
    final_dir: str | os.PathLike, metadata: Mapping[str, Any] | None = None
) -> Iterator[Path]:
    """Context manager, entered by every process: yield a temporary directory to write files into.

    The main process creates `.<name>.tmp` next to `final_dir` (removing a leftover of a killed save)
    and everyone waits for it. When the block ends normally on every process, each process fsyncs and
    checksums its files (see `checksumming_process`), the main process gathers the checksums, lists
    every file with its size and CRC-32s in manifest.json (plus `metadata`, any JSON-serialisable dict),
    fsyncs it, and renames the directory to `final_dir`, replacing an existing one of that name; the
    other processes wait until that is done. If the block raises on any process (or a checksum, or the
    main process's finish, fails), nothing is renamed: an existing checkpoint of the same name stays as
    it was, and every process raises (see `raise_if_any_process_failed`).
    """
    final_dir = Path(final_dir)
    metadata = checked_metadata(metadata)
    tmp_dir = begin_checkpoint(final_dir)
    block_error = None
    try:
        yield tmp_dir
    except Exception as error:
        block_error = error
    except BaseException:  # Ctrl-C, SystemExit: the run is ending, no agreement to wait for
        abandon_checkpoint(tmp_dir)
        raise
    finish_checkpoint(tmp_dir, final_dir, metadata, block_error)


def checked_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """`metadata` as a dict, or a CheckpointError before anything is written if JSON cannot hold it."""
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint metadata {metadata!r} cannot be written to {MANIFEST_NAME}: {error}. Pass only "
            "JSON types (dict, list, str, int, float, bool, None)."
        ) from error
    return metadata


def begin_checkpoint(final_dir: Path) -> Path:
    """The first phase of `write_checkpoint`, on every process: the main process creates the temporary
    directory (removing a leftover of a killed save); returns it once every process knows it exists."""
    state = PartialState()
    tmp_dir = temporary_path(final_dir)
    _refuse_different_directories(final_dir, state)
    setup_error = None
    if state.is_main_process:
        try:
            final_dir.parent.mkdir(parents=True, exist_ok=True)
            _remove_if_present(tmp_dir)
            tmp_dir.mkdir()
        except OSError as error:  # a parent that is a file, no permission: every process must hear of it
            setup_error = CheckpointError(
                f"cannot create the checkpoint {final_dir}: {error}. Save into a directory this process "
                "can create and write (under existing directories, not under a file)."
            )
    raise_if_any_process_failed(setup_error, f"creating {final_dir}")  # also the barrier before writing
    return tmp_dir


def finish_checkpoint(
    tmp_dir: Path,
    final_dir: Path,
    metadata: dict[str, Any],
    block_error: Exception | None = None,
    group: Any = None,
) -> None:
    """The last phase of `write_checkpoint`, on every process once it has written its files (or failed
    to: `block_error`): checksums, the manifest, the rename, agreed over `group` (None: the default one).
    Raises on every process, leaving nothing renamed, if any process failed."""
    state = PartialState()
    try:
        error = None if block_error is None else _said_if_out_of_space(block_error, final_dir)
        raise_if_any_process_failed(error, f"saving {final_dir}", group=group)  # every process has written
        entries = checksum_error = finish_error = None
        try:
            entries = checksum_own_files(tmp_dir, state)
        except Exception as error:
            checksum_error = _said_if_out_of_space(error, final_dir)
        everyone = raise_if_any_process_failed(checksum_error, f"checksumming {final_dir}", entries, group)
        if state.is_main_process:
            try:
                files = {name: entry for entries in everyone for name, entry in entries.items()}
                manifest = write_manifest(tmp_dir, metadata, files)
                _move_into_place(tmp_dir, final_dir)
            except Exception as error:
                finish_error = _said_if_out_of_space(error, final_dir)
            else:
                total = sum(entry["size"] for entry in manifest["files"].values())
                logger.info(
                    "saved checkpoint %s (%d files, %.1f MB)", final_dir, len(manifest["files"]), total / 1e6
                )
        # also the barrier after which final_dir exists for everyone
        raise_if_any_process_failed(finish_error, f"finishing the checkpoint {final_dir}", group=group)
    except BaseException:
        abandon_checkpoint(tmp_dir)
        raise


def abandon_checkpoint(tmp_dir: Path) -> None:
    """Remove a checkpoint's temporary directory (the main process's part of a failed save)."""
    if PartialState().is_main_process:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def abandon_checkpoint_in_flight(tmp_dir: Path) -> bool:
    """Remove the temporary directory of a save that a background writer may still be writing; whether
    this process did (the main process does, unless it was gone already: the writer had just renamed it
    into place, or removed it after failing). It is renamed aside first, atomically, so the writer's own
    rename into place fails rather than publish a directory being deleted (its later files fail too:
    their paths are gone)."""
    if not PartialState().is_main_process:
        return False
    aside = tmp_dir.with_name(tmp_dir.name + ".abandoned")
    _remove_if_present(aside)
    try:
        os.replace(tmp_dir, aside)
    except FileNotFoundError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _said_if_out_of_space(error: Exception, final_dir: Path) -> Exception:
    """`error` of a write of the checkpoint `final_dir`, as a CheckpointError that says so where the disk
    (or the quota) is full: torch.save reports a full disk as `[enforce fail at inline_container.cc:...]
    unexpected pos 576 vs 534`, without the OS's reason. Any other error is returned as it is."""
    causes, cause = [], error
    while cause is not None and len(causes) < 10:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    out_of_space = any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes)
    try:
        free = shutil.disk_usage(final_dir.parent).free
    except OSError:
        return error
    if not out_of_space and free >= NEARLY_FULL_BYTES:
        return error
    return CheckpointError(
        f"the checkpoint {final_dir} could not be written: the disk holding it is full ({free:,} bytes "
        f"free; {type(error).__name__}: {error}). Free space there or save elsewhere "
        "(ProjectConfiguration(total_limit=N) keeps only the newest N checkpoints). Nothing was renamed "
        "into place: the previous checkpoints are intact."
    )


def _move_into_place(tmp_dir: Path, final_dir: Path) -> None:
    """Rename tmp_dir to final_dir; an existing final_dir is moved aside first and deleted after.

    rename(2) cannot replace a non-empty directory, so there is a short window in which final_dir is
    missing (its old version is in `.<name>.old`); a crash there loses only that one name, never a
    checkpoint of another step.
    """
    aside = _aside_path(final_dir)
    replacing = final_dir.exists()
    if replacing:
        _remove_if_present(aside)
        os.replace(final_dir, aside)
    os.replace(tmp_dir, final_dir)
    fsync_directory(final_dir.parent)
    if replacing:
        shutil.rmtree(aside)


def _remove_if_present(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# -- reading -------------------------------------------------------------------------------------
def list_checkpoints(checkpoints_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (`checkpoint_<int>` with a manifest) in `checkpoints_dir`, oldest step first.

    Temporary directories of unfinished saves and folders without a manifest are not checkpoints.
    A missing `checkpoints_dir` has none.
    """
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for path in checkpoints_dir.iterdir():
        match = _CHECKPOINT_NAME.fullmatch(path.name)
        if match and (path / MANIFEST_NAME).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def newest_checkpoint(checkpoints_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in `checkpoints_dir`, or None if there is none."""
    checkpoints = list_checkpoints(checkpoints_dir)
    return checkpoints[-1] if checkpoints else None


def prune_checkpoints(checkpoints_dir: str | os.PathLike, total_limit: int) -> list[Path]:
    """Remove the oldest complete checkpoints beyond `total_limit`; return the removed paths.

    Only the main process removes (the others return []); there is no barrier inside, so call it on
    every process or on the main one alone. Each is renamed aside before deletion, so an interrupted
    prune never leaves a partly deleted directory that still looks complete.
    """
    _check_total_limit(total_limit)
    if not PartialState().is_main_process:
        return []
    checkpoints = list_checkpoints(checkpoints_dir)
    removed = checkpoints[: max(0, len(checkpoints) - total_limit)]
    for path in removed:
        aside = _aside_path(path)
        _remove_if_present(aside)
        os.replace(path, aside)
        shutil.rmtree(aside)
        logger.info("removed old checkpoint %s (total_limit=%d)", path, total_limit)
    return removed


# -- objects -------------------------------------------------------------------------------------
def save_object(obj: Any, path: str | os.PathLike) -> None:
    """Write `obj` (tensors, state dicts, plain Python containers and numbers) with torch.save."""
    torch.save(obj, path)


def load_object(path: str | os.PathLike, map_location: Any = None, mmap: bool = False) -> Any:
    """Read an object written by save_object with torch.load(weights_only=True): no code is executed.

    mmap: the tensors map the file instead of being read into memory (torch.load(mmap=True)), so only
    the pages used are read, and they stay reclaimable page cache (map_location must be the CPU).

    An object that weights_only refuses (an instance of an arbitrary class) raises CheckpointError
    naming the file and the refused type.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        detail = str(error).split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        reason = detail[0] if detail else type(error).__name__
        raise CheckpointError(
            f"{path} holds an object that cannot be loaded safely: torch.load(weights_only=True) refused it "
            f"({reason}). Checkpoints are loaded without running code, so save state dicts of tensors and "
            "plain Python values; if you wrote this file and trust the type, allow it with "
            "torch.serialization.add_safe_globals([...])."
        ) from error
