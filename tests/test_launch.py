"""`unison launch` and `unison env`: real launches through the CLI, and the flag checks before them."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launching import REPO_ROOT, describe, launch, launch_ok
from slowness import budget
from torch.distributed import run as torchrun

from unison import env_vars
from unison.launching import launcher
from unison.launching import options as launch_options
from unison.launching.launcher import LaunchError, LaunchOptions
from unison.launching.nesting import refuse_several_launchers

WORKER = "tests/workers/launch_worker.py"


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unison", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=budget(timeout),
    )


@pytest.mark.parametrize("nproc", [2, 3])
def test_launch_prefixes_output_and_exports_flags(tmp_path, nproc):
    if nproc == 2:  # as an Accelerate user types it, the worker run as a module (`python -m`)
        flags = ["--num_processes", "2", "--cpu", "--mixed_precision", "bf16"]
        flags += [
            "--gradient_accumulation_steps",
            "3",
            "--timeout",
            "60",
            "-m",
            "tests.workers.launch_worker",
        ]
        result = run_cli(
            "launch", *flags, "report", str(tmp_path), "--script-flag", env={"OMP_NUM_THREADS": "1"}
        )
        assert result.returncode == 0, describe(result)
    else:
        result = launch_ok(
            WORKER,
            nproc,
            "report",
            tmp_path,
            "--script-flag",
            launch_args=[
                "--mixed-precision",
                "bf16",
                "--gradient-accumulation-steps",
                "3",
                "--timeout",
                "60",
            ],
        )
    for rank in range(nproc):
        assert f"[rank{rank}]: stdout line from rank {rank}" in result.stdout.splitlines(), describe(result)
        assert f"[rank{rank}]: stderr line from rank {rank}" in result.stderr.splitlines(), describe(result)
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == str(nproc)
        assert seen["MASTER_ADDR"] == "127.0.0.1"  # one node: loopback rendezvous
        assert seen["sum"] == nproc * (nproc + 1) / 2
        assert seen["UNISON_CPU"] == "1" and seen["device"] == "cpu"
        assert seen["UNISON_MIXED_PRECISION"] == "bf16" and seen["mixed_precision"] == "bf16"
        assert seen["UNISON_GRADIENT_ACCUMULATION_STEPS"] == "3"
        assert seen["UNISON_TIMEOUT"] == "60" and seen["timeout_s"] == 60.0
        assert seen["argv"] == ["report", str(tmp_path), "--script-flag"]  # script args pass untouched
    assert "warn" not in result.stderr.lower(), result.stderr


@pytest.mark.serial
def test_crash_on_one_rank_ends_the_launch_quickly_naming_that_rank(tmp_path):
    """Rank 1 raises; rank 0 waits in a collective, rank 2 in none. The group timeout is 300 s: a launch
    that waited for it would take over five minutes. Every process ends within 10 s of the failure (about
    2 s on an idle 2-core machine); rank 1's traceback is printed once, the "connection closed" error of
    rank 0 (a consequence) not at all, and the summary names rank 1, never a rank the agent terminated.
    The failed rank exits the normal way: its atexit handlers run (tracker and log flushes)."""
    result = launch(WORKER, 3, "crash", tmp_path, launch_args=["--timeout", "300"], timeout=400)
    ended = time.time()
    assert result.returncode == 1, describe(result)
    failed_at = float(result.stdout.split("[rank1]: failing at ")[1].split()[0])
    assert ended - failed_at < 10, f"ended {ended - failed_at:.1f} s after the failure\n{describe(result)}"
    assert "[rank1]: [unison] rank 1 failed:" in result.stderr, describe(result)
    # once in its traceback, once in the summary
    assert result.stderr.count("RuntimeError: deliberate failure on rank 1") == 2, describe(result)
    assert "Traceback" not in result.stderr.replace("[rank1]: Traceback", ""), describe(result)
    assert "Connection closed" not in result.stderr, describe(result)
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("unison launch: rank 1 (local rank 1, pid "), describe(result)
    assert "failed first: RuntimeError: deliberate failure on rank 1." in summary
    assert "Ranks [0, 2] were stopped or failed after it." in summary, summary
    # torch's agent lines about whom it signalled (and its own guess at the first failure) are dropped
    assert "closing signal" not in result.stderr and "of binary" not in result.stderr, describe(result)
    assert "passed the all_reduce" not in result.stdout
    assert (tmp_path / "flushed-rank1").read_text() == "flushed", "rank 1's atexit handlers did not run"


def test_ctrl_c_stops_every_process_with_one_line(tmp_path):
    """A terminal's Ctrl-C sends SIGINT to the launcher's whole process group: one line, exit 130, and
    no worker left (torch's agent starts each worker in a session of its own)."""
    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", "2", "--cpu", WORKER, "sleep"]
    process = subprocess.Popen(
        [*command, str(tmp_path)],  # the path marks this run's processes in /proc
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready = [process.stdout.readline() for _ in range(2)]
    assert sorted(line.split(": ", 1)[1] for line in ready) == ["rank 0 ready\n", "rank 1 ready\n"], ready
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=budget(60))
    assert process.returncode == 130, (stdout, stderr)
    assert stderr.strip().splitlines() == [
        "unison launch: stopped by SIGINT; the workers were terminated."
    ], stderr
    survivors = [
        entry.name
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and str(tmp_path).encode() in _cmdline(entry)
    ]
    assert survivors == []


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""  # ended while we looked


def test_max_restarts_reforms_the_group():
    result = launch_ok(
        WORKER, 2, "restart", launch_args=["--max-restarts", "1", "--timeout", "60"], timeout=180
    )
    assert "deliberate failure on the first attempt" in result.stderr, describe(result)
    for rank in range(2):
        assert f"[rank{rank}]: attempt 1 rank {rank} sum 3" in result.stdout.splitlines(), describe(result)


def test_static_two_node_launch_on_one_host(tmp_path):
    """Two `unison launch --nnodes 2` agents (as on two machines) form one group; node rank sets RANK."""
    port = launcher.free_loopback_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "unison", "launch", "--nnodes", "2", "--node-rank", str(node)]
            + ["--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "1", "--cpu"]
            + [WORKER, "report", str(tmp_path)],
            cwd=REPO_ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (1, 0)  # the non-master node first: it must wait for node 0
    ]
    outputs = [node.communicate(timeout=budget(120))[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"]) == (str(rank), "0", "2")
        assert seen["sum"] == 3.0


@pytest.mark.serial
def test_missing_script_fails_before_starting_workers():
    start = time.monotonic()
    result = launch("tests/workers/no_such_script.py", 2)
    assert result.returncode == 2, describe(result)
    assert "tests/workers/no_such_script.py" in result.stderr and "does not exist" in result.stderr
    assert "[rank" not in result.stdout + result.stderr
    assert time.monotonic() - start < 15


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node 0 is below 1"),
        (["--nproc-per-node", "many"], "'many' is neither a number nor 'auto'"),
        (["--mixed-precision", "fp8"], "'fp8' is unknown"),
        (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps 0 is below 1"),
        (["--timeout", "0"], "--timeout 0 is not a positive number"),
        (["--max-restarts", "-1"], "--max-restarts -1 is negative"),
        (["--nnodes", "0"], "--nnodes '0' is not a node count"),
        (["--nnodes", "2"], "--nnodes 2 needs to know where node 0 is"),
        (["--nnodes", "2", "--master-addr", "10.0.0.1"], "--node-rank None is not in [0, 2)"),
        (
            ["--nnodes", "2", "--master-addr", "10.0.0.1", "--node-rank", "2"],
            "--node-rank 2 is not in [0, 2)",
        ),
        (["--nnodes", "1:2", "--master-addr", "10.0.0.1", "--node-rank", "0"], "needs the c10d rendezvous"),
        # rendezvous flags the chosen rendezvous would drop
        (
            ["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400", "--master-addr", "10.9.9.9"],
            "--master-addr 10.9.9.9 with --rdzv-endpoint 10.0.0.1:29400",
        ),
        (["--rdzv-endpoint", "10.0.0.1:29400", "--master-port", "1234"], "--master-port 1234 with"),
        (["--rdzv-conf", "is_host=1"], "--rdzv-conf is_host=1 without --rdzv-endpoint"),
        (["--rdzv-id", "job7"], "--rdzv-id job7 without --rdzv-endpoint"),
        (["--nnodes", "1", "--node-rank", "5"], "--node-rank 5 with --nnodes 1: one node is node 0"),
    ],
)
def test_bad_flags_are_rejected_up_front(flags, message):
    from unison.commands.launch import options_from_args
    from unison.commands.main import build_parser

    args = build_parser().parse_args(["launch", *flags, str(REPO_ROOT / WORKER)])
    options = options_from_args(args)
    with pytest.raises(LaunchError) as error:
        launcher.validate(options)
    assert message in str(error.value)


def test_bad_flag_through_the_cli_exits_2():
    result = run_cli("launch", "--nproc-per-node", "2", "--mixed-precision", "fp8", WORKER, "report")
    assert result.returncode == 2 and "'fp8' is unknown" in result.stderr, describe(result)


def test_more_processes_than_gpus(monkeypatch):
    """Needs --cpu when GPUs exist but fewer than the processes asked for (pretends a 1-GPU node)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(LaunchError, match="--nproc-per-node 2 is more than the 1 GPU"):
        launch_options.resolve_nproc_per_node(2, cpu=False)
    assert launch_options.resolve_nproc_per_node(2, cpu=True) == 2
    assert launch_options.resolve_nproc_per_node("auto", cpu=False) == 1
    assert launch_options.resolve_nproc_per_node("auto", cpu=True) == min(
        launch_options.usable_cpu_count(), launch_options.MAX_AUTO_CPU_PROCESSES
    )


C10D = {"rdzv_endpoint": "10.0.0.1:29400"}


@pytest.mark.parametrize(
    "options, expected",
    [
        (
            LaunchOptions("x.py", nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29555),
            {"rdzv_backend": "static", "rdzv_endpoint": "10.0.0.1:29555", "rdzv_configs": {"rank": 1}},
        ),
        (
            LaunchOptions("x.py", nnodes="2", node_rank=1, master_addr="10.0.0.1", timeout=7.5),
            {"rdzv_backend": "static", "rdzv_configs": {"rank": 1, "timeout": "8"}},  # whole seconds
        ),
        (  # --local-addr given: no route is looked up (this test needs no network)
            LaunchOptions("x.py", nnodes="1:4", local_addr="10.0.0.2", **C10D, rdzv_conf="is_host=1"),
            {"rdzv_backend": "c10d", "rdzv_endpoint": "10.0.0.1:29400", "min_nodes": 1, "max_nodes": 4},
        ),
        (  # the user's settings kept; --timeout bounds the join, and each try to reach the store
            LaunchOptions("x.py", nnodes="2", local_addr="10.0.0.2", **C10D, timeout=30, rdzv_conf="a=b"),
            {"rdzv_configs": {"a": "b", "join_timeout": "30", "read_timeout": "30"}},
        ),
        (
            LaunchOptions("x.py", nnodes="2", local_addr="10.0.0.2", **C10D, timeout=900),
            {"rdzv_configs": {"join_timeout": "900", "read_timeout": "60"}},  # torch's 60 s stays the most
        ),
        (  # one node: unison's rendezvous, which binds port 0 (the OS's pick) on loopback when it listens
            LaunchOptions("x.py", nproc_per_node=3),
            {"rdzv_backend": "unison-one-node", "rdzv_endpoint": "127.0.0.1:0", "nproc_per_node": 3},
        ),
        (
            LaunchOptions("x.py", master_addr="::1", master_port=29555),
            {"rdzv_backend": "unison-one-node", "rdzv_endpoint": "[::1]:29555"},
        ),
    ],
)
def test_torchrun_config(options, expected, tmp_path):
    """The flags become the torch.distributed.run configuration we mean (built by torch's own parser)."""
    argv = launcher.torchrun_argv(options, int(options.nproc_per_node or 1), str(tmp_path))
    config, command, command_args = torchrun.config_from_args(torchrun.get_args_parser().parse_args(argv))
    for name, value in expected.items():
        actual = getattr(config, name)
        if isinstance(value, dict):
            actual = {key: actual[key] for key in value}
        assert actual == value, name
    assert command == sys.executable and command_args == ["-u", "x.py"]
    assert config.local_addr == options.local_addr


def test_an_elastic_range_keeps_torchs_join_timeout(tmp_path):
    """--nnodes 1:2: after a node is lost, the others wait for its heartbeat to lapse and for the last
    call before going on without it (measured 44 s); a --timeout sized for collectives would end that."""
    options = LaunchOptions("x.py", nnodes="1:2", local_addr="10.0.0.2", **C10D, timeout=20)
    argv = launcher.torchrun_argv(options, 1, str(tmp_path))
    config, _, _ = torchrun.config_from_args(torchrun.get_args_parser().parse_args(argv))
    assert config.rdzv_configs["read_timeout"] == "20" and "join_timeout" not in config.rdzv_configs


def test_help_lists_commands_and_variables():
    top = run_cli("--help")
    assert top.returncode == 0 and "launch" in top.stdout and "env" in top.stdout, describe(top)
    from unison.commands.main import build_parser

    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    launch_help = subcommands.choices["launch"].format_help()
    for name in (
        "UNISON_MIXED_PRECISION",
        "UNISON_GRADIENT_ACCUMULATION_STEPS",
        "UNISON_CPU",
        "UNISON_TIMEOUT",
    ):
        assert name in launch_help
    assert "GLOO_SOCKET_IFNAME" in launch_help and "--local-addr" in launch_help


def test_env_report():
    env = {"UNISON_TIMEOUT": "77", "SLURM_JOB_ID": "1234"}
    report = json.loads(run_cli("env", "--json", env=env).stdout)
    assert report["torch"] == torch.__version__
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["backends"]["gloo"] is torch.distributed.is_gloo_available()
    assert report["cuda_available"] is torch.cuda.is_available()
    assert report["environment"]["UNISON_TIMEOUT"] == "77" and report["environment"]["SLURM_JOB_ID"] == "1234"
    # the console script (installed beside this Python, whether or not its venv is activated) as text
    console = Path(sys.executable).with_name("unison")
    assert console.is_file(), f"no unison console script beside {sys.executable}: pip install the package"
    text = subprocess.run(
        [str(console), "env"], env={**os.environ, **env}, capture_output=True, text=True, timeout=budget(60)
    )
    assert text.returncode == 0, describe(text)
    assert f"torch: {torch.__version__}" in text.stdout.splitlines()
    assert "  SLURM_JOB_ID: 1234" in text.stdout.splitlines()


@pytest.mark.serial
def test_notebook_launcher():
    """notebook_launcher from a plain script whose functions live in __main__ (forked, as in a notebook)."""
    result = subprocess.run(
        [sys.executable, "tests/workers/notebook_launch_worker.py"],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert result.returncode == 0, describe(result)
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    for rank in range(2):
        assert report["results"][str(rank)] == {
            "rank": rank,
            "world": 2,
            "sum": 30.0,  # (1 + 2) * 10
            "mixed_precision": "bf16",
            "distributed_type": "MULTI_CPU",
            "device": "cpu",
        }
        assert f"[rank{rank}]: worker {rank} of 2" in result.stdout.splitlines()
    c10d = [report["c10d"][str(rank)] for rank in range(2)]  # rdzv_backend="c10d", monitor_interval=0.01
    assert [(r["world"], r["sum"]) for r in c10d] == [(2, 3.0), (2, 3.0)]  # 1 + 2 over the c10d group
    assert report["failure"].startswith("notebook_launcher: rank 1 failed first:")
    assert "ValueError: notebook failure on rank 1" in report["failure"]
    assert report["failure_seconds"] < 20  # the barrier's timeout is 60 s
    # rank 0 raised while rank 1 slept: rank 0 is blamed, as torch's ChildFailedError (and RuntimeError)
    assert report["rank_0_failure"].startswith("notebook_launcher: rank 0 failed first:")
    assert "RuntimeError: I'm an even process. I don't like to sleep." in report["rank_0_failure"]
    assert {"ChildFailedError", "RuntimeError"} <= set(report["rank_0_failure_types"])
    assert report["rank_0_failure_seconds"] < 20  # rank 1 would sleep 100 s
    assert "already created in this process" in report["existing_state"]


def _options(*argv: str) -> LaunchOptions:
    from unison.commands.launch import options_from_args
    from unison.commands.main import build_parser

    return options_from_args(build_parser().parse_args(["launch", *argv]))


@pytest.mark.parametrize(
    "argv",
    [
        # Accelerate's spelling: --num_processes counts the processes of all machines together
        ["--num_processes", "4", "--num_machines", "2", "--machine_rank", "1"]
        + ["--main_process_ip", "10.0.0.1", "--main_process_port", "29555"],
        ["--num-processes", "4", "--num-machines", "2", "--machine-rank", "1"]
        + ["--main-process-ip", "10.0.0.1", "--main-process-port", "29555"],
        # torchrun's spelling
        ["--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1"]
        + ["--master_addr", "10.0.0.1", "--master_port", "29555"],
    ],
    ids=["accelerate", "accelerate-dashes", "torchrun"],
)
def test_accelerate_and_torchrun_flags_mean_what_they_mean_there(argv, tmp_path):
    options = _options(*argv, "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2", WORKER, "-x")
    nproc = launcher.validate(options)
    config, _, command_args = torchrun.config_from_args(
        torchrun.get_args_parser().parse_args(launcher.torchrun_argv(options, nproc, str(tmp_path)))
    )
    assert (config.nproc_per_node, config.min_nodes, config.max_nodes) == (2, 2, 2)
    assert config.rdzv_endpoint == "10.0.0.1:29555" and config.rdzv_configs["rank"] == 1
    assert (options.mixed_precision, options.gradient_accumulation_steps) == ("bf16", 2)
    assert command_args == ["-u", WORKER, "-x"]


def test_flags_after_the_script_belong_to_the_script():
    options = _options("--nproc-per-node", "2", WORKER, "--nproc-per-node", "7", "-m", "x")
    assert options.nproc_per_node == "2" and not options.module
    assert options.script_args == ("--nproc-per-node", "7", "-m", "x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [
                "--num_processes",
                "3",
                "--num_machines",
                "2",
                "--master-addr",
                "10.0.0.1",
                "--node-rank",
                "0",
                WORKER,
            ],
            "--num-processes 3 counts the processes of all 2 node(s) together",
        ),
        (
            ["--num_processes", "4", "--nproc-per-node", "3", WORKER],
            "means 4 per node, but --nproc-per-node says 3",
        ),
        (["-m", "no_such_package.train"], "no module named 'no_such_package' is importable"),
    ],
)
def test_alias_errors_name_the_fix(argv, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        launcher.validate(_options(*argv))


@pytest.mark.parametrize(
    "typo, suggestion",
    [("--nproc-per-nod", "--nproc-per-node"), ("--mixed-precison", "--mixed-precision"), ("--nprocs", None)],
)
def test_unknown_flags_are_refused_with_a_suggestion_never_abbreviated(typo, suggestion, capsys):
    from unison.commands.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["launch", typo, "2", WORKER])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: unison launch") and f"unrecognized arguments: {typo}" in error
    if suggestion:
        assert f"(did you mean {suggestion}?)" in error, error


