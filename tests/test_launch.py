"""`unison launch` and `unison env`: real launches through the CLI, and the flag checks before them."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from launching import REPO_ROOT, describe, launch, launch_ok
from torch.distributed import run as torchrun

from unison import launcher
from unison.launcher import LaunchError, LaunchOptions

WORKER = "tests/workers/launch_worker.py"


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unison", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("nproc", [2, 3])
def test_launch_prefixes_output_and_exports_flags(tmp_path, nproc):
    result = launch_ok(
        WORKER,
        nproc,
        "report",
        tmp_path,
        "--script-flag",
        launch_args=["--mixed-precision", "bf16", "--gradient-accumulation-steps", "3", "--timeout", "60"],
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


def test_crash_on_one_rank_ends_the_launch_quickly():
    # The group timeout is 300 s: a launch that waited for it would take over five minutes. It ends in
    # ~5 s on an idle 2-core machine; the bound leaves room for a loaded one.
    start = time.monotonic()
    result = launch(WORKER, 3, "crash", launch_args=["--timeout", "300"], timeout=400)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, describe(result)
    assert elapsed < 60, f"the launch took {elapsed:.1f} s\n{describe(result)}"
    assert "[rank1]: [unison] rank 1 failed:" in result.stderr, describe(result)
    assert "[rank1]: RuntimeError: deliberate failure on rank 1" in result.stderr, describe(result)
    assert "rank 1 (local rank 1" in result.stderr and "failed first" in result.stderr, describe(result)
    assert "passed the barrier" not in result.stdout


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
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"]) == (str(rank), "0", "2")
        assert seen["sum"] == 3.0


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
    ],
)
def test_bad_flags_are_rejected_up_front(flags, message):
    from unison.commands.main import build_parser

    args = build_parser().parse_args(["launch", *flags, WORKER])
    options = LaunchOptions(
        script=str(REPO_ROOT / WORKER),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        max_restarts=args.max_restarts,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        timeout=args.timeout,
    )
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
        launcher.resolve_nproc_per_node(2, cpu=False)
    assert launcher.resolve_nproc_per_node(2, cpu=True) == 2
    assert launcher.resolve_nproc_per_node("auto", cpu=False) == 1
    assert launcher.resolve_nproc_per_node("auto", cpu=True) == min(
        launcher.usable_cpu_count(), launcher.MAX_AUTO_CPU_PROCESSES
    )


@pytest.mark.parametrize(
    "options, expected",
    [
        (
            LaunchOptions("x.py", nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29555),
            {"rdzv_backend": "static", "rdzv_endpoint": "10.0.0.1:29555", "rdzv_configs": {"rank": 1}},
        ),
        (
            LaunchOptions("x.py", nnodes="1:4", rdzv_endpoint="10.0.0.1:29400", rdzv_conf="is_host=1"),
            {"rdzv_backend": "c10d", "rdzv_endpoint": "10.0.0.1:29400", "min_nodes": 1, "max_nodes": 4},
        ),
        (LaunchOptions("x.py", nproc_per_node=3), {"rdzv_backend": "static", "nproc_per_node": 3}),
    ],
)
def test_torchrun_config(options, expected, tmp_path):
    """The flags become the torch.distributed.run configuration we mean (built by torch's own parser)."""
    argv = launcher.torchrun_argv(options, int(options.nproc_per_node), str(tmp_path))
    config, command, command_args = torchrun.config_from_args(torchrun.get_args_parser().parse_args(argv))
    for name, value in expected.items():
        actual = getattr(config, name)
        if isinstance(value, dict):
            actual = {key: actual[key] for key in value}
        assert actual == value, name
    assert command == sys.executable and command_args == ["-u", "x.py"]
    if options.nnodes == "1":
        host, port = config.rdzv_endpoint.split(":")
        assert host == "127.0.0.1" and 0 < int(port) < 65536


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
    # the console script gives the same report as text
    console = shutil.which("unison")
    if console is None:
        pytest.skip("the unison console script is not installed")
    text = subprocess.run(
        [console, "env"], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert text.returncode == 0, describe(text)
    assert f"torch: {torch.__version__}" in text.stdout.splitlines()
    assert "  SLURM_JOB_ID: 1234" in text.stdout.splitlines()


def test_notebook_launcher():
    """notebook_launcher from a plain script whose functions live in __main__ (forked, as in a notebook)."""
    result = subprocess.run(
        [sys.executable, "tests/workers/notebook_launch_worker.py"],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
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
    assert report["failure"].startswith("notebook_launcher: rank 1 failed first:")
    assert "ValueError: notebook failure on rank 1" in report["failure"]
    assert report["failure_seconds"] < 20  # the barrier's timeout is 60 s
    assert "already created in this process" in report["existing_state"]
