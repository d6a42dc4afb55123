"""Run a worker script under `python -m unison launch` for multi-process tests.

Import from tests as `from launching import launch, launch_ok` (pytest puts tests/ on sys.path
because tests/ has no __init__.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def launch(
    script: str | os.PathLike,
    nproc: int,
    *script_args: str | os.PathLike,
    launch_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """`python -m unison launch --nproc-per-node NPROC --cpu [launch_args] script [script_args]`.

    Runs from the repository root with os.environ + `env` (and OMP_NUM_THREADS=1); stdout and
    stderr are captured as text. Raises subprocess.TimeoutExpired after `timeout` seconds.
    """
    command = [
        sys.executable,
        "-m",
        "unison",
        "launch",
        "--nproc-per-node",
        str(nproc),
        "--cpu",
        *launch_args,
        str(script),
        *map(str, script_args),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        command, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def describe(result: subprocess.CompletedProcess) -> str:
    """The command, exit code and both streams, for assertion messages."""
    return (
        f"command: {' '.join(result.args)}\nexit code: {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )


def launch_ok(
    script: str | os.PathLike, nproc: int, *script_args: str | os.PathLike, **kwargs
) -> subprocess.CompletedProcess:
    """Like `launch`, but assert that the launch exited 0 (showing all output if not)."""
    result = launch(script, nproc, *script_args, **kwargs)
    assert result.returncode == 0, describe(result)
    return result


def process_running(pid: int) -> bool:
    """Whether process `pid` is alive and not a zombie (read from /proc, independently of the library's
    own reading: this machine's init may be slow to reap an orphan)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
