"""How a rank that raises ends: its traceback printed once, its peers ended within seconds, its exit
handlers run.

Without this, a rank that raises while a non-daemon thread lives (a DataLoader feeder, a logger) stays
alive and its peers wait in a collective until the timeout; and when it does end, every peer prints a
traceback of its own ("Connection closed by peer"), burying the one that matters. So the first rank to
fail announces it through the hang watchdog's store keys (`watchdog.py`): its traceback is printed, its
peers end at their watchdog's next check (within a second) and a peer that raised a consequence of it
is silent (`unison launch` lists those ranks in one line). The failing rank then exits the normal way,
so atexit handlers (trackers, log flushes, the checkpoint writer's clean-up) run, and ends once they
have, without the interpreter's teardown (see Watchdog._at_exit); a daemon timer ends it after
EXIT_GRACE_SECONDS should a thread or a handler hang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from typing import TYPE_CHECKING

from .elastic_record import record_for_the_elastic_agent
from .mismatch import DistributedOperationException
from .position import traceback_position
from .processes import end_process
from .watchdog import EXIT_GRACE_SECONDS

if TYPE_CHECKING:
    from .watchdog import Watchdog


def end_fast_on_uncaught_error(rank: str, watchdog: Watchdog | None) -> None:
    """Install the process-wide excepthook described in the module docstring."""
    previous_hook = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            if "TORCHELASTIC_RUN_ID" in os.environ:  # Ctrl-C reached the launcher, which says so once
                end_process(128 + signal.SIGINT)
            previous_hook(exc_type, exc, tb)
            end_process(1)
        _end_later(EXIT_GRACE_SECONDS)
        if watchdog is not None and watchdog.ending:  # a consequence of the report the watchdog is making:
            threading.Event().wait(EXIT_GRACE_SECONDS)  # its thread ends the process
        summary = f"{exc_type.__name__}: {exc}".strip()
        first_line = summary.splitlines()[0] if summary else exc_type.__name__
        here = traceback_position(tb)
        if watchdog is not None and here is not None and _is_collective_timeout(exc):
            with contextlib.suppress(Exception):
                watchdog.report("stall", here, _waited(exc))  # diagnoses, dumps stacks and exits
        mismatch = watchdog is not None and here is not None and _is_mismatch(exc)
        if mismatch:  # every rank raises it: the first names each rank's call
            with contextlib.suppress(Exception):
                watchdog.share_raised(here)
        first = not _is_peer_gone(exc)
        if watchdog is not None and first:
            with contextlib.suppress(Exception):  # the store is gone: say everything, as the first
                first = watchdog.announce_failure(f"rank {rank} failed: {first_line}")
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        if first:
            calls = watchdog.raised_calls() if mismatch else ""
            sys.stderr.write(f"[unison] rank {rank} failed:\n{text}{calls}")
            record_for_the_elastic_agent(rank, summary, text + calls)
        else:  # silent: `unison launch` lists these ranks in one line after the cause
            record_for_the_elastic_agent(rank, f"stopped after another rank ended: {first_line}", text, True)
        sys.stdout.flush()
        sys.stderr.flush()
        if watchdog is not None:
            watchdog.failed = True
            if not first:
                watchdog.await_exit_of()  # the failed rank's exit handlers run before the agent stops it
        # Returning lets the interpreter exit with status 1 the normal way, running atexit handlers: the
        # watchdog's runs after those registered later (the user's, once the state exists), then ends the
        # process without the teardown, so handlers registered before the state was formed do not run.

    sys.excepthook = hook


def _is_peer_gone(exc: BaseException) -> bool:
    """A collective that failed because a peer process ended (gloo: "Connection closed by peer",
    "Connection reset by peer"; NCCL: "remote process exited"): a consequence, never the cause."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        phrase in text
        for phrase in ("connection closed by peer", "connection reset by peer", "remote process exit")
    )


def _is_mismatch(exc: BaseException) -> bool:
    """Ranks called different collectives and every rank raises it (debug mode's checks: torch's
    "Detected mismatch between collectives", unison's DistributedOperationException)."""
    return isinstance(exc, DistributedOperationException) or "Detected mismatch between collectives" in str(
        exc
    )


def _is_collective_timeout(exc: BaseException) -> bool:
    """gloo's "Timed out waiting 15000ms for recv operation to complete" and torch's DistBackendError
    timeouts: a collective that the group's timeout ended (a wait the watchdog could not see)."""
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


def _waited(exc: BaseException) -> float:
    """The seconds a timeout error says it waited (gloo says "Timed out waiting 15000ms"), else 0."""
    for word in str(exc).split():
        if word.endswith("ms") and word[:-2].isdigit():
            return int(word[:-2]) / 1000
    return 0.0


def _end_later(seconds: float) -> None:
    timer = threading.Timer(seconds, end_process, args=(1,))
    timer.daemon = True
    timer.start()
