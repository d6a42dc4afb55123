"""`unison launch`: start N copies of a script per node through torch's own elastic launcher.

torch.distributed.run already does the hard parts (rendezvous, worker restarts, signal forwarding,
tee-ing each worker's output, failure reports), so this module does not spawn anything itself. It
checks the flags before any process starts (unison.launching.options), turns them into torch.distributed.run's
argument namespace, exports the UNISON_* variables of `env_vars` (how the flags reach `Accelerator()` as
defaults) and runs torch's launcher in-process.

What it adds to a bare torchrun:
- one node: the rendezvous store listens on 127.0.0.1 only, on a port the OS picks as it binds
  (`rendezvous.OneNodeRendezvous`), so two launches on one machine never collide, and the workers'
  gloo/NCCL sockets bind loopback too;
- several nodes: the workers' sockets use the interface that reaches the rendezvous address
  (`network`), and a node whose peers never arrive ends with one line naming the endpoint; a c10d
  node cut off from the rendezvous host ends too, where torch's agent would wait for good (`contact`);
- every line a worker prints is prefixed with its global rank ("[rank1]: ...");
- a failed run returns a non-zero exit code with one short summary instead of torch's report
  (`launch_report.py`), the failing rank's own traceback having been printed (prefixed) by the worker;
- restarts (--max-restarts) re-form the process group: `state.py` namespaces the group's keys by
  attempt on the static rendezvous store, and for c10d rendezvous we export
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so each attempt gets a fresh store (pytorch#135712).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from .. import env_vars, network
from ..env_vars import validate_mixed_precision
from ..parallel.config import ParallelismConfig, is_auto
from . import contact, rendezvous
from .options import LaunchError, LaunchOptions, compile_variables, parse_nnodes, usable_cpu_count, validate
from .report import quiet_agent_shutdown, report_failure, stopped_line

logger = logging.getLogger("unison")

__all__ = ["LaunchError", "LaunchOptions", "launch", "validate", "worker_environment"]
"""What callers use: the options and their check live in unison.launching.options, re-exported here."""

RANK_PREFIX_TEMPLATE = "[rank${rank}]: "
"""torch.distributed.run's log_line_prefix_template: each worker line starts with its global rank."""

SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""torch's seconds between the agent's SIGINT/SIGTERM to the workers and its SIGKILL (30 unless set)."""

DEFAULT_MASTER_PORT = 29500
DEFAULT_C10D_PORT = 29400  # torchrun's, for an --rdzv-endpoint without a port
C10D_READ_TIMEOUT_SECONDS = 60
"""torch's default c10d read_timeout: how long a node tries to reach the rendezvous store (twice)."""


