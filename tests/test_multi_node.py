"""Two machines for real: two network namespaces joined by a veth pair, one `unison launch` in each.

Inside a namespace the host name resolves to a loopback address, as on hosts with Debian's default
/etc/hosts: left alone, gloo would bind it and tell the other node to connect to its own loopback
(`Gloo connectFullMesh failed ... remote=[127.0.0.1]`). Nothing here sets GLOO_SOCKET_IFNAME: unison
must find the interface that reaches the rendezvous address by itself. Every launch of this module
starts at once (their processes share the 2 cores) and the tests judge the results:
- a one-node, 2-process run on loopback (the reference, and where its sockets listen);
- the same training on two nodes with a static rendezvous (--master-addr) and with c10d
  (--rdzv-endpoint): parameters equal to the reference's;
- nodes whose peer never arrives: each ends with a rendezvous error naming the endpoint, within
  its --timeout.

The namespaces, their veth pair and the 10.213.0.0/24 addresses exist only for this module (names
carry the pid, so parallel runs never collide); nothing outside them and loopback is contacted. They
need root and `ip`; elsewhere the module is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from launching import REPO_ROOT
from namespaces import cannot_make_namespaces, ip
from slowness import budget

WORKER = "tests/workers/multi_node_worker.py"
NODE_A, NODE_B = "10.213.0.1", "10.213.0.2"
LONELY_TIMEOUT = 4  # --timeout of the nodes left alone: how long they may wait for their peer


@dataclass
class Run:
    """One `unison launch` process and what it left: exit code, output lines, seconds it took."""

    process: subprocess.Popen
    started: float
    out: Path
    returncode: int | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, line)
    seconds: float = 0.0

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def said_at(self, text: str) -> float:
        """Seconds from the start to the first line containing `text`."""
        return next(at for at, line in self.lines if text in line)

    def report(self) -> dict:
        """What this node's one worker saw (multi_node_worker.py's rank file)."""
        (path,) = self.out.glob("rank*.json")
        return json.loads(path.read_text())

    def params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out / "params.pt")


@pytest.fixture(scope="module")
def namespaces():
    """Two namespaces, A (10.213.0.1) and B (10.213.0.2), joined by a veth pair; removed afterwards."""
    reason = cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    pid = os.getpid()
    names = (f"unison-a-{pid}", f"unison-b-{pid}")
    links = (f"un{pid}a", f"un{pid}b")  # interface names: 15 characters at most
    try:
        steps = [
            ("netns", "add", names[0]),
            ("netns", "add", names[1]),
            ("link", "add", links[0], "type", "veth", "peer", "name", links[1]),
        ]
        for name, link, address in zip(names, links, (NODE_A, NODE_B)):
            steps += [
                ("link", "set", link, "netns", name),
                ("-n", name, "address", "add", f"{address}/24", "dev", link),
                ("-n", name, "link", "set", link, "up"),
                ("-n", name, "link", "set", "lo", "up"),
            ]
        for step in steps:
            result = ip(*step)
            if result.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` failed here: {result.stderr.strip()}")
        yield dict(zip(("a", "b"), names)) | {"links": links}
    finally:
        ip("link", "delete", links[0])  # only left where moving it into its namespace failed
        for name in names:
            ip("netns", "delete", name)  # takes the veth end inside it along


def _start(out: Path, launch_args: list[str], namespace: str | None = None, env: dict | None = None) -> Run:
    out.mkdir()
    command = [sys.executable, "-m", "unison", "launch", "--cpu", "--nproc-per-node", "1", *launch_args]
    command += [WORKER, str(out)]
    if namespace:
        command = ["ip", "netns", "exec", namespace, *command]
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Run(process, time.monotonic(), out)


def _finish(run: Run, timeout: float) -> Run:
    """Read the run's output as it comes, each line with its time; kill it if it overstays `timeout` s."""
    killer = threading.Timer(timeout, run.process.kill)
    killer.start()
    try:
        for line in run.process.stdout:
            run.lines.append((time.monotonic() - run.started, line))
        run.returncode = run.process.wait()
    finally:
        killer.cancel()
    run.seconds = time.monotonic() - run.started
    return run


