"""A c10d node that loses the rendezvous ends (unison.launching.contact).

The whole path (a node's link taken down among three namespaces) is tests/test_three_nodes.py's; here
each process is a small Python script standing in for `unison launch`: it listens where the rendezvous
would, starts "workers" (a process group of two sleeps, in their own session, as torch starts them),
runs the watch, and then blocks its main thread for good, as torch's agent does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from launching import process_running
from slowness import budget

from unison.launching import contact
from unison.launching.launcher import c10d_conf
from unison.launching.options import LaunchOptions

STAND_IN = textwrap.dedent(
    """
    import os, signal, socket, subprocess, sys, threading, time
    from unison.launching import contact

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    workers = subprocess.Popen(["bash", "-c", "sleep 600 & sleep 600"], start_new_session=True, **quiet)
    print("workers", workers.pid, flush=True)
    conf = "keep_alive_interval=1,keep_alive_max_attempt=1,read_timeout=1"  # 2 s of silence allowed
    with contact.watching("127.0.0.1", port, conf):
        time.sleep(1.5)  # reached at least once
        listener.close()
        if sys.argv[1] == "back":  # the endpoint answers again within the allowed silence
            time.sleep(0.8)
            listener = socket.create_server(("127.0.0.1", port))
            time.sleep(4)
            print("still running", flush=True)
            os.killpg(workers.pid, signal.SIGKILL)
        else:
            blocked = threading.Lock()
            blocked.acquire()
            blocked.acquire()  # as torch's agent is: only the watch can end the process
    """
)


def _stand_in(mode: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", STAND_IN, mode], capture_output=True, text=True, timeout=budget(60)
    )
    return result, time.monotonic() - started


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finding the workers needs Linux's /proc")
def test_a_node_that_lost_the_rendezvous_stops_its_workers_and_ends():
    result, took = _stand_in("lost")
    assert result.returncode == contact.LOST_EXIT_CODE, result
    assert "this node has not reached the rendezvous at 127.0.0.1:" in result.stderr, result.stderr
    assert "for 2 s (" in result.stderr and "whose heartbeat stops for 1 s" in result.stderr, result.stderr
    assert took < 15, took  # 1.5 s before the loss, 2 s of silence, a probe second; the sleeps end on SIGTERM
    group = int(result.stdout.split()[1])
    listed = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()
    running = [
        pid for pid in map(int, listed) if process_running(pid)
    ]  # the rest: zombies init has yet to reap
    assert not running, f"workers left running: {running}"


def test_an_endpoint_back_within_the_allowed_silence_ends_nothing():
    result, _ = _stand_in("back")
    assert result.returncode == 0, result
    assert "still running" in result.stdout and "rendezvous" not in result.stderr, result


def test_an_endpoint_never_reached_is_left_to_the_join_timeout():
    lost = []
    watch = contact.ContactWatch("127.0.0.1", 1, 0.5, lambda *args: lost.append(args), probe_interval=0.1)
    watch.start()
    time.sleep(1.5)
    watch.stop()
    watch.join(timeout=5)
    assert lost == [] and not watch.is_alive()


def test_the_allowed_silence_follows_the_rendezvous_settings():
    assert contact.allowed_silence("") == 5 * 3 + 60  # torch's defaults
    assert contact.allowed_silence("keep_alive_interval=1, keep_alive_max_attempt=3,read_timeout=5") == 8
    assert contact.heartbeat_lapse("keep_alive_interval=1, keep_alive_max_attempt=3,read_timeout=5") == 3
    options = LaunchOptions(
        "train.py", nnodes="2:3", rdzv_endpoint="10.9.9.9:29400", rdzv_conf="keep_alive_interval=2", timeout=5
    )
    conf = c10d_conf(options)  # what the launch gives torch: --timeout bounds the read timeout
    assert contact.allowed_silence(conf) == 2 * 3 + 5, conf
    assert not contact.hosts_the_rendezvous(conf)
    assert contact.hosts_the_rendezvous("is_host=1") and contact.hosts_the_rendezvous("is_host=true")
