"""`unison launch` started by another launcher (srun, mpirun, mpiexec) as several tasks.

`srun -n 2 unison launch --nproc-per-node 2 train.py` starts two launchers, and each forms a job of its
own: two 2-process runs on the same devices, each believing it is the whole run, writing the same
checkpoints (seen with SLURM 22.05: two rank 0s, no error). One launcher per node is a real pattern
(`srun --ntasks-per-node=1 unison launch --nnodes N --rdzv-endpoint ...`); several per node, or one
per node without --nnodes covering them, is refused before anything starts, in every task.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..environment import MPI_LAUNCHERS
from .errors import LaunchError


def refuse_several_launchers(env: Mapping[str, str], max_nodes: int) -> None:
    """Raise LaunchError if this `unison launch` is one of several tasks an outer launcher started and
    they would not form one run: more than one on a node, or more nodes than --nnodes admits."""
    found = _outer_tasks(env)
    if found is None:
        return
    launcher, tasks, nodes, run_instead = found
    if tasks <= 1 or (tasks == nodes and nodes <= max_nodes):
        return
    spread = "-n 1" if nodes == 1 else f"-N {nodes} --ntasks-per-node=1"
    if launcher != "srun":
        spread = f"-np {nodes} --map-by ppr:1:node"
    together = "--nproc-per-node N" if nodes == 1 else f"--nnodes {nodes} --rdzv-endpoint HOST:PORT"
    one_per_node = f"{launcher} {spread} unison launch {together} train.py"
    raise LaunchError(
        f"unison launch is running as one of {tasks} tasks on {nodes} node{'s' if nodes > 1 else ''} that "
        f"{launcher} started: each would form a run of its own ({tasks} separate runs on the same devices, "
        f"each writing the same checkpoints). Let {launcher} start the processes itself, "
        f"`{run_instead} python train.py` (unison reads its variables), or run one unison launch per node: "
        f"`{one_per_node}`."
    )


def _outer_tasks(env: Mapping[str, str]) -> tuple[str, int, int, str] | None:
    """(launcher, its tasks, their nodes, how to run without unison launch) of the srun step or MPI job
    this process is a task of; None outside one. An sbatch script's batch step is no srun step: one task."""
    if re.fullmatch(r"\d+", env.get("SLURM_STEP_ID", "")) and "SLURM_PROCID" in env:
        tasks = _count(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        nodes = _count(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
        return "srun", tasks, nodes, f"srun -n {tasks}"
    for launcher in MPI_LAUNCHERS:
        if all(name in env for name in launcher.variables):
            tasks, per_node = _count(env, launcher.size), _count(env, launcher.local_size)
            command = launcher.name.split("'s ")[-1].split()[0]  # mpirun, mpiexec, mpirun_rsh
            return command, tasks, -(-tasks // per_node), f"{command} -np {tasks}"
    return None


def _count(env: Mapping[str, str], *names: str) -> int:
    """The first of `names` that holds a positive integer; 1 if none does."""
    for name in names:
        if env.get(name, "").isdigit() and int(env[name]) > 0:
            return int(env[name])
    return 1