def free_loopback_port() -> int:
    """A TCP port nobody listens on at 127.0.0.1 right now (the OS picks it).

    For callers that must name a port before anything binds it (notebook_launcher's static
    rendezvous); `unison launch` on one node binds port 0 itself instead (rendezvous.OneNodeRendezvous).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rendezvous_endpoint(options: LaunchOptions) -> tuple[str, int]:
    """(host, port) where the nodes meet: --rdzv-endpoint, else --master-addr/--master-port.

    One node without them: 127.0.0.1, port 0 (the OS picks it when the store binds).
    """
    if options.rdzv_endpoint:
        try:
            return parse_rendezvous_endpoint(options.rdzv_endpoint, DEFAULT_C10D_PORT)
        except ValueError as error:
            raise LaunchError(f"--rdzv-endpoint {options.rdzv_endpoint!r}: {error} Pass HOST:PORT.") from None
    _, max_nodes = parse_nnodes(options.nnodes)
    default_port = 0 if max_nodes == 1 else DEFAULT_MASTER_PORT
    return options.master_addr or rendezvous.LOOPBACK_ADDRESS, options.master_port or default_port


def worker_environment(
    nproc_per_node: int,
    *,
    cpu: bool = False,
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int | None = None,
    timeout: float | None = None,
    parallelism: str | None = None,
    activation_checkpointing: str | None = None,
    plugin: str | None = None,
    rendezvous_host: str | None = None,
    local_addr: str | None = None,
) -> dict[str, str]:
    """Variables exported to the workers (and torch's elastic agent) for one launch.

    Only settings that were given are exported, so variables the user exported by hand still reach
    the workers when the flag is absent. With `rendezvous_host`, gloo's and NCCL's network interface
    too (see `socket_interfaces`). Always the agent's wait before it SIGKILLs stopped workers
    (`stop_wait_seconds`), unless the user set it.
    """
    env = {}
    if cpu:
        env[env_vars.CPU] = "1"
    if mixed_precision is not None:
        env[env_vars.MIXED_PRECISION] = validate_mixed_precision(mixed_precision)
    if gradient_accumulation_steps is not None:
        env[env_vars.GRADIENT_ACCUMULATION_STEPS] = str(gradient_accumulation_steps)
    if timeout is not None:
        env[env_vars.TIMEOUT] = f"{timeout:g}"
    if parallelism is not None:
        if not is_auto(parallelism):
            ParallelismConfig.from_string(parallelism)  # a wrong string fails here, not in N workers
        env[env_vars.PARALLELISM] = parallelism.strip()
    if activation_checkpointing is not None:
        env[env_vars.ACTIVATION_CHECKPOINTING] = activation_checkpointing.strip()
    if plugin is not None:
        env[env_vars.PLUGIN] = plugin
    if rendezvous_host is not None:
        env.update(socket_interfaces(rendezvous_host, local_addr))
    if "OMP_NUM_THREADS" not in os.environ:
        # torch would set 1 with a warning; a share of the cores is a better default for CPU work.
        env["OMP_NUM_THREADS"] = str(max(usable_cpu_count() // nproc_per_node, 1))
    env[env_vars.LAUNCHER_PID] = str(os.getpid())  # the agent runs here: the workers' parent
    if SHUTDOWN_TIMEOUT not in os.environ:
        env[SHUTDOWN_TIMEOUT] = str(stop_wait_seconds())
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # c10d only: fresh store per restart attempt
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX_TEMPLATE
    return env


def stop_wait_seconds() -> int:
    """How long the elastic agent lets stopped workers end before it SIGKILLs them: the grace in which they
    finish a checkpoint in flight (UNISON_CHECKPOINT_GRACE, checkpoint/stop_signals.py) and a margin to
    end after it. Exported as TORCH_ELASTIC_SHUTDOWN_TIMEOUT unless the user set that."""
    try:
        grace = env_vars.checkpoint_grace_seconds()
    except ValueError as error:
        raise LaunchError(str(error)) from None
    return math.ceil(grace) + env_vars.STOP_MARGIN_SECONDS


def socket_interfaces(rendezvous_host: str, local_addr: str | None = None) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for the interface that reaches the rendezvous host.

    Left to gloo and NCCL, they bind the address the host name resolves to (gloo) or the first
    non-loopback interface (NCCL): across nodes that is often 127.0.1.1 or the wrong network (see
    `unison.network`). One node (127.0.0.1) gets `lo`: the workers' sockets then listen on loopback
    only, not on the machine's network, and do not depend on the host name resolving. A variable the
    user exported wins. One line says what was chosen and why (at debug level on loopback, where it
    is the expected choice, else as info).
    """
    try:
        choice = network.choose_interface(rendezvous_host, local_addr)
    except network.NetworkError as error:
        raise LaunchError(str(error)) from None
    env = network.socket_interface_environment(choice, os.environ)
    kept = [f"{name}={os.environ[name]}" for name in network.SOCKET_INTERFACE_VARIABLES if name in os.environ]
    if choice.name is None:
        line = (
            f"unison launch: no network interface of this node holds {choice.address} ({choice.reason}); "
            "gloo and NCCL choose their own. If the nodes cannot connect, export GLOO_SOCKET_IFNAME "
            "(NCCL_SOCKET_IFNAME for GPUs) on every node."
        )
    elif env:
        line = (
            f"unison launch: the workers' gloo/NCCL sockets use network interface {choice.name}, which holds "
            f"{choice.address} ({choice.reason}): {' '.join(f'{k}={v}' for k, v in sorted(env.items()))}"
            + (f", keeping {', '.join(kept)} from the environment" if kept else "")
            + ". Export the variable to choose another interface."
        )
    else:
        line = f"unison launch: network interfaces from the environment: {', '.join(kept)}."
    level = logging.DEBUG if network.is_loopback(choice.address) else logging.INFO
    logger.log(level, "%s", line)
    return env


def torchrun_argv(options: LaunchOptions, nproc_per_node: int, log_dir: str) -> list[str]:
    """The torch.distributed.run command line equivalent to `options`.

    Beyond a plain translation of the flags:
    - one node: unison's own rendezvous (rendezvous.OneNodeRendezvous), which binds its port when it
      listens instead of being given one found free earlier;
    - --timeout also bounds how long a node waits for the others to arrive (static: the store's
      timeout; c10d: join_timeout for a fixed --nnodes, and read_timeout up to torch's 60 s default),
      unless --rdzv-conf sets it: a node that never comes ends the others with a rendezvous error;
    - c10d: the node that holds the endpoint's address hosts the rendezvous (is_host=1), and
      --local-addr defaults to this node's address towards the endpoint; torch's guesses from the
      host name fail where it resolves to a loopback address (Debian's default /etc/hosts).
    """
    _, max_nodes = parse_nnodes(options.nnodes)
    host, port = rendezvous_endpoint(options)
    timeout = None if options.timeout is None else math.ceil(options.timeout)
    local_addr = options.local_addr
    argv = [
        f"--nnodes={options.nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={options.max_restarts}",
        "--tee=3",  # workers' stdout/stderr go through torch's tailer, which adds the rank prefix
        f"--log-dir={log_dir}",
    ]
    if options.module:
        argv.append("--module")
    if options.rdzv_endpoint:
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={options.rdzv_endpoint}",
            f"--rdzv-id={options.rdzv_id}",
        ]
        conf = c10d_conf(options)
        if conf:
            argv.append(f"--rdzv-conf={conf}")
        if local_addr is None:
            local_addr = _network(network.address_towards, host, "--rdzv-endpoint")
    elif max_nodes == 1:
        argv += [
            f"--rdzv-backend={rendezvous.ONE_NODE_BACKEND}",
            f"--rdzv-endpoint={join_endpoint(host, port)}",
        ]
    else:
        argv += [f"--master-addr={host}", f"--master-port={port}", f"--node-rank={options.node_rank}"]
        if timeout is not None:
            argv.append(f"--rdzv-conf=timeout={timeout}")
    if local_addr:
        argv.append(f"--local-addr={local_addr}")
    return [*argv, options.script, *options.script_args]