@pytest.fixture(scope="module")
def runs(namespaces, tmp_path_factory):
    """Every launch of this module, started at once; each waited for, and ended if it overstays."""
    root = tmp_path_factory.mktemp("multi_node")
    ns_a, ns_b = namespaces["a"], namespaces["b"]
    static = ["--nnodes", "2", "--master-addr", NODE_A, "--timeout", "60"]  # port: 29500, the default
    c10d = ["--nnodes", "2", "--rdzv-endpoint", f"{NODE_A}:29400", "--timeout", "60"]
    lonely = ["--nnodes", "2", "--timeout", str(LONELY_TIMEOUT)]
    started = {
        "reference": _start(root / "reference", ["--nproc-per-node", "2"]),
        "static_a": _start(root / "static_a", [*static, "--node-rank", "0"], ns_a),
        "static_b": _start(root / "static_b", [*static, "--node-rank", "1"], ns_b),
        "c10d_a": _start(root / "c10d_a", c10d, ns_a),
        # a user's own NCCL_SOCKET_IFNAME stays (and this CPU run does not use it); gloo's is still chosen
        "c10d_b": _start(root / "c10d_b", c10d, ns_b, env={"NCCL_SOCKET_IFNAME": "chosen-by-user"}),
        # peers that never come: node 0 waits for node 1, node 1 for a node 0, c10d's host for a second node
        "lonely_static_0": _start(
            root / "lonely_static_0",
            [*lonely, "--master-addr", NODE_A, "--master-port", "29510", "--node-rank", "0"],
            ns_a,
        ),
        "lonely_static_1": _start(
            root / "lonely_static_1",
            [*lonely, "--master-addr", NODE_A, "--master-port", "29511", "--node-rank", "1"],
            ns_b,
        ),
        "lonely_c10d": _start(root / "lonely_c10d", [*lonely, "--rdzv-endpoint", f"{NODE_A}:29410"], ns_a),
    }
    try:
        with ThreadPoolExecutor(len(started)) as pool:  # one waiter each: each run's own duration
            return dict(
                zip(started, pool.map(lambda run: _finish(run, timeout=budget(120)), started.values()))
            )
    finally:
        for run in started.values():
            if run.process.poll() is None:
                run.process.kill()
                run.process.wait()


def _describe(run: Run) -> str:
    return f"exit code {run.returncode} after {run.seconds:.1f} s\n{run.output}"


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes_train_as_one_node_with_two_processes(runs, rendezvous):
    reference = runs["reference"]
    assert reference.returncode == 0, _describe(reference)
    nodes = [runs[f"{rendezvous}_a"], runs[f"{rendezvous}_b"]]
    for node in nodes:
        assert node.returncode == 0, _describe(node)
    trained = next(node for node in nodes if (node.out / "params.pt").exists())  # rank 0's node
    expected = reference.params()
    for name, value in trained.params().items():
        assert torch.equal(value, expected[name]), (name, (value - expected[name]).abs().max())
    seen = {address: node.report() for address, node in zip((NODE_A, NODE_B), nodes)}
    assert sorted((report["RANK"], report["WORLD_SIZE"]) for report in seen.values()) == [
        ("0", "2"),
        ("1", "2"),
    ]
    for address, report in seen.items():
        assert report["MASTER_ADDR"] == NODE_A, report  # the address node B reaches node A by
        assert report["gloo_listens"], report
        assert {s.rsplit(":", 1)[0] for s in report["gloo_listens"]} == {address}, report  # the veth's only


