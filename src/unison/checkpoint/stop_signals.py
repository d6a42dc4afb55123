"""What SIGINT and SIGTERM do to an asynchronous save in flight: it is finished first, within a bound.

Ctrl-C 0.2 s after save_state(async_save=True) returned used to lose that checkpoint silently: a
launched process ends on KeyboardInterrupt at once (health/failure.py), and on SIGTERM by its default
action, killing the writer thread mid-write and leaving 123 MB in a hidden `.checkpoint_N.tmp` while
the script had been told the save was under way. So while a save is in flight, `FinishOnStop` handles
both signals: each process gives its writer up to UNISON_CHECKPOINT_GRACE seconds more (default
env_vars.DEFAULT_CHECKPOINT_GRACE_SECONDS), at full priority, then lets the signal take its usual course
(KeyboardInterrupt, a handler of the user's, or the default end). Every process waits, since the writers
finish the checkpoint together. Past the bound the save is abandoned, and the main process removes its
temporary directory.

Each process says what became of the save: the checkpoint is complete, or it is lost and which complete
one is the newest. Under `unison launch` it leaves that in a folder of the launch's
(env_vars.INTERRUPTED_SAVE_NOTES), and the launcher's last line says it; elsewhere (python, torchrun,
srun) the main process logs it as a warning. Every process, not only the main one, because a process
runs its Python handler only when its main thread runs Python: one blocked in a collective (gloo's, or a
CUDA synchronisation behind NCCL) that a peer, waiting in its own handler, will not join, handles the
signal only once that peer has ended, and by then its writer has finished (it is reported as such) or
its time may be up. Before it waits, a process also leaves what to say should it be SIGKILLed meanwhile
(a second Ctrl-C, a TORCH_ELASTIC_SHUTDOWN_TIMEOUT shorter than the grace): that the save is lost.

`unison launch` gives its workers the grace plus env_vars.STOP_MARGIN_SECONDS before its agent SIGKILLs
them (launching/launcher.py). The handler steps aside before it waits, so a second signal takes the
usual course at once: pressing Ctrl-C twice stops without finishing the save.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from .. import env_vars
from ..state import PartialState
from .manifest import MANIFEST_NAME
from .storage import newest_checkpoint, temporary_path

logger = logging.getLogger("unison")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class StoppedSave:
    """What became of the last save started in the background when a stop signal came: `outcome` is
    "completed", "failed" (`error` says why) or "abandoned" (still writing after `grace` seconds;
    `removed`: this process removed its temporary directory). `seconds` waited for it; None when it had
    ended before this process handled the signal."""

    checkpoint: Path
    outcome: str
    grace: float
    seconds: float | None = None
    error: str | None = None
    removed: bool = False


class FinishOnStop:
    """SIGINT/SIGTERM handlers that first call `finish(signal_name)` (the writer's bounded wait).

    `install()` when a save starts, `restore()` when it has been waited for: both act from the main
    thread only (the only one Python lets set handlers; a save started elsewhere keeps the old ones),
    and restore() leaves alone a handler installed after ours, which then is the user's to run.
    """

    def __init__(self, finish: Callable[[str], None]) -> None:
        self._finish = finish
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for number in STOP_SIGNALS:
            previous = signal.getsignal(number)
            # None: set outside Python, which cannot be chained to; SIG_IGN: the signal stops nothing
            if previous not in (None, signal.SIG_IGN):
                self._previous[number] = previous
                signal.signal(number, self._handle)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for number, previous in self._previous.items():
            if signal.getsignal(number) == self._handle:
                signal.signal(number, previous)
        self._previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        previous = self._previous.get(number, signal.SIG_DFL)
        self.restore()  # a second signal while the save finishes takes the usual course at once
        try:
            self._finish(signal.Signals(number).name)
        finally:
            if callable(previous):
                previous(number, frame)  # SIGINT's is Python's default_int_handler: KeyboardInterrupt
            else:  # SIG_DFL: the default action (SIGTERM ends the process), as without this handler
                signal.raise_signal(number)


def report_killed_meanwhile(checkpoint: Path, grace: float) -> None:
    """Before the wait: what `unison launch`'s line says should this process be SIGKILLed during it."""
    _write_note(
        "waiting",
        f"{_being_saved(checkpoint)} was still being finished when the workers were killed, before "
        f"{_grace(grace)} had passed, so it is lost (its partial files are in {temporary_path(checkpoint)}, "
        f"which the next save of that name removes); {_newest(checkpoint)}.",
    )


def report(stopped: StoppedSave, signal_name: str) -> None:
    """Say what became of the save: in the folder `unison launch` reads for its last line, else (main
    process) as a warning."""
    said = describe(stopped)
    if not _write_note("outcome", said) and PartialState().is_main_process:
        logger.warning("unison: stopped by %s; %s", signal_name, said)


def describe(stopped: StoppedSave) -> str:
    """One sentence: the checkpoint is complete, or it is lost and which complete one is the newest."""
    checkpoint, grace = stopped.checkpoint, _grace(stopped.grace)
    if stopped.seconds is None:
        saved = f"the checkpoint saved in the background, {checkpoint},"
        if stopped.outcome == "completed":
            return f"{saved} is complete."
        return f"{saved} failed ({stopped.error}); {_newest(checkpoint)}."
    being_saved = _being_saved(checkpoint)
    if stopped.outcome == "completed":
        return f"{being_saved} was finished first ({stopped.seconds:.1f} s; {grace}): it is complete."
    if stopped.outcome == "failed":
        return f"{being_saved} failed ({stopped.error}); {_newest(checkpoint)}."
    removed = " and its temporary folder removed" if stopped.removed else ""
    return (
        f"{being_saved} was abandoned after {grace}{removed}; {_newest(checkpoint)} "
        f"(export {env_vars.CHECKPOINT_GRACE}=SECONDS to let a save finish)."
    )


def _write_note(kind: str, said: str) -> bool:
    """Leave `said` as this process's `kind` of note ("waiting", "outcome") where `unison launch` reads
    it for its last line; False where no launcher reads one (python, torchrun, srun) or it cannot be
    written."""
    folder = os.environ.get(env_vars.INTERRUPTED_SAVE_NOTES)
    if not folder:
        return False
    note = Path(folder) / f"{PartialState().process_index}.{kind}"
    partial = note.with_name(note.name + ".partial")
    try:
        partial.write_text(said)
        os.replace(partial, note)  # whole or not at all: the process may be SIGKILLed at any time
    except OSError:  # the launcher's folder is gone
        return False
    return True


def _being_saved(checkpoint: Path) -> str:
    return f"the checkpoint being saved in the background, {checkpoint},"


def _grace(grace: float) -> str:
    return f"{env_vars.CHECKPOINT_GRACE}={grace:g} s"


def _newest(lost: Path) -> str:
    """Which complete checkpoint a resumed run would load instead of `lost`."""
    newest = newest_checkpoint(lost.parent)
    if newest is None and (lost / MANIFEST_NAME).is_file():
        newest = lost  # a save over an existing checkpoint of that name leaves the old one as it was
    if newest is None:
        return f"{lost.parent} holds no complete checkpoint"
    return f"the newest complete checkpoint is {newest}"
