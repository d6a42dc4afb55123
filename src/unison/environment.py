"""Who am I? Detect how this process was started: torchrun / `unison launch`, mpirun, SLURM's srun, or
plain python (docs/launchers.md lists what each gets).

Each cluster environment is a tiny class with one `detect()` that reads the process environment and
returns a `ProcessLayout`, or None when the environment is not the one that started us. They are
tried in order; the first that matches wins, and a plain `python script.py` is one process. The
order puts the launcher that started this very process before the scheduler around it: torchrun run
inside an srun step sets RANK for each of its workers, and mpirun inside an sbatch allocation starts
its remote daemons with srun, so its ranks on other nodes carry that srun step's SLURM_PROCID (one per
node) beside their own OMPI_COMM_WORLD_RANK.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

logger = logging.getLogger("unison")

# Ports derived from a job's identity (SLURM job id, MPI job namespace) lie in [BASE, BASE + 10000).
DERIVED_PORT_BASE = 15000


@dataclass(frozen=True)
class ProcessLayout:
    """Where this process sits among all the processes of one run."""

    source: str  # "torchrun", "mpi", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)

    def cuda_index(self, visible: int, cuda_visible_devices: str | None) -> int:
        """The CUDA device this process trains on, given the GPUs it sees (torch.cuda.device_count(),
        which CUDA_VISIBLE_DEVICES narrows and renumbers from 0).

        One process per GPU. Where every process of the node sees all of the node's GPUs (torchrun,
        `unison launch`, srun with --gpus-per-node), process LOCAL_RANK takes GPU LOCAL_RANK. Where the
        launcher gave each process a GPU of its own (`srun --gpus-per-task=1`, or a binding script
        exporting one CUDA_VISIBLE_DEVICES entry per task), each sees exactly one, as its cuda:0, while
        several share the node: that one is this process's. (Should tasks that share a single GPU land
        here, NCCL refuses a group with two ranks on one device: "Duplicate GPU detected".) More
        processes on the node than the several GPUs this one sees cannot be mapped without guessing.
        """
        if self.local_world_size <= visible:
            return self.local_rank
        if visible == 1:
            return 0
        seen = "unset: all of the node's" if cuda_visible_devices is None else repr(cuda_visible_devices)
        raise ValueError(
            f"{self.local_world_size} processes were started on this node but this one sees {visible} GPUs "
            f"(CUDA_VISIBLE_DEVICES {seen}): each process needs a GPU of its own, and which of these is "
            "this process's cannot be told. Start at most that many processes per node (--nproc-per-node, "
            "srun --ntasks-per-node), give each task one GPU (srun --gpus-per-task=1), or pass --cpu / "
            "Accelerator(cpu=True) to train on the CPU."
        )


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


class MpiLauncher(NamedTuple):
    """The variables one MPI implementation's launcher exports to every process it starts."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str
    export: str  # how its launcher passes MASTER_ADDR / MASTER_PORT to every rank

    @property
    def variables(self) -> tuple[str, str, str, str]:
        return self.rank, self.size, self.local_rank, self.local_size


MPI_LAUNCHERS = (
    MpiLauncher(
        "Open MPI's mpirun",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "`mpirun -x MASTER_ADDR=node01 -x MASTER_PORT=29500 ...`",
    ),
    MpiLauncher(
        "mpiexec (MPICH / Intel MPI Hydra)",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        "`mpiexec -genv MASTER_ADDR node01 -genv MASTER_PORT 29500 ...`",
    ),
    MpiLauncher(
        "MVAPICH's mpirun_rsh",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
        "`mpirun_rsh -np 8 -hostfile hosts MASTER_ADDR=node01 MASTER_PORT=29500 python train.py`",
    ),
)

# Identical in every process of one MPI job, on every node, and different between jobs: the job's PMIx
# namespace (PMIx_server_setup_fork sets it for each rank Open MPI's runtime starts), the URI of Open MPI's
# mpirun that ORTE (Open MPI <= 4) hands each rank, Intel MPI's job UUID (oneCCL keys its sockets on it).
MPI_JOB_IDS = ("PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri", "I_MPI_HYDRA_UUID")