def test_the_interface_is_chosen_from_the_rendezvous_address_and_said(runs, namespaces):
    link_a, link_b = namespaces["links"]
    own = f"(the rendezvous address {NODE_A} is this node's)"
    route = f"(this node's address on the route to the rendezvous host {NODE_A})"
    said = {
        "static_a": f"interface {link_a}, which holds {NODE_A} {own}: "
        f"GLOO_SOCKET_IFNAME={link_a} NCCL_SOCKET_IFNAME={link_a}.",
        "static_b": f"interface {link_b}, which holds {NODE_B} {route}: "
        f"GLOO_SOCKET_IFNAME={link_b} NCCL_SOCKET_IFNAME={link_b}.",
        "c10d_b": f"interface {link_b}, which holds {NODE_B} {route}: GLOO_SOCKET_IFNAME={link_b}, "
        "keeping NCCL_SOCKET_IFNAME=chosen-by-user from the environment.",
    }
    for name, line in said.items():
        assert line in runs[name].output, _describe(runs[name])
    for name, link in (("static_a", link_a), ("static_b", link_b), ("c10d_a", link_a)):
        seen = runs[name].report()
        assert (seen["GLOO_SOCKET_IFNAME"], seen["NCCL_SOCKET_IFNAME"]) == (link, link), seen
    seen = runs["c10d_b"].report()
    assert (seen["GLOO_SOCKET_IFNAME"], seen["NCCL_SOCKET_IFNAME"]) == (link_b, "chosen-by-user"), seen


def test_one_node_listens_on_loopback_only(runs):
    """The one-node store (unison's rendezvous) and gloo's sockets accept no connection from outside."""
    for path in sorted(runs["reference"].out.glob("rank*.json")):
        seen = json.loads(path.read_text())
        assert seen["GLOO_SOCKET_IFNAME"] == "lo" and seen["MASTER_ADDR"] == "127.0.0.1", seen
        assert seen["store_listens"] == [f"127.0.0.1:{seen['MASTER_PORT']}"], seen
        assert seen["gloo_listens"] and all(s.startswith("127.0.0.1:") for s in seen["gloo_listens"]), seen
    assert "network interface" not in runs["reference"].output  # loopback is no news: said at debug level


@pytest.mark.parametrize(
    "name, torch_says",
    [
        ("lonely_static_0", "waiting for clients. 1/2 clients joined."),
        ("lonely_static_1", f"while trying to connect to ({NODE_A}, 29511)."),
        ("lonely_c10d", "RendezvousTimeoutError: not every node joined within the join timeout."),
    ],
)
def test_a_node_that_never_arrives_ends_the_other_with_a_rendezvous_error(runs, name, torch_says):
    run = runs[name]
    assert run.returncode == 1, _describe(run)
    endpoint = {"lonely_static_0": f"{NODE_A}:29510", "lonely_static_1": f"{NODE_A}:29511"}.get(
        name, f"{NODE_A}:29410"
    )
    node = {"lonely_static_0": "node 0", "lonely_static_1": "node 1"}.get(name, "this node")
    last = run.output.strip().splitlines()[-1]
    assert last.startswith(f"unison launch: {node} could not join the rendezvous at {endpoint}: "), _describe(
        run
    )
    assert f"within --timeout {LONELY_TIMEOUT} s of each other" in last, last
    assert torch_says in last, last
    assert "Traceback" not in run.output, _describe(run)
    # from the launcher's last line before the rendezvous (its imports done: they take long on 2 shared cores)
    waited = run.seconds - run.said_at("network interface")
    assert waited < LONELY_TIMEOUT + 20, f"{waited:.1f} s at the rendezvous\n{_describe(run)}"


def test_an_address_this_node_cannot_reach_is_named(namespaces):
    """Inside node A (only its veth's network and lo): no route, and no name server to ask. The check is
    unison.network loaded alone (stdlib only), so it costs no torch import."""
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('network', sys.argv[1])\n"
        "network = sys.modules['network'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(network)\n"
        "for host in sys.argv[2:]:\n"
        "    try:\n"
        "        network.choose_interface(host)\n"
        "    except network.NetworkError as error:\n"
        "        print(error)\n"
    )
    path = REPO_ROOT / "src" / "unison" / "network.py"
    command = ["ip", "netns", "exec", namespaces["a"], sys.executable, "-c", script, str(path)]
    result = subprocess.run(
        [*command, "192.168.77.1", "node-z"], capture_output=True, text=True, timeout=budget(60)
    )
    assert result.returncode == 0, result.stderr
    no_route, no_name = result.stdout.splitlines()
    assert no_route.startswith("the rendezvous host 192.168.77.1: this node has no route to that address"), (
        no_route
    )
    assert no_name.startswith("the rendezvous host 'node-z' does not resolve on this node ("), no_name
    assert no_name.endswith("pass the IP address of that node, or add its name to DNS or /etc/hosts here.")
