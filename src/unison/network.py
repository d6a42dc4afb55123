"""Which network interface the workers' gloo and NCCL sockets use, chosen from the rendezvous address.

gloo binds the address this machine's host name resolves to, and NCCL the first interface that is not
loopback or docker. Both guesses go wrong where the host name resolves to 127.0.0.1 or 127.0.1.1
(Debian's and Ubuntu's default /etc/hosts, containers, network namespaces): the other nodes are then
told to connect to their own loopback, and the run fails with `Gloo connectFullMesh failed ...
remote=[127.0.0.1]`. The interface that matters is the one this node reaches the rendezvous through:
the other nodes reach this one over the same network. The kernel already knows it: a UDP socket
"connected" to the rendezvous address (no packet is sent) is given the source address the route
uses, and the interface holding that address is the answer.

The interface is found by address, not by route device, because the route to an address of this
node itself goes through `lo` while the other nodes reach that address on a real interface.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables gloo and NCCL read for the interface to bind; a value the user exported wins."""

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface (linux/sockios.h)
_IF_INET6 = Path("/proc/net/if_inet6")  # Linux: every IPv6 address with its interface


class NetworkError(ValueError):
    """An address this node must reach cannot be resolved or routed to."""


@dataclass(frozen=True)
class InterfaceChoice:
    """The interface the workers' sockets bind, and why it was chosen."""

    name: str | None  # None: no interface of this node holds `address` (see `interface_holding`)
    address: str  # this node's address towards the rendezvous
    reason: str  # where `address` comes from, for the log line


def resolve(host: str, flag: str) -> str:
    """`host` (a name or an address) as one IP address; NetworkError naming `flag` if it has none."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise NetworkError(
            f"{flag} {host!r} does not resolve on this node ({error.strerror}): pass the IP address of "
            "that node, or add its name to DNS or /etc/hosts here."
        ) from None
    return str(infos[0][4][0])


def source_address(address: str, flag: str) -> str:
    """This node's address on the route to `address`: the source the kernel picks to reach it.

    Connecting a UDP socket sends nothing; it only asks the kernel for the route.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))  # any port: UDP connect() looks the route up and stops there
        except OSError as error:
            raise NetworkError(
                f"{flag} {address}: this node has no route to that address ({error.strerror}). Check the "
                "address, and that this node is on a network that reaches it."
            ) from None
        return str(probe.getsockname()[0])


def address_towards(host: str, flag: str) -> str:
    """This node's address towards `host` (named by `flag` in errors): what the other nodes reach it by."""
    return source_address(resolve(host, flag), flag)


def interface_holding(address: str) -> str | None:
    """The name of the interface that holds `address` on this node, or None if none does.

    Linux only (an ioctl for IPv4, /proc/net/if_inet6 for IPv6): elsewhere this returns None and gloo
    and NCCL keep their own choice. For IPv4 only each interface's primary address is seen; a
    secondary address (`ip addr add` of a second one) is not found, and the choice falls back to the
    torch defaults with a line saying so.
    """
    if not sys.platform.startswith("linux"):
        return None
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        for line in _IF_INET6.read_text().splitlines() if _IF_INET6.exists() else ():
            fields = line.split()
            if ipaddress.IPv6Address(int(fields[0], 16)) == ip:
                return fields[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(query.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # down or without an IPv4 address
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def choose_interface(rendezvous_host: str, local_addr: str | None = None) -> InterfaceChoice:
    """The interface for the workers' sockets: the one holding --local-addr when given (the address the
    other nodes reach this node by), else the one this node reaches the rendezvous host through.

    Raises NetworkError naming the address when it does not resolve or cannot be routed to.
    """
    if local_addr:
        address = resolve(local_addr, "--local-addr")
        name = interface_holding(address)
        if name is not None:
            return InterfaceChoice(name, address, f"--local-addr {local_addr}")
    target = resolve(rendezvous_host, "the rendezvous host")
    address = source_address(target, "the rendezvous host")
    if address == target:
        reason = f"the rendezvous address {rendezvous_host} is this node's"
    else:
        reason = f"this node's address on the route to the rendezvous host {rendezvous_host}"
    return InterfaceChoice(interface_holding(address), address, reason)


def socket_interface_environment(choice: InterfaceChoice, environ: Mapping[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set to the chosen interface, except those already set."""
    if choice.name is None:
        return {}
    return {name: choice.name for name in SOCKET_INTERFACE_VARIABLES if name not in environ}


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1: traffic that never leaves this machine."""
    return ipaddress.ip_address(address).is_loopback
