"""The rendezvous side of `unison launch`: the one-node store, and rendezvous failures in words.

One node: torch's static rendezvous needs a port chosen in advance, and a port found free and then
released can be taken by another launch (or any outgoing connection) before torch binds it; its
TCPStore also listens on every interface of the machine, whatever address it is given.
`OneNodeRendezvous` binds the address itself (127.0.0.1 unless --master-addr says otherwise), on port
0 unless --master-port names one, and hands the listening socket to the TCPStore (torch's
`master_listen_fd`): the OS picks the port at the moment it is bound, so two launches never meet on
one, and on 127.0.0.1 only this machine can connect. It is registered with torch's rendezvous registry
under ONE_NODE_BACKEND, so torch's elastic agent uses it as it uses the static backend (the agent
hosts the store; the workers connect to it at MASTER_ADDR:MASTER_PORT).

Several nodes: a node that never arrives, or a rendezvous nobody hosts, ends in torch's store or
rendezvous exceptions, deep in a traceback. `failure_message` says what happened, where, and what to do.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

ONE_NODE_BACKEND = "unison-one-node"
LOOPBACK_ADDRESS = "127.0.0.1"
"""Where the processes of a one-node launch meet unless --master-addr says otherwise."""
AGENT_STORE_TIMEOUT = timedelta(seconds=600)
"""How long the agent's store operations may wait: torch's static rendezvous default."""

FAILURES = (RendezvousError, dist.DistError)
"""What torch's elastic agent raises when the nodes cannot meet (never a worker's failure)."""


class OneNodeRendezvous(RendezvousHandler):
    """The rendezvous of a one-node launch: a TCPStore listening at exactly HOST:PORT (port 0: the OS's pick).

    The store is created once and kept for every restart attempt, like the static rendezvous's, so
    the workers' keys are namespaced by attempt in `state.py` the same way.
    """

    def __init__(self, host: str, port: int, run_id: str):
        self._host = host
        self._port = port
        self._run_id = run_id
        self._store: dist.TCPStore | None = None

    def get_backend(self) -> str:
        return ONE_NODE_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to this store at MASTER_ADDR:MASTER_PORT

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = self._listen()
        return RendezvousInfo(
            dist.PrefixStore(self._run_id, self._store),
            0,
            1,
            RendezvousStoreInfo(self._host, self._store.port),
        )

    def _listen(self) -> dist.TCPStore:
        """Bind and listen here, then give the socket to the store (which owns it from then on)."""
        try:
            family, _, _, _, address = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)[0]
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                if self._port:  # a port given by number may still be in TIME_WAIT from a run just ended
                    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(address)
                listener.listen()
            except OSError:
                listener.close()
                raise
        except OSError as error:
            raise RendezvousConnectionError(f"cannot listen at {self._host}:{self._port}: {error}.") from None
        return dist.TCPStore(
            self._host,
            listener.getsockname()[1],
            None,
            True,
            AGENT_STORE_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass  # one node: nobody else to tell

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def _create_one_node_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, 0)
    return OneNodeRendezvous(host, port, params.run_id)


rendezvous_handler_registry.register(ONE_NODE_BACKEND, _create_one_node_rendezvous)


def failure_message(error: BaseException, endpoint: str, node: str, wait: str) -> str:
    """What to tell the user when the nodes could not meet at `endpoint` (HOST:PORT).

    `node` names this node ("node 1", "this node"); `wait` says how long the nodes wait for each other
    ("--timeout 5 s"). torch's own words stay in the message (the cause of a connection error too).
    """
    causes = [error, *([error.__cause__] if error.__cause__ is not None else [])]
    said = " ".join(f"{type(cause).__name__}: {_words(cause)}" for cause in causes)
    if "EADDRINUSE" in said or "address already in use" in said.lower():
        advice = (
            "another process already listens on that port: choose a free port for the rendezvous "
            "(--master-port, or the port of --rdzv-endpoint) on every node."
        )
    else:
        advice = (
            "start `unison launch` on every node (the same --nnodes and rendezvous flags, each static "
            f"node with its own --node-rank) within {wait} of each other, and check that every node "
            f"reaches {endpoint} (the address, the port, a firewall between the nodes); then run again."
        )
    return f"unison launch: {node} could not join the rendezvous at {endpoint}: {said} To fix: {advice}"


def _words(error: BaseException) -> str:
    """An exception's message as one sentence (torch's RendezvousTimeoutError carries none)."""
    text = str(error).strip().split("\n")[0]  # without a C++ stack, when torch adds one
    if not text and isinstance(error, RendezvousTimeoutError):
        return "not every node joined within the join timeout."
    return text if text.endswith(".") else f"{text}."
