"""How `unison launch` reports the end of a failed launch: which rank caused it, in one line.

torch's elastic agent reports every failed worker, with whole-second timestamps that often make a rank
it terminated itself look like the first failure, and logs whom it signalled on the way down. unison's
failure hook (`failure.py`) and hang watchdog (`watchdog.py`) record in each worker's error file whether
its failure was its own or a consequence, with the exact time; this module reads those records, names
the rank that caused the others, and filters the agent's lines that say the same thing less well.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

logger = logging.getLogger("unison")


def unison_record(failure: ProcessFailure) -> dict:
    """What unison's failure hook wrote in the worker's error file (empty when it wrote nothing)."""
    message = failure.error_file_data.get("message")
    return message.get("extraInfo", {}) if isinstance(message, dict) else {}


def cause_rank(failures: Mapping[int, ProcessFailure]) -> int:
    """The rank whose failure caused the others.

    When one worker fails, torch's agent SIGTERMs the rest, and those show up as failures too, with
    torch's whole-second timestamps that often sort before the real one. So a rank whose own failure
    unison recorded (it raised, or its watchdog reported a hang; with the exact time) comes first, then
    a rank that ended by a signal of its own (SIGKILL by the OOM killer, SIGSEGV), then the ranks that
    ended as a consequence (a peer went away, the watchdog ended them), and SIGTERM (the agent's own)
    last; within a kind, the earliest failure wins.
    """

    def kind(failure: ProcessFailure) -> tuple[int, float]:
        record = unison_record(failure)
        at = float(record.get("unison_failed_at", failure.timestamp))
        if record and not record.get("unison_consequence"):
            return 0, at
        if failure.exitcode > 0 and not record:
            return 1, at
        if failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM:
            return 2, at
        return (3 if record else 4), at

    return min(failures, key=lambda rank: kind(failures[rank]))


def report_failure(error: ChildFailedError) -> int:
    """Name the rank that failed first (the cause; its peers usually fail because it went away).

    The exit code is left out when unison recorded the failure itself: the agent may have SIGTERMed
    the rank while it ran its exit handlers, and "-15" would then mislead.
    """
    rank = cause_rank(error.failures)
    failure = error.failures[rank]
    others = sorted(r for r in error.failures if r != rank)
    cause = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
    cause = "" if cause.startswith("To enable traceback") else cause.rstrip(".")
    how = "" if unison_record(failure) else f", with exit code {failure.exitcode}"
    logger.error(
        "unison launch: rank %d (local rank %d, pid %d) failed first%s%s. Its output above is prefixed "
        "[rank%d]:.%s",
        rank,
        failure.local_rank,
        failure.pid,
        how,
        f": {cause}" if cause else "",
        rank,
        f" Ranks {others} were stopped or failed after it." if others else "",
    )
    return failure.exitcode if 0 < failure.exitcode < 128 else 1


def stopped_line(signal_name: str, notes: str) -> str:
    """The line a launch stopped by a signal ends with. What became of a save in flight then (finished
    first, or lost: checkpoint/stop_signals.py) is in `notes`, one file per worker that handled the
    signal: the lowest rank's outcome, else, when the workers were killed while they waited for it, what
    it said before waiting."""
    folder = Path(notes)
    for kind in ("outcome", "waiting"):
        written = sorted(folder.glob(f"*.{kind}"), key=lambda note: int(note.name.split(".")[0]))
        if written:
            return f"unison launch: stopped by {signal_name}; {written[0].read_text()}"
    return f"unison launch: stopped by {signal_name}; the workers were terminated."


class AgentShutdownChatter(logging.Filter):
    """Drops the lines of torch's elastic agent that `unison launch` says better itself.

    Which workers it signalled on the way down (two lines per Ctrl-C), and its own guess at the first
    failure, made from whole-second timestamps (it often names a rank the agent itself terminated).
    The templates are torch's; tests/test_launch.py fails if they change and the lines come back.
    """

    TEMPLATES = frozenset(
        {
            "Sending process %s closing signal %s",
            "Received %s death signal, shutting down workers",
            "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
        }
    )
    LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.TEMPLATES


@contextlib.contextmanager
def quiet_agent_shutdown() -> Iterator[None]:
    chatter = AgentShutdownChatter()
    loggers = [logging.getLogger(name) for name in AgentShutdownChatter.LOGGERS]
    for agent_logger in loggers:
        agent_logger.addFilter(chatter)
    try:
        yield
    finally:
        for agent_logger in loggers:
            agent_logger.removeFilter(chatter)
