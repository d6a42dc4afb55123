"""Run a worker script under `python -m unison launch` for multi-process tests.

Import from tests as `from launching import launch, launch_ok` (pytest puts tests/ on sys.path
because tests/ has no __init__.py).

Every `timeout=` here is in seconds of the idle machine the suite was measured on: it is multiplied by
the session's slowness factor (tests/slowness.py), and it is the launch's own budget: the running test's
pytest-timeout deadline moves later by as much, so a module fixture's launches are not charged to the
test that triggered it. A launch that outlives its budget is ended with everything it started (its
ranks in their own sessions, their data-loader workers), after each rank printed its Python stacks, and
raises LaunchTimedOut: a subprocess.TimeoutExpired whose message holds the command and its output.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import slowness

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
TAG_VARIABLE = "SUITE_LAUNCH_TAG"
"""Set in each run's environment to a value of its own: every process the run starts inherits it (also a
rank torch's agent starts in a session of its own, and one reparented to init), so a timed-out run's
processes are found by it."""
STACK_DUMP_SIGNAL = signal.SIGUSR2  # a rank's watchdog registers faulthandler for it (unison.health)
OUTPUT_SHOWN = 30_000
"""Characters of each stream a timed-out run's message shows (the end: where a hang report is)."""
_runs = itertools.count()
RUN_LOG_VARIABLE = "UNISON_TEST_RUN_LOG"
"""Where the suite's cost goes: set to a file, each run appends a JSON line (the test, the command, its
seconds of wall and of CPU: every process of the run, ranks included, as the kernel counts them for reaped
children). CPU seconds are what the 2 cores share out; wall seconds swell on a busy machine."""


class LaunchTimedOut(subprocess.TimeoutExpired):
    """A run outlived its budget; its processes are ended. `str()` gives the command, the budget and the
    output (each stream's end), every rank's Python stacks among it."""

    def __init__(self, cmd, timeout: float, nominal: float, stdout: str, stderr: str, ended, dumped):
        super().__init__(cmd, timeout, output=stdout, stderr=stderr)
        self.nominal = nominal
        self.ended = ended  # the pids of every process of the run
        self.dumped = dumped  # those asked for their Python stacks first (the ranks)

    def __str__(self) -> str:
        factor, source = slowness.current()
        stacks = f", after asking {self.dumped} for their Python stacks (in stderr)" if self.dumped else ""
        return (
            f"command: {' '.join(map(str, self.cmd))}\n"
            f"timed out after {self.timeout:.0f} s (its budget: {self.nominal:g} s on an idle machine x "
            f"slowness {factor}, {source}); ended it and the processes it started {self.ended}{stacks}.\n"
            f"--- stdout ---\n{_tail(self.stdout)}\n--- stderr ---\n{_tail(self.stderr)}"
        )


def _tail(text: str | None) -> str:
    text = text or ""
    if len(text) <= OUTPUT_SHOWN:
        return text
    return f"[... the first {len(text) - OUTPUT_SHOWN} characters left out ...]\n{text[-OUTPUT_SHOWN:]}"


def run(
    command: Sequence[str | os.PathLike],
    *,
    timeout: float,
    cwd: str | os.PathLike = REPO_ROOT,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) within `timeout` seconds of the idle
    machine (times the slowness factor), added to the running test's pytest-timeout deadline.

    On timeout (or any exception, pytest-timeout's included) the run and every process it started end:
    SIGUSR2 first to those that catch it (a rank's watchdog dumps its Python stacks on it), then SIGTERM
    to the run (unison launch stops its ranks), SIGKILL to whatever is left. Raises LaunchTimedOut.
    """
    budget = slowness.budget(timeout)
    tag = f"{os.getpid()}-{next(_runs)}-{time.time_ns()}"
    full_env = {**(os.environ if env is None else env), TAG_VARIABLE: tag}
    slowness.extend_test_timer(budget)
    command = [str(part) for part in command]
    started, cpu_before = time.monotonic(), _children_cpu_seconds()
    process = subprocess.Popen(
        command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = process.communicate(timeout=budget)
        _log_run(command, time.monotonic() - started, _children_cpu_seconds() - cpu_before)
    except subprocess.TimeoutExpired:
        ended, dumped = end_run(process, tag)
        stdout, stderr = _rest_of_output(process)
        raise LaunchTimedOut(command, budget, timeout, stdout, stderr, ended, dumped) from None
    except BaseException:
        end_run(process, tag)
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _log_run(command: list[str], wall: float, cpu: float) -> None:
    log = os.environ.get(RUN_LOG_VARIABLE)
    if not log:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    line = {"test": test, "command": command, "wall": round(wall, 2), "cpu": round(cpu, 2)}
    with open(log, "a") as file:
        file.write(json.dumps(line) + "\n")


def _rest_of_output(process: subprocess.Popen) -> tuple[str, str]:
    """What the ended run printed (communicate keeps what it read before the timeout)."""
    try:
        return process.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a process not found by its tag still holds the pipes
        for stream in (process.stdout, process.stderr):
            with contextlib.suppress(OSError):
                stream.close()
        return "(output not readable: a process outside the run holds its pipes)", ""


def tagged_processes(tag: str) -> list[int]:
    """The pids of live processes whose environment holds TAG_VARIABLE=tag (this user's, from /proc)."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not process_running(int(entry.name)):
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def end_run(process: subprocess.Popen, tag: str) -> tuple[list[int], list[int]]:
    """End `process` and every process it started (found by `tag`): their pids, and those that dumped
    their stacks first."""
    started = sorted(set(tagged_processes(tag)) - {process.pid})
    catching = [pid for pid in started if _catches(pid, STACK_DUMP_SIGNAL)]
    for pid in catching:
        with contextlib.suppress(OSError):
            os.kill(pid, STACK_DUMP_SIGNAL)
    if catching:
        time.sleep(2)  # the stacks reach the launcher's pipes
    with contextlib.suppress(OSError):
        process.terminate()  # unison launch stops its ranks (SIGTERM to each, SIGKILL after a grace)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=15)
    ended = {process.pid, *started}
    for _ in range(100):
        if process.poll() is None:
            process.kill()
        left = tagged_processes(tag)  # a pid no longer tagged is not ours any more
        ended.update(left)
        if not left and process.poll() is not None:
            break
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    return sorted(ended), catching


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (the SigCgt mask of /proc/PID/status)."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


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
    stderr are captured as text. `timeout`: seconds on an idle machine (see `run`); raises
    LaunchTimedOut (a subprocess.TimeoutExpired) past it, the processes ended, the output shown.
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
    return run(command, env=full_env, timeout=timeout)


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
