"""The hang watchdog: a thread in every rank that turns a silent hang into a diagnosis within seconds.

A distributed job hangs when some ranks wait in a collective that others never reach: a rank stuck in
its data loading, ranks that called different collectives (one caught an exception and went on), a
deadlock. torch then waits out the process group's timeout (10-30 minutes) and reports "Timed out"
without a word on which rank diverged. Here each rank samples where its main thread is once a second
(`position.py`: no collective is wrapped, so a healthy step pays nothing) and the ranks coordinate
through the rendezvous store, as torch's own NCCL heartbeat monitor does:

- divergence: a rank blocked in a collective for DIVERGENCE_CHECK_SECONDS asks every rank where it is.
  Two ranks in the same group inside collectives with the same sequence number but a different
  operation or shapes (or both blocked at different sequence numbers) have diverged: that is reported
  at once, whatever the timeout.
- stall: a rank blocked in a collective for the stall timeout (the `timeout` setting; a longer one
  until the first optimizer step, which may compile or warm up) reports the hang, naming which ranks
  wait where and where the others are.
- a failure: the first rank that raises announces it (`failure.py`), and its peers end within a second
  instead of printing their own "connection closed" errors.

A report is printed once, by the rank that made it, and written to its elastic error file (so
`unison launch` repeats it in its summary); then every rank dumps its Python stacks (faulthandler, all
threads, and its data-loader workers) and ends with exit code 1.

Store keys, under the group's attempt prefix: "watch/ask" (a counter: positions wanted),
"watch/pos/R" (rank R's answer), "watch/verdict" (the report, set once), "watch/done" (ranks that
dumped their stacks), "watch/failed" (ranks that raised; the first one's traceback is printed).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import position as where
from .elastic_record import record_for_the_elastic_agent
from .position import Position
from .processes import child_processes, end_process, is_running

logger = logging.getLogger("unison")

CHECK_INTERVAL_SECONDS = 1.0
DIVERGENCE_CHECK_SECONDS = 5.0
"""A rank blocked this long in one collective asks the others where they are (one round of store
writes per blocked collective): long enough that a healthy collective has finished, short enough that
a divergence is reported in seconds rather than at the timeout."""
ANSWER_WAIT_SECONDS = 3.0
"""How long a reporting rank waits for the others' positions (a rank whose Python is blocked in C code
holding the GIL cannot answer; it is then reported as silent)."""
STORE_TIMEOUT_SECONDS = 5.0
EXIT_GRACE_SECONDS = 5.0
"""How long a failed rank has for its exit handlers (tracker and log flushes) before it is ended."""
STACK_DUMP_SIGNAL = signal.SIGUSR2
"""Data-loader workers forked after the watchdog started inherit faulthandler's handler for this signal;
a worker that does not catch it (spawned, or the user's own handler) is not signalled."""

_first_step_done = False


def first_step_done() -> None:
    """Called by the optimizer wrapper after a step: from now on the shorter stall timeout applies."""
    global _first_step_done
    _first_step_done = True


class Watchdog:
    """One rank's watchdog thread and its side of the store protocol (see the module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        stall_timeout: float,
        first_step_timeout: float,
        served_store: dist.Store | None = None,
    ):
        self.store = store
        # the store this process serves (rank 0 under srun / mpirun), kept open until the others are done
        self.served_store = served_store
        self.rank = rank
        self.world_size = world_size
        self.stall_timeout = stall_timeout
        self.first_step_timeout = first_step_timeout
        self._last: Position | None = None
        self._since = time.monotonic()
        self._checked = False  # this blocked position was already compared with the others
        self._answered = 0
        self._stop = threading.Event()  # set when this rank failed (it ends by its own exit path) or exits
        self.failed = False  # an uncaught exception ends this rank: exit code 1 once the atexit handlers ran
        self.ending = False  # a report is being made or obeyed: this thread ends the process
        self._ending = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="unison-watchdog", daemon=True)

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        prefix: str,
        rank: int,
        world_size: int,
        timeout: float,
        first_timeout: float,
        served_store: dist.Store | None = None,
    ) -> Watchdog:
        """A watchdog with its own connection to the rendezvous store (short timeouts: it must never
        wait on the store as long as a collective may)."""
        client = dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_SECONDS),
            wait_for_workers=False,
        )
        store = dist.PrefixStore(prefix + "watch/", client)
        return cls(store, rank, world_size, timeout, first_timeout, served_store)

    def start(self) -> None:
        if _catches_default(STACK_DUMP_SIGNAL):
            faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
        # Registered before the user's handlers, so it runs after theirs (atexit is last in, first out):
        # the peers of a rank that failed wait for this before they end (see _obey).
        atexit.register(self._at_exit)
        self._thread.start()

    def _at_exit(self) -> None:
        """Say this rank has exited, and stop the thread before the interpreter tears down: a daemon thread
        killed inside a store request while the process (maybe the store's host) ends can abort it."""
        with contextlib.suppress(Exception):
            role = "serves-store" if self.served_store is not None else "client"
            self.store.set(f"exited/{self.rank}", f"{socket.gethostname()} {os.getpid()} {role}")
        self._stop.set()
        self._thread.join(timeout=ANSWER_WAIT_SECONDS + STORE_TIMEOUT_SECONDS)
        if self.served_store is not None:
            self._await_the_others_exit()
        if self.failed:  # every handler registered after the process group's has run (tracker flushes...):
            # skip the interpreter's teardown, where torch's C++ objects freed late (a DDP model's gloo
            # group) can abort ("terminate called without an active exception")
            logging.shutdown()
            end_process(1)

    def _await_the_others_exit(self) -> None:
        """Keep serving the store until every other rank is done with it (at most EXIT_GRACE_SECONDS).

        Under srun or mpirun the store lives in rank 0's process, not in an agent. Ending first (freed
        with the process group at exit, or with the process after a failure), it closed the connections
        of ranks still finishing, and each printed torch's "recvValue failed ... Connection was likely
        closed" with a C++ stack trace: after every successful run in 4 of 6 with Open MPI 4.1.4's
        mpirun, and whenever rank 0 failed. A rank is done once it wrote its exit note, or, ended by a
        failure it obeyed, once it counted itself in "done". `served_store` holds the store open until
        then; its peers do not wait for this process to end (see await_exit_of)."""
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        deadline = time.monotonic() + EXIT_GRACE_SECONDS
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline:
                exited = sum(self.store.check([f"exited/{rank}"]) for rank in others)
                if exited + self.store.add("done", 0) >= len(others):
                    return
                time.sleep(0.02)

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_SECONDS):
            try:
                self._tick()
            except Exception as error:  # the store is gone (its host ended): the group's errors take over
                logger.debug("unison watchdog of rank %d stops: %s", self.rank, error)
                return

    def _tick(self) -> None:
        now = time.monotonic()
        current = where.main_thread_position()
        if current is None:
            return
        if self._last is None or current.frames != self._last.frames or current.seq != self._last.seq:
            self._last, self._since, self._checked = current, now, False
        asked = self.store.add("ask", 0)
        if asked > self._answered:
            self._answer(asked, current, now - self._since)
            if self.store.check(["verdict"]):
                verdict = json.loads(self.store.get("verdict"))
                if verdict["reporter"] != self.rank:
                    self._obey(verdict)
        if not current.waiting:
            return
        blocked = now - self._since
        timeout = self.stall_timeout if _first_step_done else self.first_step_timeout
        if blocked >= timeout:
            self.report("stall", current, blocked)
        elif blocked >= DIVERGENCE_CHECK_SECONDS and not self._checked and current.kind == "collective":
            self._checked = True
            positions = self._collect(current, blocked)
            if diverged(positions):
                self.report("divergence", current, blocked, positions)

    # -- positions -------------------------------------------------------------------------------
    def _answer(self, asked: int, current: Position, blocked: float) -> None:
        answer = {"ask": asked, "blocked": round(blocked, 1), "position": current.to_json()}
        self.store.set(f"pos/{self.rank}", json.dumps(answer))
        self._answered = asked

    def _collect(self, current: Position, blocked: float) -> dict[int, tuple[Position, float] | None]:
        """Every rank's position, answered after now (None for ranks that did not answer in time)."""
        asked = self.store.add("ask", 1)
        self._answer(asked, current, blocked)
        found: dict[int, tuple[Position, float] | None] = {}
        deadline = time.monotonic() + ANSWER_WAIT_SECONDS
        while True:
            for rank in range(self.world_size):
                if rank in found or not self.store.check([f"pos/{rank}"]):
                    continue
                answer = json.loads(self.store.get(f"pos/{rank}"))
                if answer["ask"] >= asked:
                    found[rank] = (Position.from_json(answer["position"]), answer["blocked"])
            if len(found) == self.world_size or time.monotonic() > deadline:
                return {rank: found.get(rank) for rank in range(self.world_size)}
            if self.store.check(["verdict"]):  # another rank reported while we asked
                verdict = json.loads(self.store.get("verdict"))
                if verdict["reporter"] != self.rank:
                    self._obey(verdict)
            time.sleep(0.1)

    # -- ending ----------------------------------------------------------------------------------
    def report(
        self,
        kind: str,
        current: Position,
        blocked: float,
        positions: dict[int, tuple[Position, float] | None] | None = None,
    ) -> None:
        """Diagnose (kind "stall" or "divergence"), print it once, have every rank dump its stacks, end."""
        with self._ending:
            self.ending = True
            if positions is None:
                positions = self._collect(current, blocked)
            positions[self.rank] = (current, blocked)
            message = diagnosis(kind, self.rank, blocked, positions)
            verdict = json.dumps({"kind": kind, "reporter": self.rank, "message": message})
            if self.store.compare_set("verdict", "", verdict).decode() != verdict:
                self._obey(json.loads(self.store.get("verdict")))  # another rank reported first
            sys.stderr.write(f"[unison] {message}\n")
            record_for_the_elastic_agent(str(self.rank), message.splitlines()[0], message)
            self.store.add("ask", 1)  # wake every rank: they read the verdict and dump their stacks
            _dump_stacks(f"rank {self.rank}")
            deadline = time.monotonic() + ANSWER_WAIT_SECONDS + 2 * CHECK_INTERVAL_SECONDS
            while self.store.add("done", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            end_process(1)

    def _obey(self, verdict: dict[str, Any]) -> None:
        """Another rank reported: dump this rank's stacks (not after a plain failure) and end."""
        self.ending = True
        reporter = verdict["reporter"]
        if verdict["kind"] == "failure":
            self.await_exit_of(reporter)
        else:
            _dump_stacks(f"rank {self.rank} (at the {verdict['kind']} reported by rank {reporter})")
        with contextlib.suppress(Exception):
            self.store.add("done", 1)
        record_for_the_elastic_agent(
            str(self.rank),
            f"ended by the {verdict['kind']} of rank {reporter}",
            verdict.get("message", ""),
            True,
        )
        end_process(1)

    def await_exit_of(self, rank: int | None = None) -> None:
        """Wait (at most EXIT_GRACE_SECONDS) until the rank that failed (default: the one the verdict
        names) has ended after its exit handlers: torch's agent SIGTERMs the others as soon as one ends."""
        with contextlib.suppress(Exception):
            if rank is None:
                if not self.store.check(["verdict"]):
                    return
                rank = json.loads(self.store.get("verdict"))["reporter"]
            if rank == self.rank:
                return
            deadline = time.monotonic() + EXIT_GRACE_SECONDS
            while not self.store.check([f"exited/{rank}"]):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            host, pid, serves_store = self.store.get(f"exited/{rank}").decode().split()
            if serves_store == "serves-store":  # it waits for this rank instead (_await_the_others_exit)
                return
            while time.monotonic() < deadline and (host != socket.gethostname() or is_running(int(pid))):
                time.sleep(0.05)

    def share_raised(self, here: Position) -> None:
        """Publish where this rank raised an error that every rank raises (a collective mismatch)."""
        self.store.set(f"raised/{self.rank}", json.dumps(here.to_json()))

    def raised_calls(self) -> str:
        """Each rank's call where it raised the shared error, one line per rank (waits for the others'
        at most ANSWER_WAIT_SECONDS); an empty string if the store cannot be read."""
        deadline = time.monotonic() + ANSWER_WAIT_SECONDS
        keys = [f"raised/{rank}" for rank in range(self.world_size)]
        with contextlib.suppress(Exception):
            while not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.05)
            lines = ["Each rank's call:"]
            for rank, key in enumerate(keys):
                found = self.store.check([key]) and Position.from_json(json.loads(self.store.get(key)))
                lines.append(f"  rank {rank}: {found.describe() if found else 'did not raise it'}")
            return "\n".join(lines) + "\n"
        return ""

    def announce_failure(self, message: str) -> bool:
        """A rank raised: the first to announce returns True (its traceback is the one to print), and its
        peers' watchdogs end them at their next check."""
        self._stop.set()
        first = self.store.add("failed", 1) == 1
        if first:
            verdict = json.dumps({"kind": "failure", "reporter": self.rank, "message": message})
            self.store.compare_set("verdict", "", verdict)
            self.store.add("ask", 1)
        return first


def diverged(positions: dict[int, tuple[Position, float] | None]) -> list[tuple[int, int]]:
    """Pairs of ranks of one group that are blocked in collectives that cannot be the same call."""
    pairs = []
    known = [(rank, found) for rank, found in positions.items() if found and found[0].kind == "collective"]
    for i, (rank_a, (a, blocked_a)) in enumerate(known):
        for rank_b, (b, blocked_b) in known[i + 1 :]:
            if a.group_ranks != b.group_ranks or {a.op, b.op} & _NOT_COMPARED:
                continue
            if a.seq == b.seq and not a.same_call(b):
                pairs.append((rank_a, rank_b))
            elif a.seq != b.seq and min(blocked_a, blocked_b) >= DIVERGENCE_CHECK_SECONDS:
                pairs.append((rank_a, rank_b))
    return pairs


_NOT_COMPARED = {"send", "recv", "isend", "irecv", "batch_isend_irecv", where.DDP_ALL_REDUCE}
"""Collectives whose sequence numbers say nothing of a divergence: point-to-point (each pair counts its
own), and DDP's all-reduce (a rank still computing gradients has issued fewer buckets than one that
waits for the last); a stall in them is reported at the timeout instead."""


def diagnosis(
    kind: str, reporter: int, blocked: float, positions: dict[int, tuple[Position, float] | None]
) -> str:
    """The report: what went wrong, then one line per rank (ranks in the same place share a line)."""
    silent = [rank for rank, found in positions.items() if found is None]
    if kind == "divergence":
        head = (
            f"ranks called different collectives (reported by rank {reporter}, after {blocked:.0f} s): "
            "every rank must issue the same collectives in the same order with the same shapes. Look for "
            "a collective that some ranks skip (an exception caught, a condition on the rank, a loop of "
            "another length)."
        )
    else:
        waiting = sorted(rank for rank, found in positions.items() if found and found[0].waiting)
        elsewhere = sorted(rank for rank, found in positions.items() if found and not found[0].waiting)
        head = (
            f"hang: rank {reporter} waited {blocked:.0f} s in a collective (the stall timeout); ranks "
            f"{waiting} wait in collectives"
            + (f", ranks {elsewhere} never arrived" if elsewhere else "")
            + (f", ranks {silent} did not answer" if silent else "")
            + ". If a step is legitimately this slow, raise the timeout (Accelerator(timeout=), "
            "--timeout, UNISON_TIMEOUT)."
        )
    lines = [head]
    groups: dict[str, list[int]] = {}
    for rank, found in sorted(positions.items()):
        text = (
            "did not answer (its Python may be blocked in C code holding the GIL)"
            if found is None
            else f"{found[0].describe()} (for {found[1]:.0f} s)"
            if found[0].waiting
            else f"is not in a collective: {found[0].describe()}"
        )
        groups.setdefault(text, []).append(rank)
    for text, ranks in groups.items():
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}")
    lines.append("  Python stacks of every rank follow (faulthandler), each prefixed with its rank.")
    return "\n".join(lines)


def _dump_stacks(who: str) -> None:
    """This process's threads' Python stacks, then those of its child processes that catch the signal
    (data-loader workers forked with faulthandler's handler)."""
    sys.stdout.flush()
    sys.stderr.write(f"[unison] Python stacks of {who}:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    children = [pid for pid in child_processes(os.getpid()) if _catches(pid, STACK_DUMP_SIGNAL)]
    for pid in children:
        with contextlib.suppress(OSError):
            os.kill(pid, STACK_DUMP_SIGNAL)
    if children:
        sys.stderr.write(f"[unison] (stacks of its data-loader worker processes {children} follow)\n")
        time.sleep(0.5)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (the SigCgt mask of /proc/PID/status)."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _catches_default(signum: int) -> bool:
    return signal.getsignal(signum) == signal.SIG_DFL
