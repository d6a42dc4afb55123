"""environment.detect_layout: who am I, from torchrun's, SLURM's or no variables (pure, dict envs)."""

import pytest

from unison.environment import (
    DEFAULT_SLURM_PORT_BASE,
    ProcessLayout,
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

SLURM = {
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
        master_port=DEFAULT_SLURM_PORT_BASE + 123456 % 10000,
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


def test_slurm_step_node_list_wins_and_salloc_shell_is_not_a_task():
    assert detect_layout({**SLURM, "SLURM_STEP_NODELIST": "a100-[7-8]"}).master_addr == "a100-7"
    assert detect_layout({**SLURM, "SLURM_JOB_NAME": "interactive"}).source == "single"


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
