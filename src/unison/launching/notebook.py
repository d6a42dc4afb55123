"""`notebook_launcher`: run a training function in N processes from a notebook (or any Python session).

A notebook cannot run `unison launch script.py`, so this starts the processes around a function
instead, through the same torch elastic agent (`elastic_launch` with a function entrypoint). Workers
are forked where the OS allows it, because a function defined in a notebook cell cannot be pickled
for a freshly spawned interpreter. Each worker gets torch's RANK/WORLD_SIZE/MASTER_* variables, so the
`Accelerator()` / `PartialState()` created *inside* the function forms the process group.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..env_vars import validate_mixed_precision
from ..state import AcceleratorState, PartialState
from .launcher import RANK_PREFIX_TEMPLATE, exported, free_loopback_port, join_endpoint, worker_environment
from .options import resolve_nproc_per_node
from .rendezvous import ONE_NODE_BACKEND
from .report import cause_rank

_FORK_SAFE_CUDA_CHECK = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""torch.cuda.is_available() initialises the CUDA driver, after which forked children cannot use CUDA
(measured with torch 2.11 on an H100); with this variable it asks NVML instead, which is fork-safe."""

_FORKED_CUDA_ADVICE = (
    "\nThe notebook touched CUDA before launching (e.g. torch.cuda.is_available()), so the forked "
    "workers cannot use it. Restart the kernel and keep CUDA calls inside the launched function, or "
    "export PYTORCH_NVML_BASED_CUDA_CHECK=1 before the first torch.cuda call."
)


class NotebookLaunchError(ChildFailedError, RuntimeError):
    """A launched function failed on some rank.

    torch's ChildFailedError, as Accelerate's notebook_launcher raises (`failures` holds every rank's
    failure as torch's agent saw it), but its message names the rank that failed first, the cause,
    with its traceback: torch's own message leads with the earliest whole-second timestamp, often a
    rank the agent terminated because of the cause. Also a RuntimeError, as unison raised before.
    """

    def __init__(self, message: str, error: ChildFailedError):
        super().__init__(error.name, error.failures)
        self.args = (message,)


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "unison-notebook",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    cpu: bool = False,
) -> dict[int, Any]:
    """Run `function(*args)` in `num_processes` processes on this node; return {rank: its return value}.

    Several machines: the same call on each, with num_nodes, node_rank, master_addr and use_port set.

    Args:
        num_processes: None means one per GPU, or without GPUs a few CPU processes (see
            `unison launch --nproc-per-node auto`). With 1, the function runs here, in this process.
        mixed_precision: the default for `Accelerator()` inside the function (exported as
            UNISON_MIXED_PRECISION).
        use_port: the rendezvous port on `master_addr`; None picks a free one (single node).
        cpu: run every process on the CPU even if GPUs are present (exported as UNISON_CPU).

    Raises:
        NotebookLaunchError: (a ChildFailedError and a RuntimeError) naming the rank that failed
            first, with its traceback.
    """
    mixed_precision = validate_mixed_precision(mixed_precision)
    if PartialState._shared_state or AcceleratorState._shared_state:
        raise RuntimeError(
            "notebook_launcher found a PartialState/Accelerator already created in this process: the "
            "workers would inherit it instead of forming their group. Create the Accelerator inside "
            "the function you launch, and restart the notebook kernel to clear the existing one."
        )
    if rdzv_backend not in ("static", "c10d"):
        raise ValueError(
            f"rdzv_backend={rdzv_backend!r}: give 'static' (node ranks as given) or 'c10d' (ranks in the "
            "order the nodes join)."
        )
    if not monitor_interval > 0:
        raise ValueError(f"monitor_interval={monitor_interval!r}: give the seconds between checks, > 0.")
    if num_nodes > 1 and not rdzv_endpoint and (use_port is None or not 0 <= node_rank < num_nodes):
        raise ValueError(
            f"num_nodes={num_nodes} with node_rank={node_rank} and use_port={use_port}: on several "
            "machines every call needs the same master_addr and use_port (node 0's address and a free "
            "port there) and its own node_rank in [0, num_nodes)."
        )
    # every torch.cuda query in this process (ours, torch's launcher's) must leave CUDA usable by forks
    with exported(_FORK_SAFE_CUDA_CHECK):
        nproc = resolve_nproc_per_node("auto" if num_processes is None else num_processes, cpu=cpu)
        env = worker_environment(nproc, cpu=cpu, mixed_precision=mixed_precision)
        if nproc == 1 and num_nodes == 1:
            with exported(env):
                return {0: function(*args)}
        if num_nodes == 1 and rdzv_backend == "static" and not rdzv_endpoint:
            # unison's one-node rendezvous binds the port itself (0: the OS's pick, no race with another
            # job between choosing a free port and binding it), on master_addr only
            port = int(use_port) if use_port is not None else 0
            backend, endpoint, configs = ONE_NODE_BACKEND, join_endpoint(master_addr, port), {}
        else:
            port = int(use_port) if use_port is not None else free_loopback_port()  # c10d on one node
            backend, endpoint = rdzv_backend, rdzv_endpoint or join_endpoint(master_addr, port)
            configs = {"rank": node_rank} if rdzv_backend == "static" else dict(rdzv_conf or {})
        rendezvous = {
            "rdzv_backend": backend,
            "rdzv_endpoint": endpoint,
            "rdzv_configs": configs,
            "run_id": rdzv_id,
        }
        with exported(env):
            return _launch_workers(
                function, tuple(args), nproc, num_nodes, rendezvous, max_restarts, monitor_interval
            )