def c10d_conf(options: LaunchOptions) -> str:
    """--rdzv-conf for c10d: the user's settings, plus the timeouts and is_host it leaves unset.

    An elastic range (--nnodes 1:2) keeps torch's join_timeout (600 s): after a node is lost, the
    others wait for its heartbeat to lapse and then for the last call (30 s) before they go on
    without it, longer than a --timeout sized for collectives (measured: 20 s ended the restart).
    """
    given = options.rdzv_conf
    host, _ = rendezvous_endpoint(options)
    min_nodes, max_nodes = parse_nnodes(options.nnodes)
    timeout = None if options.timeout is None else math.ceil(options.timeout)
    keys = {item.split("=", 1)[0].strip() for item in given.split(",") if item.strip()}
    added = {}
    if timeout is not None:
        if min_nodes == max_nodes:
            added["join_timeout"] = timeout
        added["read_timeout"] = min(timeout, C10D_READ_TIMEOUT_SECONDS)
    address = _network(network.resolve, host, "--rdzv-endpoint")
    if not network.is_loopback(address) and network.interface_holding(address) is not None:
        # torch guesses from the host name's addresses, which miss this one where the name resolves to
        # loopback. A loopback endpoint stays torch's guess: it recognises it, and a second agent on the
        # machine that finds the port taken joins as a client instead.
        added["is_host"] = 1
    return ",".join([*([given] if given else []), *(f"{k}={v}" for k, v in added.items() if k not in keys)])