def test_a_worker_whose_launcher_is_already_gone_ends_at_once():
    """The launcher killed while its workers still import: their parent is no longer the launcher pid that
    `unison launch` exported, so the first PartialState ends the worker instead of letting it wait for the
    dead launcher's store (here the exported pid is simply not the parent's)."""
    script = "from unison import PartialState; PartialState(); print('still running')"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "t", env_vars.LAUNCHER_PID: str(os.getpid() + 1_000_000)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    command = [sys.executable, "-c", script]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=budget(60))
    assert result.returncode == 1 and "still running" not in result.stdout, describe(result)
    assert f"the launcher (pid {os.getpid() + 1_000_000}) is gone; this worker ends." in result.stderr
    env[env_vars.LAUNCHER_PID] = str(os.getpid())  # the real parent: the worker goes on
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=budget(60))
    assert result.returncode == 0 and "still running" in result.stdout, describe(result)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; init reaps it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("kill_after", [0.5, 2.0, 6.0])
def test_a_launcher_killed_at_any_moment_leaves_no_worker_behind(tmp_path, kill_after):
    """SIGKILL the launcher while its workers are being started, importing, or forming the group."""
    command = [sys.executable, "-m", "unison", "launch", "--nproc-per-node", "2", "--cpu"]
    command += ["tests/workers/orphan_worker.py", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    launcher_process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, **quiet)
    time.sleep(kill_after)
    launcher_process.kill()
    launcher_process.wait()
    deadline = time.monotonic() + 30  # a worker still importing torch ends when it reaches PartialState
    workers = []
    while time.monotonic() < deadline:
        workers = [int(p.stem) for p in tmp_path.glob("*.pid")]
        if not any(_alive(pid) for pid in workers):
            break
        time.sleep(0.2)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their launcher killed after {kill_after} s"