def _launch_workers(
    function: Callable[..., Any],
    args: tuple,
    nproc: int,
    num_nodes: int,
    rendezvous: dict[str, Any],
    max_restarts: int,
    monitor_interval: float,
) -> dict[int, Any]:
    start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    if start_method == "fork" and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA was already initialised in this notebook, and forked workers cannot use it. Restart "
            "the kernel and keep every CUDA call (model.cuda(), torch.cuda.* ...) inside the function."
        )
    with tempfile.TemporaryDirectory(prefix="unison-notebook-") as log_dir:
        config = LaunchConfig(
            min_nodes=num_nodes,
            max_nodes=num_nodes,
            nproc_per_node=nproc,
            **rendezvous,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method=start_method,
            # tee: the workers' output reaches this process's sys.stdout, i.e. the notebook cell
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
            log_line_prefix_template=RANK_PREFIX_TEMPLATE,
        )
        try:
            return elastic_launch(config, _run_in_worker)(function, *args)
        except ChildFailedError as error:
            rank, text = _first_failure(log_dir) or _torch_failure(error)
            if "Cannot re-initialize CUDA in forked subprocess" in text:
                text += _FORKED_CUDA_ADVICE
            message = f"notebook_launcher: rank {rank} failed first:\n{text}"
            raise NotebookLaunchError(message, error) from None


def _run_in_worker(function: Callable[..., Any], *args: Any) -> Any:
    """The worker's entrypoint: the user's function, then a clean end of the process group it formed.

    An exception goes to unison's excepthook when the function formed a group (PartialState installs
    it): the traceback is printed with the failure time recorded, and the process ends at once so its
    peers do not wait in a collective until the timeout.
    """
    try:
        result = function(*args)
    except BaseException:
        if sys.excepthook is not sys.__excepthook__:
            sys.excepthook(*sys.exc_info())
            # the hook wrote the error file with the exact time and whether this failure was a consequence
            # of another rank's; torch's @record around this function would overwrite it on an exception
            raise SystemExit(1) from None
        raise
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return result


def _first_failure(log_dir: str) -> tuple[str, str] | None:
    """(rank, traceback) of the earliest failure recorded by unison's excepthook in the error files."""
    failures = []
    for path in Path(log_dir).rglob("error.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            info = json.loads(path.read_text())["message"]["extraInfo"]
            consequence = bool(info.get("unison_consequence"))  # another rank's end caused it: sorts last
            failures.append(
                (consequence, float(info["unison_failed_at"]), info["unison_rank"], info["py_callstack"])
            )
    return min(failures)[2:] if failures else None


def _torch_failure(error: ChildFailedError) -> tuple[str, str]:
    """(rank, traceback) as torch's agent reported it, when unison recorded nothing."""
    rank = cause_rank(error.failures)  # never a rank the agent terminated because another failed
    failure = error.failures[rank]
    message = failure.message
    if isinstance(message, dict):
        return str(rank), message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    return str(rank), f"exit code {failure.exitcode} ({message})"