def join_endpoint(host: str, port: int) -> str:
    """HOST:PORT as torch parses an endpoint ([::1]:PORT for an IPv6 address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _network(function: Callable[[str, str], str], host: str, flag: str) -> str:
    """network.resolve / network.address_towards with a NetworkError as the LaunchError it is."""
    try:
        return function(host, flag)
    except network.NetworkError as error:
        raise LaunchError(str(error)) from None


@contextlib.contextmanager
def exported(env: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the launch, then restore the previous values."""
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch(options: LaunchOptions, sources: str | None = None) -> int:
    """Run the launch described by `options`; return the exit code (0 when every worker succeeded).
    `sources`: each setting's value and origin (launch_config), passed on for `unison env`."""
    nproc_per_node = validate(options)
    with tempfile.TemporaryDirectory(prefix="unison-launch-") as log_dir:
        argv = torchrun_argv(options, nproc_per_node, log_dir)
        env = worker_environment(
            nproc_per_node,
            cpu=options.cpu,
            mixed_precision=options.mixed_precision,
            gradient_accumulation_steps=options.gradient_accumulation_steps,
            timeout=options.timeout,
            parallelism=options.parallelism,
            activation_checkpointing=options.activation_checkpointing,
            plugin=options.plugin,
            rendezvous_host=rendezvous_endpoint(options)[0],
            local_addr=options.local_addr,
        )
        if options.debug:
            env[env_vars.DEBUG] = "1"
        if options.peak_flops is not None:
            env[env_vars.PEAK_FLOPS] = repr(float(options.peak_flops))
        if options.numerics is not None:
            env[env_vars.NUMERICS] = options.numerics
        env.update(compile_variables(options))
        if sources is not None:
            env[env_vars.CONFIG_SOURCES] = sources
        notes = os.path.join(log_dir, "interrupted_save")  # what a stop did to a save in flight, per rank
        os.mkdir(notes)
        env[env_vars.INTERRUPTED_SAVE_NOTES] = notes
        with exported(env), quiet_agent_shutdown(), _contact_watch(options):
            logger.debug("torch.distributed.run %s", " ".join(argv))
            try:
                torchrun.run(torchrun.get_args_parser().parse_args(argv))
            except ChildFailedError as error:
                return report_failure(error)
            except rendezvous.FAILURES as error:
                return _report_rendezvous_failure(error, options)
            except SignalException as error:
                logger.error("%s", stopped_line(error.sigval.name, notes))
                return 128 + int(error.sigval)
    return 0


def _contact_watch(options: LaunchOptions) -> contextlib.AbstractContextManager:
    """A c10d node that does not host the rendezvous ends once it has lost it (`contact`)."""
    if not options.rdzv_endpoint:
        return contextlib.nullcontext()  # one node, or static: no keep-alive thread to block
    conf = c10d_conf(options)
    host, port = rendezvous_endpoint(options)
    if contact.hosts_the_rendezvous(conf) or network.is_loopback(
        _network(network.resolve, host, "--rdzv-endpoint")
    ):
        return contextlib.nullcontext()
    return contact.watching(host, port, conf)


def _report_rendezvous_failure(error: BaseException, options: LaunchOptions) -> int:
    """The nodes could not meet: say where, why in torch's words, and what to check (exit code 1)."""
    host, port = rendezvous_endpoint(options)
    static_rank = options.node_rank if not options.rdzv_endpoint else None
    node = "this node" if static_rank is None else f"node {static_rank}"
    logger.error(
        "%s", rendezvous.failure_message(error, join_endpoint(host, port), node, _rendezvous_wait(options))
    )
    return 1


def _rendezvous_wait(options: LaunchOptions) -> str:
    """How long the nodes wait for each other at the rendezvous, as torchrun_argv set it up."""
    min_nodes, max_nodes = parse_nnodes(options.nnodes)
    given = dict(item.strip().split("=", 1) for item in options.rdzv_conf.split(",") if "=" in item)
    if options.rdzv_endpoint and "join_timeout" in given:
        return f"--rdzv-conf join_timeout={given['join_timeout']} s"
    if options.timeout is not None and not (options.rdzv_endpoint and min_nodes < max_nodes):
        return f"--timeout {math.ceil(options.timeout)} s"
    return "torch's default of 600 s"
