"""unison.network: the interface gloo and NCCL bind, found from the rendezvous address (loopback only here;
tests/test_multi_node.py checks it between two network namespaces, and the errors where no route exists)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from unison import network
from unison.launching import launcher
from unison.launching.launcher import LaunchError

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the interface lookup is Linux's"
)


@linux_only
def test_the_interface_holding_an_address():
    assert network.interface_holding("127.0.0.1") == "lo"
    assert network.interface_holding("127.0.0.2") is None  # routed through lo, but not lo's address
    if "00000000000000000000000000000001" in Path("/proc/net/if_inet6").read_text():
        assert network.interface_holding("::1") == "lo"


def test_the_source_address_towards_loopback_is_loopback():
    assert network.source_address("127.0.0.1", "--master-addr") == "127.0.0.1"
    assert network.address_towards("localhost", "--master-addr") in ("127.0.0.1", "::1")  # from /etc/hosts


@linux_only
def test_choice_follows_local_addr_then_the_route_to_the_rendezvous_host():
    choice = network.choose_interface("127.0.0.1")
    assert choice == network.InterfaceChoice(
        "lo", "127.0.0.1", "the rendezvous address 127.0.0.1 is this node's"
    )
    choice = network.choose_interface("127.0.0.1", local_addr="127.0.0.1")
    assert (choice.name, choice.reason) == ("lo", "--local-addr 127.0.0.1")
    # a --local-addr no interface holds (a NAT's public address, say) leaves the choice to the route
    choice = network.choose_interface("127.0.0.1", local_addr="127.0.0.2")
    assert (choice.name, choice.address) == ("lo", "127.0.0.1")


def test_variables_the_user_exported_win():
    choice = network.InterfaceChoice("eth7", "10.0.0.7", "test")
    both = {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "eth7"}
    assert network.socket_interface_environment(choice, {}) == both
    assert network.socket_interface_environment(choice, {"NCCL_SOCKET_IFNAME": "ib0"}) == {
        "GLOO_SOCKET_IFNAME": "eth7"
    }
    assert network.socket_interface_environment(network.InterfaceChoice(None, "10.0.0.7", "test"), {}) == {}


@linux_only
def test_one_node_gets_loopback_said_at_debug_level(monkeypatch, caplog):
    """One node: gloo and NCCL bind `lo`, so the workers' sockets are not reachable from the network."""
    for name in network.SOCKET_INTERFACE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.DEBUG, logger="unison"):
        env = launcher.worker_environment(2, cpu=True, rendezvous_host="127.0.0.1")
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("lo", "lo")
    (record,) = [r for r in caplog.records if "network interface" in r.getMessage()]
    assert record.levelno == logging.DEBUG
    assert record.getMessage().startswith(
        "unison launch: the workers' gloo/NCCL sockets use network interface lo, which holds 127.0.0.1 (the "
        "rendezvous address 127.0.0.1 is this node's): GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo."
    )
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib9")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="unison"):
        env = launcher.worker_environment(2, cpu=True, rendezvous_host="127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env
    assert "GLOO_SOCKET_IFNAME=eth9, NCCL_SOCKET_IFNAME=ib9" in caplog.text
    assert "GLOO_SOCKET_IFNAME" not in launcher.worker_environment(2, cpu=True)  # no rendezvous: nothing


def test_a_bad_endpoint_is_a_launch_error_naming_it():
    with pytest.raises(LaunchError, match=r"--rdzv-endpoint 'node0:http': .* Pass HOST:PORT"):
        launcher.rendezvous_endpoint(launcher.LaunchOptions("x.py", nnodes="2", rdzv_endpoint="node0:http"))
