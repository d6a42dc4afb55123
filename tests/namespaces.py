"""Network namespaces for the tests that run several "machines" on this one (test_multi_node.py,
test_three_nodes.py): iproute2's `ip`, and why namespaces cannot be made here, if they cannot."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def cannot_make_namespaces() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    return None