# -- unison launch as one of several tasks of srun or mpirun (tests/test_real_launchers.py runs them) ------

SRUN_STEP = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}


@pytest.mark.parametrize(
    ("env", "nnodes", "refused"),
    [
        ({}, "1", False),  # no outer launcher
        (SRUN_STEP | {"SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1"}, "1", False),
        (SRUN_STEP | {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1"}, "1", True),
        (SRUN_STEP | {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}, "2", False),  # one per node
        (SRUN_STEP | {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}, "1", True),  # --nnodes short
        (SRUN_STEP | {"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2"}, "2", True),  # two per node
        # an sbatch script's batch step: SLURM_NTASKS=2 but no step id, so one task
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, "1", False),
        (
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            "1",
            True,
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}, "1", False),
    ],
)
def test_unison_launch_refuses_to_be_one_of_several_launchers_that_would_form_separate_runs(
    env, nnodes, refused
):
    if refused:
        with pytest.raises(LaunchError, match="would form a run of its own"):
            refuse_several_launchers(env, launch_options.parse_nnodes(nnodes)[1])
    else:
        refuse_several_launchers(env, launch_options.parse_nnodes(nnodes)[1])


def test_a_misspelled_layout_is_refused_in_one_line_before_torch_is_imported():
    """`--parallelism tp_sise=2` ends with status 2 and the one line that names the field, before the
    launcher imports torch (26-29 s on a busy machine) and without the 30 lines of usage."""
    probe = (
        "import sys\nfrom unison.commands.main import main\n"
        "try:\n    main(['launch', '--nproc-per-node', '2', '--parallelism', 'tp_sise=2', 'train.py'])\n"
        "except SystemExit as stop:\n    print(stop.code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=budget(60))
    assert result.stdout.split() == ["2", "False"], (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("unison launch: error: --parallelism: parallelism='tp_sise=2': 'tp_sise=2' is")
    assert len(lines) == 1 and "usage:" not in result.stderr
