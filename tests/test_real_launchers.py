"""The real launchers users start unison under: SLURM's srun and sbatch, Open MPI's mpirun, MPICH's mpiexec.

tests/test_environment.py checks what unison reads from these launchers' variables, written by hand. This
module runs the launchers themselves, from Debian's packages (scripts/install_launchers.sh), on a one-host
SLURM cluster started for it (scripts/slurm_cluster.sh): no `unison launch`, one process per task, as
cluster users run. What the real launchers showed and the hand-written variables had not, each fixed in
the library and checked here: two srun tasks each running `unison launch` formed two separate runs (now
refused in every task); ranks outliving rank 0, which serves the store under srun and mpirun, printed
torch's "recvValue failed" C++ traces after runs that succeeded (rank 0 now serves until the others are
done). Marked `cluster`: scripts/test.sh runs them after the suite (`pytest -m cluster`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import REPO_ROOT
from slowness import budget

Completed = subprocess.CompletedProcess

pytestmark = pytest.mark.cluster

GPT = REPO_ROOT / "examples" / "gpt" / "train.py"
MPI_WORKER = REPO_ROOT / "tests" / "workers" / "mpi_env_worker.py"
CRASH_WORKER = REPO_ROOT / "tests" / "workers" / "crash_one_rank_worker.py"
# A small GPT: 6 steps, checkpoints after steps 4 and 6, every loss logged.
GPT_ARGS = ["--cpu", "--max-steps", "6", "--batch-size", "8", "--n-layer", "2", "--n-embd", "64"]
GPT_ARGS += ["--warmup-steps", "2", "--log-interval", "1", "--eval-interval", "6", "--eval-batches", "2"]
GPT_ARGS += ["--sample-chars", "0", "--save-every", "4"]
STORE_NOISE = ("recvValue failed", "sendBytes failed", "TCPStore.cpp")
CRASH_ENDED_WITHIN = 30  # seconds: about 2.5 under srun, 4.5 under mpirun; a hang would be the timeout


def needs(*commands: str):
    missing = [command for command in commands if shutil.which(command) is None]
    return pytest.mark.skipif(
        bool(missing),
        reason=f"{', '.join(missing)} not installed: run scripts/install_launchers.sh (root, apt)",
    )


def clean_environment() -> dict[str, str]:
    """This environment without any launcher's variables (the suite itself may run under one)."""
    prefixes = ("SLURM_", "OMPI_", "PMI", "PMIX_", "MV2_", "TORCHELASTIC_", "MASTER_", "UNISON_")
    ours = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in ours}


def run(
    command: list, env: dict[str, str], timeout: float = 240
) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(
        [str(part) for part in command],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=budget(timeout),
    )
    return result, time.monotonic() - started


def losses(project: Path, run_name: str = "gpt") -> list[tuple[int, float]]:
    records = (json.loads(line) for line in (project / run_name / "metrics.jsonl").read_text().splitlines())
    return [(record["step"], record["loss"]) for record in records if "loss" in record]


