"""environment.detect_layout: who am I, from torchrun's, mpirun's, SLURM's or no variables (pure, dict
envs), the GPU each process takes, and one real group formed by plain processes from mpirun's variables."""

import json
import logging
import os
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import pytest
import torch
from slowness import budget

from unison import state as state_module
from unison.environment import (
    DERIVED_PORT_BASE,
    MPI_LAUNCHERS,
    ProcessLayout,
    _warn_once,
    detect_layout,
    expand_tasks_per_node,
    first_host,
)

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29611",
}

SLURM = {  # task 9 of an `srun` step
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "9",
    "SLURM_NTASKS": "11",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[003-005,9],cpu1",
    "SLURM_TASKS_PER_NODE": "4(x2),3",
}


def test_torchrun_variables():
    assert detect_layout(TORCHRUN) == ProcessLayout(
        source="torchrun",
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        master_addr="10.1.2.3",
        master_port=29611,
    )
    assert detect_layout(TORCHRUN).node_rank == 1


def test_torchrun_minimal_variables_default_to_one_node():
    layout = detect_layout({"RANK": "1", "WORLD_SIZE": "2"})
    assert (layout.local_rank, layout.local_world_size) == (0, 2)
    assert (layout.master_addr, layout.master_port) == ("127.0.0.1", 29500)


def test_torchrun_wins_over_slurm():
    """torchrun started inside an srun step: torchrun's per-process variables are the truth."""
    assert detect_layout({**SLURM, **TORCHRUN}).source == "torchrun"


def test_slurm_variables():
    layout = detect_layout(SLURM)
    assert layout == ProcessLayout(
        source="slurm",
        rank=9,
        world_size=11,
        local_rank=1,
        local_world_size=3,  # node 2 of '4(x2),3'
        master_addr="gpu003",  # first host of the node list
        master_port=DERIVED_PORT_BASE + 123456 % 10000,
    )