class MpiEnvironment:
    """Started by `mpirun` / `mpiexec` (Open MPI, MPICH or Intel MPI's Hydra, MVAPICH) without torchrun.

    Every MPI launcher exports each process's rank, the world size and the rank and count on its node
    (the names differ per implementation, see MPI_LAUNCHERS; Accelerate's `get_cpu_distributed_information`
    reads the same ones). What none of them exports is where the process group should meet, and without
    mpi4py there is no MPI channel to agree on it, so:

    - the address is MASTER_ADDR; when it is absent and all ranks share this node (local size == size),
      127.0.0.1; across several nodes a ValueError on every rank names what to export.
    - the port is MASTER_PORT; else derived from an identifier that every process of this MPI job holds
      and other jobs do not (MPI_JOB_IDS: Open MPI's PMIx namespace or mpirun's URI, Intel MPI's job
      UUID); else, on one node only, from the parent process id: MPICH's Hydra and MVAPICH export no job
      identifier, but their per-node proxy (hydra_pmi_proxy, mpispawn) is the parent of every rank on the
      node. That parent is not shared across nodes, nor when each rank runs under a wrapper script of its
      own (`mpirun -n 4 ./run.sh`): export MASTER_PORT there.

    Only the variables each launcher sets itself count: `srun --mpi=pmi2` sets PMI_RANK and PMI_SIZE too,
    but not Hydra's MPI_LOCALRANKID, so srun tasks stay SLURM's (SlurmEnvironment derives the address).
    """

    name = "mpi"

    @staticmethod
    def detect(env: Mapping[str, str]) -> ProcessLayout | None:
        launcher = next((m for m in MPI_LAUNCHERS if all(name in env for name in m.variables)), None)
        if launcher is None:
            return None
        rank, world_size, local_rank, local_world_size = (_int(env, name) for name in launcher.variables)
        one_node = local_world_size == world_size
        if env.get("MASTER_ADDR"):
            master_addr = env["MASTER_ADDR"]
        elif one_node:
            master_addr = "127.0.0.1"
        else:
            raise ValueError(
                f"{launcher.name} started {world_size} processes on several nodes ({local_world_size} on "
                "this one) but MASTER_ADDR is not set: nothing tells unison which host runs rank 0, where "
                "the process group meets. Export that host's name (with the default mapping, the first "
                f"host of the host list) and a free port to every rank, e.g. {launcher.export}."
            )
        return ProcessLayout(
            source="mpi",
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            master_addr=master_addr,
            master_port=_mpi_port(env, launcher, one_node),
        )


def _mpi_port(env: Mapping[str, str], launcher: MpiLauncher, one_node: bool) -> int:
    """MASTER_PORT, else a port derived from the MPI job's identifier, else (one node) from the parent
    process: the launcher's per-node proxy. crc32, not hash(): Python salts str hashes per process."""
    if "MASTER_PORT" in env:
        return _int(env, "MASTER_PORT")
    job_id = next((env[name] for name in MPI_JOB_IDS if env.get(name)), None)
    if job_id is not None:
        return DERIVED_PORT_BASE + zlib.crc32(job_id.encode()) % 10000
    if one_node:
        return DERIVED_PORT_BASE + os.getppid() % 10000
    raise ValueError(
        f"{launcher.name} exports no job identifier ({', '.join(MPI_JOB_IDS)}) that all ranks on several "
        "nodes share, so unison cannot derive a rendezvous port they agree on, and MASTER_PORT is not set. "
        f"Export a free port on rank 0's host to every rank, e.g. {launcher.export}."
    )


class SlurmEnvironment:
    """Started as one task of `srun` without torchrun: SLURM's own variables say who we are.

    Only a job step started by srun holds tasks. The batch script of `sbatch --ntasks=4` runs once, on
    the first node, in the job's batch step, yet carries SLURM_PROCID=0, SLURM_LOCALID=0 and
    SLURM_NTASKS=4: taken for task 0 of 4 it would wait for three peers that never start. slurmstepd
    sets SLURM_STEP_ID only for a numbered step: its setup_env() writes it when the step id is >= 0,
    and the batch, interactive (salloc's shell) and extern steps carry negative special ids
    (SLURM_BATCH_SCRIPT = 0xfffffffb, read as an int; SchedMD/slurm src/common/env.c, slurmstepd's
    task.c; env_array_for_step sets it for srun, env_array_for_batch_job does not). Slurm's master
    branch (commit 87077e7c, 2026) writes those special ids as negative numbers instead of leaving the
    variable out, so a step is a SLURM_STEP_ID that is a non-negative integer. Lightning keys the same
    decision on the job name 'bash' / 'interactive', which also turns away `srun` inside an salloc
    shell (its issue #20776; its open PR #21712 reads SLURM_STEP_ID first); submitit avoids it by
    always starting tasks with srun from its batch file. Outside a step this is one process, and with
    several tasks a warning says why and how to start them all.

    The rendezvous host is the first node of the step's node list; the port is MASTER_PORT when set,
    else derived from the job id so that two jobs sharing a node do not collide.
    """

    name = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str]) -> ProcessLayout | None:
        if not all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
            return None
        world_size = _int(env, "SLURM_NTASKS")
        if not re.fullmatch(r"\d+", env.get("SLURM_STEP_ID", "")):
            if world_size > 1:
                _warn_once(
                    f"SLURM job with {world_size} tasks, but this process was not started by srun (no "
                    "SLURM_STEP_ID: the batch script or an salloc shell): running as one process. Start "
                    "the tasks with `srun python train.py` or `unison launch`."
                )
            return None
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            job_id = _int(env, "SLURM_JOB_ID") if env.get("SLURM_JOB_ID") else 0
            port = DERIVED_PORT_BASE + job_id % 10000
        return ProcessLayout(
            source="slurm",
            rank=_int(env, "SLURM_PROCID"),
            world_size=world_size,
            local_rank=_int(env, "SLURM_LOCALID"),
            local_world_size=slurm_tasks_on_this_node(env, world_size),
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
            master_port=port,
        )


@functools.cache
def _warn_once(message: str) -> None:
    """detect_layout runs several times per process (random seeding, plugins, the state): say it once."""
    logger.warning(message)


class SingleProcessEnvironment:
    """`python script.py`: one process, no process group."""

    name = "single"

    @staticmethod
    def detect(env: Mapping[str, str]) -> ProcessLayout:
        return ProcessLayout(source="single", rank=0, world_size=1, local_rank=0, local_world_size=1)


ENVIRONMENTS = (TorchElasticEnvironment, MpiEnvironment, SlurmEnvironment, SingleProcessEnvironment)


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
