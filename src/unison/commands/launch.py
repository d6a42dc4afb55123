"""`unison launch`: parse the flags, then hand them to `unison.launching.launcher` (which does the work)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .. import env_vars
from ..env_vars import DEFAULT_FIRST_STEP_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS, check_peak_flops
from ..launching.cpu_processes import MAX_AUTO_CPU_PROCESSES
from ..launching.errors import ConfigError, LaunchError
from ..launching.plugin_flags import add_plugin_flags
from ..numerics import check_numerics
from ..parallel.config import ParallelismConfig, is_auto
from .launch_config_flags import add_config_flag, apply_config_file, file_note

if TYPE_CHECKING:
    from ..launching.options import LaunchOptions

DESCRIPTION = """\
Start NPROC copies of SCRIPT on this node through torch's elastic launcher (torch.distributed.run),
formed into one process group by unison.PartialState / Accelerator. Every line a worker prints is
prefixed with its rank ("[rank1]: ..."). The exit code is non-zero when any worker fails, and the
failing rank's traceback is shown.
"""

_VARIABLES = [
    (f"{env_vars.CPU}=1", "--cpu"),
    (f"{env_vars.MIXED_PRECISION}=no|bf16|fp16", "--mixed-precision"),
    (f"{env_vars.GRADIENT_ACCUMULATION_STEPS}=K", "--gradient-accumulation-steps"),
    (f"{env_vars.TIMEOUT}=SECONDS", "--timeout"),
    (f"{env_vars.DEBUG}=1", "--debug"),
    (f"{env_vars.PARALLELISM}=LAYOUT", "--parallelism"),
    (f"{env_vars.ACTIVATION_CHECKPOINTING}=MODE", "--activation-checkpointing"),
    (f"{env_vars.DYNAMO_BACKEND}=BACKEND", "--dynamo-backend"),
    (f"{env_vars.DYNAMO_MODE}=MODE", "--dynamo-mode"),
    (f"{env_vars.PLUGIN}=JSON", "--use_fsdp / --use_deepspeed and their flags"),
    (f"{env_vars.NUMERICS}=unison|accelerate", "--numerics"),
    (f"{env_vars.PEAK_FLOPS}=FLOPS", "--peak-flops (read by unison.throughput.peak_flops)"),
    ("OMP_NUM_THREADS", "usable cores / NPROC, unless already set"),
    (
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        f"{env_vars.CHECKPOINT_GRACE} (default {env_vars.DEFAULT_CHECKPOINT_GRACE_SECONDS:g}) "
        f"+ {env_vars.STOP_MARGIN_SECONDS} s, unless already set",
    ),
]

EPILOG = (
    "environment variables exported to the workers (Accelerator() defaults; arguments in code win):\n"
    + "".join(f"  {name:<42}{source}\n" for name, source in _VARIABLES)
    + """\
  The workers also get torch's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

one node:
  unison launch --nproc-per-node 2 train.py --lr 1e-3
  (the rendezvous listens on 127.0.0.1, on a port the OS picks as it binds; no address or port needed)

several nodes, static rendezvous (run on every node, node ranks 0..N-1):
  unison launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
      --nproc-per-node 8 train.py