def gpt(project: Path, *extra: str, run_name: str = "gpt") -> list[str]:
    return [GPT, *GPT_ARGS, "--project-dir", project, "--run-name", run_name, *extra]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[tuple[int, float]]]:
    """The small GPT's losses under `unison launch --nproc-per-node 2` and as one plain process."""
    base = tmp_path_factory.mktemp("references")
    env = clean_environment()
    commands = {
        "launch2": [
            sys.executable,
            "-m",
            "unison",
            "launch",
            "--nproc-per-node",
            "2",
            *gpt(base / "launch2"),
        ],
        "single": [sys.executable, *gpt(base / "single")],
    }
    processes = {
        name: subprocess.Popen(
            [str(p) for p in command],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, command in commands.items()
    }
    for name, process in processes.items():
        output = process.communicate(timeout=budget(240))[0]
        assert process.returncode == 0, f"{name}:\n{output}"
    return {name: losses(base / name) for name in commands}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict[str, str]:
    """A one-host SLURM cluster for this module; the environment its commands need."""
    if any(shutil.which(command) is None for command in ("slurmctld", "slurmd", "munged", "srun")):
        pytest.skip("SLURM not installed: run scripts/install_launchers.sh (root, apt)")
    if os.geteuid() != 0:
        pytest.skip("the one-host SLURM cluster runs its daemons as root")
    folder = tmp_path_factory.mktemp("slurm")
    script = REPO_ROOT / "scripts" / "slurm_cluster.sh"
    started = subprocess.run(
        ["bash", script, "start", folder], capture_output=True, text=True, timeout=budget(60)
    )
    assert started.returncode == 0, started.stdout + started.stderr
    yield clean_environment() | {"SLURM_CONF": str(folder / "slurm.conf")}
    subprocess.run(["bash", script, "stop", folder], timeout=budget(60))


# -- SLURM -----------------------------------------------------------------------------------------


def test_srun_tasks_train_the_gpt_example_as_unison_launch_does(slurm, references, tmp_path):
    """`srun -N1 -n2 python train.py`: one process per task, pinned to a core each by SLURM's affinity,
    gives the losses of `unison launch --nproc-per-node 2`, bit for bit, and exits quietly."""
    result, _ = run(["srun", "-N1", "-n2", "--time=5", sys.executable, *gpt(tmp_path)], slurm)
    assert result.returncode == 0, result.stdout + result.stderr
    assert losses(tmp_path) == references["launch2"]
    assert len(references["launch2"]) == 6
    assert not [noise for noise in STORE_NOISE if noise in result.stderr], result.stderr


SBATCH_TWO_STEPS = """#!/bin/bash
#SBATCH --ntasks=2 --nodes=1 --time=5
set -e
srun {python} {first}
rm -r {checkpoints}/checkpoint_6          # as if the job had ended after step 4's checkpoint
srun {python} {second}
"""


def test_an_sbatch_script_whose_srun_steps_save_and_resume(slurm, references, tmp_path):
    """An sbatch script whose body calls srun twice: the first job step trains 6 steps (checkpoints after
    4 and 6), the newest checkpoint is dropped, the second step resumes from step 4's: its steps 5-6 have
    the first step's losses, and the first step has `unison launch`'s."""
    script = tmp_path / "job.sh"
    quote = lambda parts: " ".join(str(part) for part in parts)  # noqa: E731 (no spaces in these paths)
    script.write_text(
        SBATCH_TWO_STEPS.format(
            python=sys.executable,
            first=quote(gpt(tmp_path / "run", run_name="first")),
            second=quote(gpt(tmp_path / "run", "--resume", run_name="second")),
            checkpoints=tmp_path / "run" / "checkpoints",
        )
    )
    log = tmp_path / "job.log"
    result, _ = run(["sbatch", "--wait", "--output", log, script], slurm)
    output = log.read_text() if log.exists() else ""
    assert result.returncode == 0, result.stdout + result.stderr + output
    first, second = losses(tmp_path / "run", "first"), losses(tmp_path / "run", "second")
    assert first == references["launch2"]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'checkpoint_4'} at step 4" in output
    assert second == first[4:] and [step for step, _ in second] == [5, 6]


SBATCH_BATCH_STEP = """#!/bin/bash
#SBATCH --ntasks=2 --nodes=1 --time=5
{command}
"""


def test_the_batch_step_alone_runs_one_process_and_says_why(slurm, references, tmp_path):
    """An sbatch script of 2 tasks that runs python without srun: its batch step carries SLURM_NTASKS=2
    but is one process. unison trains as one process (the plain-python losses) and says why."""
    script = tmp_path / "job.sh"
    script.write_text(SBATCH_BATCH_STEP.format(command=" ".join(map(str, [sys.executable, *gpt(tmp_path)]))))
    log = tmp_path / "job.log"
    result, _ = run(["sbatch", "--wait", "--output", log, script], slurm)
    output = log.read_text() if log.exists() else ""
    assert result.returncode == 0, result.stdout + result.stderr + output
    assert "not started by srun" in output and "running as one process" in output, output
    assert losses(tmp_path) == references["single"]


