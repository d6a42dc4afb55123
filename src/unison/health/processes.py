"""Other processes as Linux's /proc shows them: a process's children, and whether one still runs.

The hang watchdog signals a rank's data-loader workers and waits for a failed peer to end; `unison
launch` stops the workers of a node cut off from the rendezvous. Elsewhere than Linux no children are
known and nothing is found running.
"""

from __future__ import annotations

import contextlib
from pathlib import Path


def child_processes(parent: int) -> list[int]:
    """The pids whose parent is `parent`."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(_fields(stat.read_text())[1]) == parent:
                children.append(int(stat.parent.name))
    return children


def is_running(pid: int) -> bool:
    """Whether process `pid` still runs: not ended, nor a zombie waiting for its parent to reap it."""
    try:
        state = _fields(Path(f"/proc/{pid}/stat").read_text())[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _fields(stat: str) -> list[str]:
    """The fields of /proc/PID/stat after "(command)", which may itself hold spaces: state, ppid, ..."""
    return stat.rsplit(")", 1)[1].split()