def test_slurm_port_differs_between_jobs_and_respects_master_variables():
    ports = {detect_layout({**SLURM, "SLURM_JOB_ID": str(job)}).master_port for job in (1, 2, 3)}
    assert len(ports) == 3
    layout = detect_layout({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4242"})
    assert (layout.master_addr, layout.master_port) == ("head", 4242)


def test_slurm_tasks_per_node_sources():
    assert detect_layout({**SLURM, "SLURM_NODEID": "0"}).local_world_size == 4
    # the step's own list wins over the job's, and SLURM_NTASKS_PER_NODE over both
    assert detect_layout({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x3),5"}).local_world_size == 2
    step = {"SLURM_STEP_TASKS_PER_NODE": "2(x3),5", "SLURM_NTASKS_PER_NODE": "2"}
    assert detect_layout({**SLURM, **step}).local_world_size == 2
    without = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    assert detect_layout({**without, "SLURM_NNODES": "3", "SLURM_LOCALID": "0"}).local_world_size == 3


def test_slurm_step_node_list_wins():
    assert detect_layout({**SLURM, "SLURM_STEP_NODELIST": "a100-[7-8]"}).master_addr == "a100-7"


# The batch script of `sbatch --ntasks=4 --nodes=2`, as slurmstepd starts it: task 0's ids, the job's task
# count, no SLURM_STEP_ID (Slurm's master branch writes the batch step's id as -5 instead).
BATCH_STEP = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NAME": "train.sbatch",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


@pytest.fixture
def warnings_anew():
    """_warn_once says each message once per process; each test starts from none said."""
    _warn_once.cache_clear()
    yield
    _warn_once.cache_clear()


@pytest.mark.parametrize("step_id", [None, "-5", "batch"])
def test_sbatch_batch_step_runs_alone_and_says_why_once(step_id, caplog, warnings_anew):
    env = BATCH_STEP if step_id is None else {**BATCH_STEP, "SLURM_STEP_ID": step_id}
    with caplog.at_level(logging.WARNING, logger="unison"):
        layouts = [detect_layout(env) for _ in range(3)]  # random seeding, plugins and the state all ask
    assert {layout.source for layout in layouts} == {"single"}
    assert (layouts[0].rank, layouts[0].world_size) == (0, 1)
    assert [r.getMessage() for r in caplog.records] == [
        "SLURM job with 4 tasks, but this process was not started by srun (no SLURM_STEP_ID: the batch "
        "script or an salloc shell): running as one process. Start the tasks with `srun python train.py` "
        "or `unison launch`."
    ]


def test_a_one_task_batch_step_runs_alone_silently(caplog, warnings_anew):
    with caplog.at_level(logging.WARNING, logger="unison"):
        assert detect_layout({**BATCH_STEP, "SLURM_NTASKS": "1"}).source == "single"
    assert caplog.records == []


def test_srun_in_the_batch_script_is_a_step():
    task = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"}
    layout = detect_layout({**BATCH_STEP, **task})
    assert (layout.source, layout.rank, layout.world_size, layout.local_rank, layout.local_world_size) == (
        "slurm",
        3,
        4,
        1,
        2,
    )


def test_salloc_shell_runs_alone_and_srun_inside_it_is_a_step(warnings_anew):
    """An salloc shell (its job name 'interactive' or 'bash') holds no step; an srun inside it does, whatever
    the job's name (Lightning turned those away by name: its issue #20776)."""
    shell = {**BATCH_STEP, "SLURM_JOB_NAME": "interactive"}
    assert detect_layout(shell).source == "single"
    for name in ("interactive", "bash"):
        layout = detect_layout({**shell, "SLURM_JOB_NAME": name, "SLURM_STEP_ID": "2", "SLURM_PROCID": "1"})
        assert (layout.source, layout.rank, layout.world_size) == ("slurm", 1, 4)


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu[003-005,9],cpu1", "gpu003"),
        ("node17", "node17"),
        ("node17,node2", "node17"),
        ("rack-a[10-11]", "rack-a10"),
        ("x[7,3-4]", "x7"),
    ],
)
def test_first_host(nodelist, first):
    assert first_host(nodelist) == first


@pytest.mark.parametrize(
    "spec, counts", [("4(x2),3", [4, 4, 3]), ("8", [8]), ("1,2(x3)", [1, 2, 2, 2]), (" 2(x2) ", [2, 2])]
)
def test_expand_tasks_per_node(spec, counts):
    assert expand_tasks_per_node(spec) == counts


def test_plain_python_is_one_process():
    layout = detect_layout({"PATH": "/usr/bin", "MASTER_PORT": "1234"})
    assert (layout.source, layout.rank, layout.world_size, layout.local_rank, layout.local_world_size) == (
        "single",
        0,
        1,
        0,
        1,
    )


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"rank 2 with world size 2 \(from torchrun\) is impossible"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "rank -1 with world size 2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank 2 with 2"),
        ({**SLURM, "SLURM_PROCID": "11"}, r"rank 11 with world size 11 \(from slurm\)"),
        ({**SLURM, "SLURM_NTASKS": "many"}, "SLURM_NTASKS='many' is not an integer"),
        ({**SLURM, "SLURM_JOB_ID": "12x"}, "SLURM_JOB_ID='12x' is not an integer"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "4(y2)"}, "cannot read the SLURM tasks-per-node list '4\\(y2\\)'"),
        ({**SLURM, "SLURM_NODEID": "3"}, "SLURM_NODEID=3 has no entry"),
        ({**SLURM, "SLURM_LOCALID": "3"}, r"local rank 3 with 3 processes on this node \(from slurm\)"),
    ],
)
def test_invalid_values_give_clear_errors(env, message):
    with pytest.raises(ValueError, match=message):
        detect_layout(env)


