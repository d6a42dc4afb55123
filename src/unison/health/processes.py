"""Other processes as Linux's /proc shows them (a process's children, whether one still runs), and
how a rank that must end now leaves without them outliving it.

The hang watchdog signals a rank's data-loader workers and waits for a failed peer to end; `unison
launch` stops the workers of a node cut off from the rendezvous. Elsewhere than Linux no children are
known and nothing is found running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn


def end_process(code: int) -> NoReturn:
    """Flush the output, kill this process's children, and leave with `code` at once (os._exit).

    os._exit runs no clean-up, so a DataLoader never shuts its workers down: one stuck in the user's
    __getitem__ (the very hang being reported) lived on after the rank, reparented to init (seen after
    tests/test_hangs.py's stuck-loader case). The rank is ending on an error; nothing it started is
    still of use.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    for pid in child_processes(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(code)


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