several nodes, c10d rendezvous (ranks follow the order nodes join; --node-rank is ignored,
  --master-addr and --master-port are refused; the node holding the endpoint's address hosts it):
  unison launch --nnodes 2 --rdzv-endpoint 10.0.0.1:29400 --nproc-per-node 8 train.py
  The workers' gloo/NCCL sockets use the network interface through which this node reaches the
  rendezvous address (one line says which); export GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose
  another. --timeout also bounds how long a node waits for the others to arrive. See docs/multi-node.md.
"""
)


ALIASES_EPILOG = """
aliases (the same flags as Accelerate users and torchrun users type them; dashes or underscores):
  --num-processes N       Accelerate: N processes in all, split evenly over --num-machines
  --num-machines M        = --nnodes M          --machine-rank R      = --node-rank R
  --main-process-ip HOST  = --master-addr HOST  --main-process-port P = --master-port P
  -m, --module            run SCRIPT as a module, as `python -m SCRIPT` (torchrun's -m)
"""


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "launch",
        help="run a script in N processes (one node or several)",
        description=DESCRIPTION,
        epilog=EPILOG + ALIASES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_argument_group("processes")
    group.add_argument(
        *_spellings("nproc-per-node"),
        default=None,
        metavar="N|auto",
        help="processes on this node (default 1). 'auto': one per GPU; without GPUs or with --cpu, one per "
        f"usable CPU core, at most {MAX_AUTO_CPU_PROCESSES}.",
    )
    group.add_argument(
        *_spellings("num-processes"),
        type=int,
        default=None,
        metavar="N",
        help="processes in all, over every node (Accelerate's flag): N / nodes per node",
    )
    group.add_argument(
        *_spellings("nnodes", "num-machines"),
        dest="nnodes",
        default=None,
        help="number of nodes, or MIN:MAX with --rdzv-endpoint (default 1)",
    )
    group.add_argument(
        *_spellings("node-rank", "machine-rank"),
        dest="node_rank",
        type=int,
        default=None,
        help="this node's rank (static rendezvous)",
    )
    group.add_argument(
        *_spellings("master-addr", "main-process-ip"),
        dest="master_addr",
        default=None,
        help="address of node 0 (static rendezvous)",
    )
    group.add_argument(
        *_spellings("master-port", "main-process-port"),
        dest="master_port",
        type=int,
        default=None,
        help="port on node 0 (default: free port / 29500)",
    )
    group.add_argument(*_spellings("rdzv-endpoint"), default=None, help="HOST:PORT of a c10d rendezvous")
    group.add_argument(*_spellings("rdzv-id"), default=None, help="job id shared by the nodes (c10d)")
    group.add_argument(*_spellings("rdzv-conf"), default=None, help="extra c10d settings, e.g. is_host=1")
    group.add_argument(
        *_spellings("local-addr"),
        default=None,
        help="this node's address as the others reach it (c10d; default: its address towards the endpoint)",
    )
    group.add_argument(
        *_spellings("max-restarts"), type=int, default=None, help="restart all workers up to this many times"
    )
    training = parser.add_argument_group("training defaults (exported as UNISON_* variables)")
    training.add_argument(
        "--cpu", action="store_true", default=None, help="run on the CPU even if GPUs are present"
    )
    training.add_argument(*_spellings("mixed-precision"), default=None, help="no, bf16 or fp16")
    training.add_argument(
        *_spellings("gradient-accumulation-steps"),
        type=int,
        default=None,
        metavar="K",
        help="micro-batches per optimizer step",
    )
    training.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a rank may wait in one collective before the hang watchdog reports it and ends the "
        f"run (default {DEFAULT_FIRST_STEP_TIMEOUT_SECONDS:g} until the first optimizer step, "
        f"{DEFAULT_TIMEOUT_SECONDS:g} after)",
    )
    training.add_argument(
        "--debug",
        action="store_true",
        default=None,
        help="check every collective's operation and shapes across ranks before it runs (slower): ranks "
        "that call different collectives fail at once, on every rank",
    )
    training.add_argument(
        "--parallelism",
        default=None,
        metavar="LAYOUT",
        help="ddp (default), zero1, zero2, zero3, or FIELD=VALUE pairs of ParallelismConfig, e.g. "
        "dp_shard_size=2,tp_size=2",
    )
    training.add_argument(
        *_spellings("activation-checkpointing"),
        default=None,
        metavar="MODE",
        help="recompute activations in backward: full (every block), selective (op-level: matmul and "
        "attention outputs kept), selective:K (every K-th block), none",
    )
    training.add_argument(
        *_spellings("dynamo-backend"),
        default=None,
        metavar="BACKEND",
        help="torch.compile the model at prepare(), block by block: inductor, aot_eager, ... or no (default)",
    )
    training.add_argument(
        *_spellings("dynamo-mode"),
        default=None,
        metavar="MODE",
        help="torch.compile's mode: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs",
    )
    training.add_argument(
        *_spellings("peak-flops"),
        type=_peak_flops,
        default=None,
        metavar="FLOPS",
        help="one device's peak FLOP/s, e.g. 1e12, for the MFU of scripts that report it (throughput."
        "peak_flops) where unison's table has none: a CPU or an unlisted GPU",
    )
    training.add_argument(
        "--numerics",
        type=_numerics,
        default=None,
        metavar="CONVENTION",
        help="whose numbers where unison and Accelerate deliberately differ (a short accumulation window, "
        "the scheduler on several processes): unison (default) or accelerate",
    )
    add_plugin_flags(parser)
    add_config_flag(parser)
    parser.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module name, run as `python -m SCRIPT`"
    )
    parser.add_argument("script", help="the Python script (or, with -m, module) to run in every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script")
    parser.set_defaults(run=lambda args: run(args, parser))


def _peak_flops(text: str) -> float:
    """--peak-flops: a positive number of FLOP/s, checked here so a typo fails before any worker starts."""
    try:
        return check_peak_flops(text, "--peak-flops")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _numerics(text: str) -> str:
    """--numerics: unison or accelerate, checked here so a typo fails before any worker starts."""
    try:
        return check_numerics(text, "--numerics")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _spellings(*names: str) -> list[str]:
    """Each flag with dashes and with underscores (`--nproc-per-node`, `--nproc_per_node`)."""
    spelled = []
    for name in names:
        spelled += [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
    return spelled


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The LaunchOptions the parsed command line asks for (aliases already folded into our names); a
    setting nothing gave (None) takes LaunchOptions' default."""
    # The options' checks import torch (devices, plugins): loaded when a launch runs, so that the
    # parser above, and `unison launch --help`, need none.
    from ..launching import options

    given = {
        "nproc_per_node": args.nproc_per_node,
        "num_processes": args.num_processes,
        "nnodes": None if args.nnodes is None else str(args.nnodes),
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "rdzv_endpoint": args.rdzv_endpoint,
        "rdzv_id": args.rdzv_id,
        "rdzv_conf": args.rdzv_conf,
        "local_addr": args.local_addr,
        "max_restarts": args.max_restarts,
        "cpu": args.cpu,
        "mixed_precision": args.mixed_precision,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "timeout": None if args.timeout is None else float(args.timeout),
        "debug": args.debug,
        "parallelism": args.parallelism,
        "activation_checkpointing": args.activation_checkpointing,
        "plugin": options.plugin_from_flags(args),
        "dynamo_backend": args.dynamo_backend,
        "dynamo_mode": args.dynamo_mode,
        "peak_flops": args.peak_flops,
        "numerics": args.numerics,
    }
    return options.LaunchOptions(
        script=args.script,
        script_args=tuple(args.script_args),
        module=args.module,
        **{name: value for name, value in given.items() if value is not None},
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sources = None
    try:
        sources = apply_config_file(args)
        _check_layout(args.parallelism)
        # The launcher imports torch.distributed.run (seconds, more on a busy machine): loaded when a
        # launch runs, after the cheap checks, and not for `--help`.
        from ..launching.launcher import launch

        return launch(options_from_args(args), sources=sources)
    except (LaunchError, ConfigError) as error:  # exits with status 2, before any process started
        # A value the flags' syntax accepted: the one line that says what is wrong, not the usage.
        message = str(error) + (file_note(sources) if sources else "")
        parser.exit(2, f"{parser.prog}: error: {message}\n")


def _check_layout(parallelism: str | None) -> None:
    """A misspelled --parallelism, refused before torch is imported."""
    if parallelism is None or is_auto(parallelism):
        return
    try:
        ParallelismConfig.from_string(parallelism)
    except ValueError as error:
        raise LaunchError(f"--parallelism: {error}") from None