def open_mpi(rank: int, size: int, local_rank: int, local_size: int, **extra: str) -> dict[str, str]:
    """What Open MPI's mpirun exports to rank `rank` (its PMIx server adds the job's namespace)."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        **extra,
    }


# What MPICH's or Intel MPI's Hydra exports to rank 1 of 2 on one node.
HYDRA_ONE_NODE = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


@pytest.mark.parametrize("launcher", MPI_LAUNCHERS, ids=lambda launcher: launcher.rank.split("_")[0])
def test_each_mpi_launchers_variables(launcher):
    env = dict(zip(launcher.variables, ("5", "8", "1", "4")))
    layout = detect_layout({**env, "MASTER_ADDR": "node01", "MASTER_PORT": "29444"})
    assert layout == ProcessLayout(
        source="mpi",
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        master_addr="node01",
        master_port=29444,
    )


def test_mpi_on_one_node_meets_on_loopback_at_a_port_every_rank_derives_alike():
    job = "prterun-node01-4242@1"
    layouts = [detect_layout(open_mpi(rank, 3, rank, 3, PMIX_NAMESPACE=job)) for rank in range(3)]
    assert [layout.rank for layout in layouts] == [0, 1, 2]
    assert {(layout.master_addr, layout.master_port) for layout in layouts} == {
        ("127.0.0.1", DERIVED_PORT_BASE + zlib.crc32(job.encode()) % 10000)
    }
    other_job = detect_layout(open_mpi(0, 3, 0, 3, PMIX_NAMESPACE="prterun-node01-4243@1"))
    assert other_job.master_port != layouts[0].master_port
    # Open MPI <= 4 hands every rank mpirun's URI; Intel MPI a job UUID
    orte = {**open_mpi(0, 2, 0, 2), "OMPI_MCA_orte_hnp_uri": "31.0;tcp://10.0.0.1:4100"}
    intel = {**HYDRA_ONE_NODE, "I_MPI_HYDRA_UUID": "9d260000-7c26-e807"}
    ports = {detect_layout(orte).master_port, detect_layout(intel).master_port}
    assert len(ports) == 2 and all(DERIVED_PORT_BASE <= port < DERIVED_PORT_BASE + 10000 for port in ports)


def test_mpich_on_one_node_derives_its_port_from_the_shared_parent(monkeypatch):
    """Hydra exports no job id; every rank on the node is a child of its hydra_pmi_proxy."""
    monkeypatch.setattr(os, "getppid", lambda: 123456)
    layout = detect_layout(HYDRA_ONE_NODE)
    assert (layout.master_addr, layout.master_port) == ("127.0.0.1", DERIVED_PORT_BASE + 123456 % 10000)


def test_mpi_across_nodes_needs_the_address_and_a_shared_port():
    two_nodes = open_mpi(5, 8, 1, 4)
    with pytest.raises(
        ValueError,
        match=r"Open MPI's mpirun started 8 processes on several nodes \(4 on this "
        r"one\) but MASTER_ADDR is not set.*`mpirun -x MASTER_ADDR=node01 -x MASTER_PORT=29500",
    ):
        detect_layout(two_nodes)
    with pytest.raises(ValueError, match=r"exports no job identifier .* MASTER_PORT is not set"):
        detect_layout({**two_nodes, "MASTER_ADDR": "node01"})
    layout = detect_layout({**two_nodes, "MASTER_ADDR": "node01", "PMIX_NAMESPACE": "job7"})
    assert (layout.master_addr, layout.master_port) == (
        "node01",
        DERIVED_PORT_BASE + zlib.crc32(b"job7") % 10000,
    )
    hydra = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    with pytest.raises(ValueError, match=r"`mpiexec -genv MASTER_ADDR node01 -genv MASTER_PORT 29500"):
        detect_layout(hydra)


def test_launcher_order_around_mpi():
    # mpirun inside an sbatch job starts its remote daemons with srun: a rank there also carries that
    # step's variables (one task per node), but mpirun's are its own
    remote = {**SLURM, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    layout = detect_layout({**remote, **open_mpi(5, 8, 1, 4, MASTER_ADDR="n1", PMIX_NAMESPACE="j")})
    assert (layout.source, layout.rank, layout.world_size) == ("mpi", 5, 8)
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but not Hydra's local variables: SLURM's task
    assert detect_layout({**SLURM, "PMI_RANK": "9", "PMI_SIZE": "11", "PMI_FD": "5"}).source == "slurm"
    # torchrun started by mpirun: torchrun's workers
    assert detect_layout({**open_mpi(0, 2, 0, 2), **TORCHRUN}).source == "torchrun"


@pytest.mark.parametrize(
    "env, message",
    [
        (open_mpi(0, 2, 0, 2, OMPI_COMM_WORLD_RANK="x"), "OMPI_COMM_WORLD_RANK='x' is not an integer"),
        (open_mpi(2, 2, 0, 2), r"rank 2 with world size 2 \(from mpi\) is impossible"),
        (open_mpi(0, 2, 0, 2, MASTER_PORT="any"), "MASTER_PORT='any' is not an integer"),
    ],
)
def test_invalid_mpi_values_give_clear_errors(env, message):
    with pytest.raises(ValueError, match=message):
        detect_layout(env)


def node_layout(local_rank: int, local_world_size: int) -> ProcessLayout:
    return ProcessLayout("slurm", local_rank, local_world_size, local_rank, local_world_size)


@pytest.mark.parametrize(
    "local_rank, local_world_size, visible, index",
    [
        (2, 4, 4, 2),  # every task sees the node's GPUs: GPU LOCAL_RANK
        (2, 4, 8, 2),
        (0, 1, 1, 0),
        (3, 4, 1, 0),  # srun --gpus-per-task=1: each task sees its own GPU, as cuda:0
    ],
)
def test_the_gpu_each_process_takes(local_rank, local_world_size, visible, index):
    assert node_layout(local_rank, local_world_size).cuda_index(visible, None) == index


def test_more_processes_than_several_visible_gpus_are_refused():
    with pytest.raises(
        ValueError,
        match=r"4 processes were started on this node but this one sees 2 GPUs "
        r"\(CUDA_VISIBLE_DEVICES '0,1'\).*srun --gpus-per-task=1",
    ):
        node_layout(1, 4).cuda_index(2, "0,1")
    with pytest.raises(ValueError, match=r"sees 2 GPUs \(CUDA_VISIBLE_DEVICES unset: all of the node's\)"):
        node_layout(1, 4).cuda_index(2, None)


def test_pick_device_gives_a_task_with_one_gpu_that_gpu(monkeypatch):
    """state._pick_device on a node where SLURM gave each of 4 tasks one GPU (no GPU needed here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert state_module._pick_device(node_layout(3, 4), cpu=False) == (torch.device("cuda", 0), "nccl")
    assert state_module._pick_device(node_layout(3, 4), cpu=True) == (torch.device("cpu"), "gloo")


WORKER = Path(__file__).parent / "workers" / "mpi_env_worker.py"
NPROC = 3


def test_plain_processes_with_mpiruns_variables_form_one_group_and_train_as_one_process(tmp_path):
    """N `python worker.py` processes started as Open MPI's mpirun would start them (its variables, no
    torchrun or SLURM ones, no MASTER_*): one gloo group of N with mpirun's ranks, equal to one process."""
    ours = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    base = {
        name: value
        for name, value in os.environ.items()
        if name not in ours and not name.startswith(("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI", "MV2_"))
    }
    base |= {"OMP_NUM_THREADS": "1", "UNISON_TIMEOUT": "60", "PMIX_NAMESPACE": f"test-{uuid.uuid4()}"}
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path)],
            env={**base, **open_mpi(rank, NPROC, rank, NPROC)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(NPROC)
    ]
    outputs = [worker.communicate(timeout=budget(120))[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * NPROC, "\n".join(outputs)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(NPROC)]
    for rank, record in enumerate(records):
        assert (record["source"], record["rank"], record["local_rank"], record["world"]) == (
            "mpi",
            rank,
            rank,
            3,
        )
        assert (record["dist_rank"], record["dist_world"]) == (rank, NPROC)
        assert record["gathered_ranks"] == [[r, r] for r in range(NPROC)]
        assert record["steps"] == 3
        assert record["max_diff_from_one_process"] < 1e-6
    assert len({tuple(record["master"]) for record in records}) == 1


@pytest.mark.parametrize("source", ["slurm", "mpi"])
def test_srun_and_mpirun_across_nodes_choose_the_interface_towards_the_rendezvous(source, monkeypatch):
    """As `unison launch` does for its workers: without it, gloo binds the address the host name
    resolves to. One node needs nothing; a variable already exported wins."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    across = ProcessLayout(
        source, rank=0, world_size=4, local_rank=0, local_world_size=2, master_addr="127.0.0.1"
    )
    assert state_module._socket_interface(across) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    one_node = ProcessLayout(source, rank=0, world_size=2, local_rank=0, local_world_size=2)
    assert state_module._socket_interface(one_node) == {}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert state_module._socket_interface(across) == {"NCCL_SOCKET_IFNAME": "lo"}
