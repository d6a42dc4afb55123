"""Who am I? Detect how this process was started: torchrun / `unison launch`, SLURM's srun, or plain python.

Each cluster environment is a tiny class with one `detect()` that reads the process environment and
returns a `ProcessLayout`, or None when the environment is not the one that started us. They are
tried in order; the first that matches wins, and a plain `python script.py` is one process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_SLURM_PORT_BASE = 15000


@dataclass(frozen=True)
class ProcessLayout:
    """Where this process sits among all the processes of one run."""

    source: str  # "torchrun", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not an integer; the launcher that set it is misconfigured."
        ) from None


class TorchElasticEnvironment:
    """Started by torchrun, torch.distributed.run or `unison launch` (which is built on them)."""

    name = "torchrun"

    @staticmethod
    def detect(env: Mapping[str, str]) -> ProcessLayout | None:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world_size = _int(env, "WORLD_SIZE")
        return ProcessLayout(
            source="torchrun",
            rank=_int(env, "RANK"),
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
        )


class SlurmEnvironment:
    """Started as one task of `srun` without torchrun: SLURM's own variables say who we are.

    The rendezvous host is the first node of the step's node list; the port is MASTER_PORT when set,
    else derived from the job id so that two jobs sharing a node do not collide.
    """

    name = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str]) -> ProcessLayout | None:
        if not all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
            return None
        if env.get("SLURM_JOB_NAME") in ("bash", "interactive"):  # an salloc shell, not a launched task
            return None
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            job_id = _int(env, "SLURM_JOB_ID") if env.get("SLURM_JOB_ID") else 0
            port = DEFAULT_SLURM_PORT_BASE + job_id % 10000
        world_size = _int(env, "SLURM_NTASKS")
        return ProcessLayout(
            source="slurm",
            rank=_int(env, "SLURM_PROCID"),
            world_size=world_size,
            local_rank=_int(env, "SLURM_LOCALID"),
            local_world_size=slurm_tasks_on_this_node(env, world_size),
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
            master_port=port,
        )


class SingleProcessEnvironment:
    """`python script.py`: one process, no process group."""

    name = "single"

    @staticmethod
    def detect(env: Mapping[str, str]) -> ProcessLayout:
        return ProcessLayout(source="single", rank=0, world_size=1, local_rank=0, local_world_size=1)


ENVIRONMENTS = (TorchElasticEnvironment, SlurmEnvironment, SingleProcessEnvironment)


def detect_layout(env: Mapping[str, str] | None = None) -> ProcessLayout:
    """Return the layout of the first environment that recognises `env` (default: os.environ)."""
    env = os.environ if env is None else env
    for environment in ENVIRONMENTS:
        layout = environment.detect(env)
        if layout is not None:
            _validate(layout)
            return layout
    raise AssertionError("SingleProcessEnvironment always matches")


def _validate(layout: ProcessLayout) -> None:
    if layout.world_size < 1 or not 0 <= layout.rank < layout.world_size:
        raise ValueError(
            f"rank {layout.rank} with world size {layout.world_size} (from {layout.source}) is impossible: "
            "the rank must lie in [0, world_size). Check the launcher's variables."
        )
    if not 0 <= layout.local_rank < max(layout.local_world_size, 1):
        raise ValueError(
            f"local rank {layout.local_rank} with {layout.local_world_size} processes on this node "
            f"(from {layout.source}) is impossible: the local rank must lie in [0, local_world_size)."
        )


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR to the first node.")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def slurm_tasks_on_this_node(env: Mapping[str, str], world_size: int) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE, else this node's entry (SLURM_NODEID) of the step's
    or job's tasks-per-node list ('4(x2),3' -> [4, 4, 3]: 4 on nodes 0 and 1, 3 on node 2)."""
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _int(env, "SLURM_NTASKS_PER_NODE")
    name = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    if not env.get(name):
        nnodes = _int(env, "SLURM_NNODES") if env.get("SLURM_NNODES") else 1
        return max(world_size // max(nnodes, 1), 1)
    counts = expand_tasks_per_node(env[name])
    node = _int(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else 0
    if not 0 <= node < len(counts):
        raise ValueError(
            f"SLURM_NODEID={node} has no entry in {name}={env[name]!r} ({len(counts)} nodes): the SLURM "
            "variables disagree; export SLURM_NTASKS_PER_NODE to say how many tasks run on this node."
        )
    return counts[node]


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed tasks-per-node list, one entry per node: '4(x2),3' -> [4, 4, 3]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(
                f"cannot read the SLURM tasks-per-node list {spec!r}: expected entries such as '4' or "
                "'4(x2)' separated by commas. Export SLURM_NTASKS_PER_NODE to override it."
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
