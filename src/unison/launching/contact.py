"""A node cut off from the rendezvous ends, instead of waiting forever inside torch's elastic agent.

Why it is needed (found by tests/test_three_nodes.py, torch 2.13): when a node's network goes down,
its agent's keep-alive thread is inside a TCPStore call to the rendezvous store. After the store's
read timeout the client sends STOP_WAITING and waits for the answer in a recv() without a timeout,
until the kernel gives the TCP connection up (about 15 minutes with Linux's default tcp_retries2),
holding the rendezvous handler's heartbeat lock all along. The agent's monitor loop needs that lock
for every check (`num_nodes_waiting`), and a restart needs the store: nothing ends the launch, though
its workers have long failed and the other nodes have gone on without it.

`ContactWatch` is a daemon thread of `unison launch` on every c10d node that does not host the
rendezvous. It connects to the rendezvous endpoint every `probe_interval` seconds (a connection
opened and closed, which the store ignores). Once it has reached the endpoint, it counts how long
every attempt has failed; when that passes `allowed_silence` (the heartbeats the other nodes wait
before they drop this node, plus the store's read timeout: they have gone on without it, and torch's
own call would have given up by then) it says so and calls `on_lost`. The launcher's `on_lost` is
`end_this_node`: it stops the workers (SIGTERM to each worker's process group, SIGKILL after a
grace) and ends the process with exit code 1. Leaving the process is the only way out: the agent's
main thread is blocked inside torch, where no exception reaches it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

from torch.distributed.elastic.rendezvous import RendezvousParameters

from ..health.processes import child_processes, is_running

logger = logging.getLogger("unison")

PROBE_INTERVAL_SECONDS = 1.0
WORKER_GRACE_SECONDS = 5.0
"""How long stopped workers get to end on SIGTERM before SIGKILL."""
LOST_EXIT_CODE = 1

# torch's defaults for c10d rendezvous (dynamic_rendezvous.create_handler, c10d_rendezvous_backend)
KEEP_ALIVE_INTERVAL_SECONDS = 5
KEEP_ALIVE_MAX_ATTEMPT = 3
READ_TIMEOUT_SECONDS = 60


def heartbeat_lapse(conf: str) -> float:
    """Seconds without a node's heartbeat after which the other nodes drop it, from a c10d --rdzv-conf
    string: keep_alive_interval x keep_alive_max_attempt."""
    params = _parameters(conf)
    interval = params.get_as_int("keep_alive_interval", KEEP_ALIVE_INTERVAL_SECONDS)
    return float(interval * params.get_as_int("keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT))


def allowed_silence(conf: str) -> float:
    """Seconds without contact after which this node ends: the heartbeat lapse + the store's read_timeout."""
    return heartbeat_lapse(conf) + _parameters(conf).get_as_int("read_timeout", READ_TIMEOUT_SECONDS)


def hosts_the_rendezvous(conf: str) -> bool:
    """Whether a c10d --rdzv-conf string says this node hosts the store (is_host)."""
    return bool(_parameters(conf).get_as_bool("is_host", False))


def _parameters(conf: str) -> RendezvousParameters:
    """torch's own reading of KEY=VALUE,... (its int and bool parsing, its errors)."""
    pairs = dict(item.strip().split("=", 1) for item in conf.split(",") if "=" in item)
    return RendezvousParameters(
        "c10d", "", "", 1, 1, **{key.strip(): value.strip() for key, value in pairs.items()}
    )


class ContactWatch(threading.Thread):
    """Calls `on_lost(seconds, last_error)` once the endpoint has been unreachable for `allowed_silence`
    seconds after it was first reached (before that, torch's own join timeout is in charge)."""

    def __init__(
        self,
        host: str,
        port: int,
        allowed_silence: float,
        on_lost: Callable[[float, OSError], None],
        probe_interval: float = PROBE_INTERVAL_SECONDS,
    ):
        super().__init__(name="unison-rendezvous-contact", daemon=True)
        self.host, self.port = host, port
        self.allowed_silence = allowed_silence
        self.probe_interval = probe_interval
        self._on_lost = on_lost
        self._stopped = threading.Event()

    def run(self) -> None:
        reached = False
        silent_since: float | None = None
        while not self._stopped.wait(self.probe_interval):
            error = self._probe()
            if error is None:
                reached, silent_since = True, None
                continue
            if not reached:
                continue
            now = time.monotonic()
            silent_since = now if silent_since is None else silent_since
            if now - silent_since >= self.allowed_silence and not self._stopped.is_set():
                self._on_lost(now - silent_since, error)
                return

    def _probe(self) -> OSError | None:
        try:
            with socket.create_connection((self.host, self.port), timeout=max(self.probe_interval, 1.0)):
                return None
        except OSError as error:
            return error

    def stop(self) -> None:
        self._stopped.set()


@contextlib.contextmanager
def watching(host: str, port: int, conf: str) -> Iterator[None]:
    """Run a ContactWatch that ends this node (`end_this_node`) for the duration of the launch."""
    silence, lapse = allowed_silence(conf), heartbeat_lapse(conf)

    def on_lost(seconds: float, error: OSError) -> None:
        logger.error(
            "unison launch: this node has not reached the rendezvous at %s:%s for %.0f s (%s). The other "
            "nodes drop a node whose heartbeat stops for %.0f s and go on without it; torch's agent here "
            "is blocked in a store call that waits for the lost connection. Ending this node's launch: "
            "its workers are stopped. Check the network between this node and %s, then launch this node "
            "again to rejoin (an elastic --nnodes range takes it back).",
            host,
            port,
            seconds,
            error,
            lapse,
            host,
        )
        end_this_node()

    watch = ContactWatch(host, port, silence, on_lost)
    watch.start()
    try:
        yield
    finally:
        watch.stop()


def end_this_node() -> None:
    """Stop this process's child processes (the workers), then leave with LOST_EXIT_CODE."""
    children = child_processes(os.getpid())
    _signal_groups(children, signal.SIGTERM)
    deadline = time.monotonic() + WORKER_GRACE_SECONDS
    while any(is_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_groups(children, signal.SIGKILL)
    time.sleep(0.5)  # torch's tailer threads print the workers' last lines
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(LOST_EXIT_CODE)


def _signal_groups(pids: list[int], sig: signal.Signals) -> None:
    """`sig` to each pid's process group (torch starts each worker in its own session, with the
    processes it starts, data loader workers among them), else to the pid alone."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
