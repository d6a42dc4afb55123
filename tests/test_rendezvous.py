"""launching.rendezvous: the one-node store binds its own port on loopback (no free-port race, no exposure),
and a rendezvous that cannot form ends `unison launch` with one line naming the endpoint and the fix."""

from __future__ import annotations

import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from launching import REPO_ROOT
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from unison.commands.main import main
from unison.launching import launcher, rendezvous
from unison.launching.launcher import LaunchOptions


def _handler(endpoint: str):
    """The handler torch's elastic agent gets for `unison launch` on one node (same registry, same call)."""
    parameters = RendezvousParameters(
        backend=rendezvous.ONE_NODE_BACKEND, endpoint=endpoint, run_id="test", min_nodes=1, max_nodes=1
    )
    return rendezvous_handler_registry.create_handler(parameters)


def _listening_ports() -> dict[int, list[str]]:
    """Port -> the addresses that listen on it, IPv4 and IPv6 (Linux's /proc/net/tcp{,6}, LISTEN rows)."""
    found: dict[int, list[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":
                address, port = local.split(":")
                found.setdefault(int(port, 16), []).append(address)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/net/tcp")
def test_launches_starting_together_each_bind_their_own_loopback_port():
    """Eight rendezvous formed at the same moment: eight ports, chosen by the OS as each binds (the old
    way found a free port, released it, and let torch bind it later: two launches could pick the same
    one), each listening on 127.0.0.1 alone, and each a working store for the workers."""
    handlers = [_handler("127.0.0.1:0") for _ in range(8)]
    with ThreadPoolExecutor(len(handlers)) as pool:
        infos = list(pool.map(lambda handler: handler.next_rendezvous(), handlers))
    ports = [info.bootstrap_store_info.master_port for info in infos]
    assert len(set(ports)) == 8 and all(port > 0 for port in ports), ports
    listening = _listening_ports()
    for info in infos:
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        port = info.bootstrap_store_info.master_port
        assert listening[port] == ["0100007F"]  # 127.0.0.1 (/proc's byte order), and no [::] twin
        worker = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10))  # as state.py connects
        info.store.set("key", "value")  # the agent's keys, under the run id
        assert dist.PrefixStore("test", worker).get("key") == b"value"
    again = handlers[0].next_rendezvous()  # a restart attempt keeps the store (state.py namespaces it)
    assert again.bootstrap_store_info.master_port == ports[0]


def test_a_port_in_use_is_named_with_the_fix(caplog, monkeypatch):
    """--master-port of a port another process listens on: the launch ends at once, exit code 1, one
    line naming the address and what to change (torch's agent runs in-process; no worker starts)."""
    # torch's launch_agent exports this in the launching process; monkeypatch removes it afterwards
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RendezvousConnectionError, match=f"cannot listen at 127.0.0.1:{port}: .*in use"):
            _handler(f"127.0.0.1:{port}").next_rendezvous()
        code = main(
            ["launch", "--cpu", "--master-port", str(port), str(REPO_ROOT / "tests/workers/launch_worker.py")]
        )
    assert code == 1
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("unison launch: ")]
    assert line.startswith(f"unison launch: this node could not join the rendezvous at 127.0.0.1:{port}: "), (
        line
    )
    assert line.endswith(
        "To fix: another process already listens on that port: choose a free port for the rendezvous "
        "(--master-port, or the port of --rdzv-endpoint) on every node."
    ), line


ENDPOINT = "10.0.0.1:29400"


@pytest.mark.parametrize(
    "options, wait",
    [
        (
            LaunchOptions("x.py", nnodes="2", master_addr="10.0.0.1", node_rank=0, timeout=4.5),
            "--timeout 5 s",
        ),
        (LaunchOptions("x.py", nnodes="2", rdzv_endpoint=ENDPOINT, timeout=4), "--timeout 4 s"),
        (LaunchOptions("x.py", nnodes="1:2", rdzv_endpoint=ENDPOINT, timeout=4), "torch's default of 600 s"),
        (
            LaunchOptions("x.py", nnodes="2", rdzv_endpoint=ENDPOINT, timeout=4, rdzv_conf="join_timeout=90"),
            "--rdzv-conf join_timeout=90 s",
        ),
        (LaunchOptions("x.py", nnodes="2", master_addr="10.0.0.1", node_rank=1), "torch's default of 600 s"),
    ],
)
def test_the_message_names_the_wait_in_force(options, wait):
    """The fix a rendezvous failure suggests names the wait torchrun_argv set up, not --timeout alone."""
    assert launcher._rendezvous_wait(options) == wait