def test_srun_of_several_unison_launches_is_refused_in_every_task(slurm, tmp_path):
    """`srun -n2 unison launch --nproc-per-node 2`: two launchers would form two runs of 2 on the same
    devices (they did, before). Each task refuses before starting a worker, naming both fixes."""
    command = ["srun", "-N1", "-n2", "--time=5", sys.executable, "-m", "unison", "launch"]
    result, _ = run([*command, "--nproc-per-node", "2", *gpt(tmp_path)], slurm)
    assert result.returncode != 0
    refusals = [line for line in result.stderr.splitlines() if "one of 2 tasks on 1 node that srun" in line]
    assert len(refusals) == 2, result.stderr
    assert "`srun -n 2 python train.py`" in refusals[0]
    assert "`srun -n 1 unison launch --nproc-per-node N train.py`" in refusals[0]
    assert not (tmp_path / "gpt").exists()  # no worker started


@pytest.mark.parametrize("crashing_rank", [0, 1])
def test_a_crash_of_one_srun_task_ends_the_step_within_seconds(slurm, crashing_rank):
    """One task raises at its third step while the other waits in the all-reduce: the step ends, every
    task with a non-zero status, the traceback printed once; also when the crashed task is rank 0, whose
    process serves the store."""
    command = ["srun", "-N1", "-n2", "--time=5", sys.executable, CRASH_WORKER, crashing_rank]
    result, seconds = run(command, slurm, timeout=120)
    assert result.returncode != 0 and seconds < CRASH_ENDED_WITHIN, (seconds, result.stderr)
    together = "tasks 0-1: Exited with exit code 1" in result.stderr  # srun reports them in one line or two
    apart = all(f"task {task}: Exited with exit code 1" in result.stderr for task in (0, 1))
    assert together or apart, result.stderr
    assert result.stderr.count(f"planned crash of rank {crashing_rank}") == 1, result.stderr
    assert not [noise for noise in STORE_NOISE if noise in result.stderr], result.stderr


# -- MPI -------------------------------------------------------------------------------------------


def mpirun(processes: int) -> list[str]:
    """Open MPI's mpirun: as root it needs --allow-run-as-root; more ranks than cores, --oversubscribe."""
    return ["mpirun", "-np", str(processes), "--allow-run-as-root", "--oversubscribe"]


@needs("mpirun")
def test_mpirun_trains_the_gpt_example_as_unison_launch_does(references, tmp_path):
    result, _ = run([*mpirun(2), sys.executable, *gpt(tmp_path)], clean_environment())
    assert result.returncode == 0, result.stdout + result.stderr
    assert losses(tmp_path) == references["launch2"]
    assert not [noise for noise in STORE_NOISE if noise in result.stderr], result.stderr


@needs("mpirun")
@pytest.mark.parametrize("crashing_rank", [0, 2])
def test_a_crash_of_one_of_three_mpirun_ranks_ends_the_job_within_seconds(crashing_rank):
    result, seconds = run([*mpirun(3), sys.executable, CRASH_WORKER, crashing_rank], clean_environment(), 120)
    assert result.returncode != 0 and seconds < CRASH_ENDED_WITHIN, (seconds, result.stderr)
    assert result.stderr.count(f"planned crash of rank {crashing_rank}") == 1, result.stderr
    assert not [noise for noise in STORE_NOISE if noise in result.stderr], result.stderr


@needs("mpiexec.hydra")
def test_mpich_mpiexec_ranks_form_one_group(tmp_path):
    """MPICH's Hydra exports PMI_RANK / PMI_SIZE / MPI_LOCALRANKID and no job id: the port comes from the
    shared proxy parent. Three ranks form one group equal to one process."""
    result, _ = run(["mpiexec.hydra", "-n", "3", sys.executable, MPI_WORKER, tmp_path], clean_environment())
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert [(r["source"], r["rank"], r["world"], r["local_rank"]) for r in records] == [
        ("mpi", rank, 3, rank) for rank in range(3)
    ]
    assert max(r["max_diff_from_one_process"] for r in records) < 1e-6
    assert not [noise for noise in STORE_NOISE if noise in result.stderr], result.stderr
