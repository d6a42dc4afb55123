"""Writing a checkpoint's files, now or in the background (`save_state(async_save=True)`).

A save first collects what each process writes (`CheckpointWrites`: the sharded parts' states, through
DCP, and the files written with torch.save), then writes them into the checkpoint's temporary directory
and finishes it (checksums, manifest, rename: storage.finish_checkpoint). Synchronously that is
`write_and_finish`. `AsyncCheckpointWriter` instead copies everything into host memory first (torch's
StateDictStager: buffers reused from one save to the next, pinned where a GPU exists) and returns; a
background thread writes the copies and finishes the checkpoint over a gloo process group of its own,
so its collectives never pair with the training loop's, and on CPU that training leaves idle until
something waits for it (idle_priority.py). Every guarantee of a synchronous save holds:
the directory appears complete or not at all, and at most one save is in flight. A process told to stop
(SIGINT, SIGTERM) while a save is in flight finishes it first, within a bound (stop_signals.py).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import env_vars
from ..state import PartialState
from .idle_priority import IdlePriority
from .manifest import MANIFEST_NAME
from .stop_signals import FinishOnStop, StoppedSave, report, report_killed_meanwhile
from .storage import abandon_checkpoint_in_flight, finish_checkpoint, save_object

logger = logging.getLogger("unison")


@dataclass
class CheckpointWrites:
    """What one process writes into a checkpoint: DCP directories (name -> state, this process's
    shards) and files (path -> object for torch.save)."""

    parts: dict[Path, dict[str, Any]] = field(default_factory=dict)
    files: dict[Path, Any] = field(default_factory=dict)


def write_and_finish(
    writes: CheckpointWrites, staging: Path, final_dir: Path, metadata: dict[str, Any], group: Any = None
) -> None:
    """Write `writes` into `staging`, then finish the checkpoint (every process; collective over `group`).
    A failure on any process leaves nothing renamed and raises on every process."""
    error = None
    try:
        from .sharded import write_part  # DCP: only layouts with sharded parts load it

        for directory, state in writes.parts.items():  # the same order on every process
            write_part(state, directory, group)
        for path, obj in writes.files.items():
            save_object(obj, path)
    except Exception as exc:
        error = exc
    finish_checkpoint(staging, final_dir, metadata, error, group)


class AsyncCheckpointWriter:
    """One Accelerator's background checkpoint writer: at most one save in flight.

    `prepare()` (collective, before the save's first file) makes the writer's process group once and
    waits for the previous save; `stage()` copies a save's objects to host memory; `start()` writes and
    finishes it on a thread. `wait()` returns when no save is in flight, raising the failure of the last
    one (on every process: the thread's finish agrees over the processes). The interpreter's exit waits
    too, so a script that ends right after save_state still leaves a complete checkpoint; so does a
    SIGINT or SIGTERM, for at most UNISON_CHECKPOINT_GRACE seconds (`_finish_on_stop`).
    """

    def __init__(self) -> None:
        self._group: Any = None
        self._stager: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: Path | None = None
        self._staging: Path | None = None
        self._abandoned = False  # a stop signal's grace ran out: the exit does not wait for the thread
        self._exit_wait_registered = False
        self._priority = IdlePriority()  # the write in flight's: idle CPU only, until something waits for it
        self._grace = env_vars.DEFAULT_CHECKPOINT_GRACE_SECONDS  # read again as each save starts
        self._stop_signals = FinishOnStop(self._finish_on_stop)

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint being written in the background, or None."""
        return self._in_flight if self._thread is not None and self._thread.is_alive() else None

    def prepare(self) -> None:
        """Wait for the previous save (saying so if it was not done), and make the writer's group; read
        UNISON_CHECKPOINT_GRACE (stop_signals.py)."""
        self._grace = env_vars.checkpoint_grace_seconds()  # a wrong value fails here, before any file
        pending = self.in_flight
        started = time.perf_counter()
        self.wait()
        if pending is not None:
            logger.info(
                "save_state waited %.2f s for the previous asynchronous save (%s) to finish: at most one "
                "save is in flight; save less often, or on faster storage, to wait less.",
                time.perf_counter() - started,
                pending,
            )
        if self._group is None and dist.is_available() and dist.is_initialized():
            # collective: every process's first async save (also a one-process group, as ZeRO offload on one
            # GPU forms: its DCP write must not run collectives on the group training uses)
            self._group = dist.new_group(backend="gloo")

    def stage(self, writes: CheckpointWrites) -> CheckpointWrites:
        """A copy of `writes` in host memory, made now, so training may change the live tensors."""
        from torch.distributed.checkpoint.staging import StateDictStager

        if self._stager is None:
            self._stager = StateDictStager(pin_memory=torch.cuda.is_available())
        # the previous save has finished (prepare waited): its buffers, reused here, are free again
        staged = self._stager.stage({"parts": writes.parts, "files": writes.files})
        return CheckpointWrites(parts=staged["parts"], files=staged["files"])

    def start(
        self,
        writes: CheckpointWrites,
        staging: Path,
        final_dir: Path,
        metadata: dict[str, Any],
        on_complete: Callable[[], Any] | None = None,
    ) -> None:
        """Write and finish the staged checkpoint on a background thread; then call `on_complete` (the
        pruning of older checkpoints, which must wait until this one is complete)."""
        if not self._exit_wait_registered:
            _at_interpreter_exit(self._wait_at_exit)
            self._exit_wait_registered = True
        self._error, self._in_flight, self._staging, self._priority = None, final_dir, staging, IdlePriority()
        self._abandoned = False
        self._thread = threading.Thread(
            target=self._write,
            args=(writes, staging, final_dir, metadata, on_complete),
            name="unison-checkpoint-writer",
            daemon=True,  # a process killed mid-write leaves the temporary directory, never a checkpoint
        )
        self._thread.start()
        self._stop_signals.install()

    def _write(
        self,
        writes: CheckpointWrites,
        staging: Path,
        final_dir: Path,
        metadata: dict[str, Any],
        on_complete: Callable[[], Any] | None,
    ) -> None:
        started = time.perf_counter()
        self._priority.lower_this_thread()
        try:
            write_and_finish(writes, staging, final_dir, metadata, self._group)
            seconds = time.perf_counter() - started
            logger.info("saved the training state to %s (in the background, %.2f s)", final_dir, seconds)
            if on_complete is not None:
                on_complete()
        except BaseException as error:  # handed to the training thread by wait()
            self._error = error

    def wait(self) -> Path | None:
        """Block until no save is in flight; the checkpoint it finished (None if none was), or its error."""
        thread, finished = self._thread, self._in_flight
        if thread is None:
            return None
        self._priority.restore()  # whoever waits, training is not running: the write takes full CPU
        try:
            thread.join()  # a stop signal meanwhile still finishes the save first, within the grace
        finally:
            self._stop_signals.restore()
        self._thread, self._in_flight = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return finished

    def _finish_on_stop(self, signal_name: str) -> None:
        """A stop signal came (stop_signals.py): give the save in flight up to the grace to finish, then
        abandon it (the main process removes its temporary directory); say which. A save that ended
        before this process could handle the signal (its main thread was blocked) is reported too."""
        thread, final_dir = self._thread, self._in_flight
        if thread is None or final_dir is None:  # nothing saved in the background since the last wait
            return
        seconds = None
        if thread.is_alive():
            started = time.perf_counter()
            report_killed_meanwhile(final_dir, self._grace)
            self._priority.restore()  # training has stopped: the write takes full CPU
            thread.join(self._grace)
            seconds = time.perf_counter() - started
        outcome, removed = "completed" if self._error is None else "failed", False
        if thread.is_alive():
            self._abandoned, outcome = True, "abandoned"
            removed = abandon_checkpoint_in_flight(self._staging)
            if PartialState().is_main_process and not removed:  # the writer got there first, just now
                outcome = "completed" if (final_dir / MANIFEST_NAME).is_file() else "failed"
        error = None if self._error is None else f"{type(self._error).__name__}: {self._error}"
        report(StoppedSave(final_dir, outcome, self._grace, seconds, error, removed), signal_name)

    def _wait_at_exit(self) -> None:
        if self._abandoned:  # its directory is gone; the thread may still be writing a file nobody will read
            return
        try:
            self.wait()
        except Exception as error:  # the exit goes on; the checkpoint was not renamed into place
            logger.error("unison: the asynchronous save in flight at exit failed: %s", error)


def _at_interpreter_exit(function: Callable[[], None]) -> None:
    """Run `function` when the main thread ends, before the interpreter shuts its thread pools down.

    An atexit handler runs too late for a write that still has work to schedule: by then
    concurrent.futures refuses new futures ("cannot schedule new futures after interpreter shutdown"),
    and the checksums and DCP's writer use thread pools. `threading._register_atexit` (Python 3.9+,
    private: the one place unison uses it; tests/test_checkpoint_state.py fails if it stops working)
    runs its functions first, latest registered first, so after this the pools' own exit hook. Where it
    is missing, atexit is the fallback: after the process group's exit handler, so before it."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(function)
        return
    register(function)
