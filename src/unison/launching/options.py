"""What `unison launch` is asked to do (`LaunchOptions`), checked before any process starts.

Every flag is validated here, on the launching machine, so a typo or an impossible layout fails once
with a message naming the flag, instead of in N workers after they have formed a process group. The
running part (torch.distributed.run, the workers' environment, the rendezvous) is unison.launching.launcher's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import env_vars
from ..env_vars import check_peak_flops, validate_mixed_precision
from ..parallel.checkpointing_modes import normalize_mode
from ..parallel.config import ParallelismConfig, auto_options, is_auto
from ..plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin, layout_of, plugin_to_env, read_plugin
from .cpu_processes import MAX_AUTO_CPU_PROCESSES, usable_cpu_count
from .errors import LaunchError
from .nesting import refuse_several_launchers
from .plugin_flags import DEEPSPEED_FLAGS, FSDP_FLAGS


@dataclass(frozen=True)
class LaunchOptions:
    """Everything `unison launch` was asked to do. Field names follow the command-line flags."""

    script: str
    script_args: Sequence[str] = ()
    module: bool = False
    nproc_per_node: int | str | None = None
    num_processes: int | None = None
    nnodes: str = "1"
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "unison"
    rdzv_conf: str = ""
    local_addr: str | None = None
    max_restarts: int = 0
    cpu: bool = False
    mixed_precision: str | None = None
    gradient_accumulation_steps: int | None = None
    timeout: float | None = None
    debug: bool = False  # --debug: check every collective across ranks (env_vars.DEBUG)
    parallelism: str | None = None
    activation_checkpointing: str | None = None  # env_vars.ACTIVATION_CHECKPOINTING
    plugin: str | None = None  # env_vars.PLUGIN's JSON, from Accelerate's --use_fsdp / --use_deepspeed
    dynamo_backend: str | None = None  # --dynamo-backend: torch.compile at prepare() (parallel/compiling.py)
    dynamo_mode: str | None = None
    peak_flops: float | None = None  # --peak-flops: one device's FLOP/s for MFU (env_vars.PEAK_FLOPS)
    numerics: str | None = None  # --numerics: unison or accelerate (env_vars.NUMERICS, numerics.py)


def auto_nproc_per_node(cpu: bool) -> int:
    """Processes for `--nproc-per-node auto`: one per visible GPU, else see MAX_AUTO_CPU_PROCESSES."""
    if not cpu and torch.cuda.is_available():
        return torch.cuda.device_count()
    return min(usable_cpu_count(), MAX_AUTO_CPU_PROCESSES)


def resolve_nproc_per_node(value: int | str, cpu: bool) -> int:
    """Turn `--nproc-per-node` (a number or "auto") into a checked number of processes."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return auto_nproc_per_node(cpu)
    try:
        nproc = int(value)
    except (TypeError, ValueError):
        raise LaunchError(
            f"--nproc-per-node {value!r} is neither a number nor 'auto': pass e.g. --nproc-per-node 2, or "
            "'auto' for one process per GPU."
        ) from None
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node {nproc} is below 1: each node needs at least one process.")
    if not cpu and torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise LaunchError(
            f"--nproc-per-node {nproc} is more than the {torch.cuda.device_count()} GPU(s) this node has: "
            "each process needs its own GPU. Start at most that many processes, or pass --cpu to run "
            "every process on the CPU."
        )
    return nproc


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """`--nnodes 2` -> (2, 2); `--nnodes 1:4` (elastic, c10d rendezvous only) -> (1, 4)."""
    parts = str(nnodes).split(":")
    try:
        low, high = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        low = high = -1
    if len(parts) > 2 or not 0 < low <= high:
        raise LaunchError(
            f"--nnodes {nnodes!r} is not a node count: pass a number >= 1 such as --nnodes 2, or MIN:MAX "
            "such as 1:4 for an elastic job with --rdzv-endpoint."
        )
    return low, high


def validate(options: LaunchOptions) -> int:
    """Check every flag; return the number of processes per node. Raises LaunchError naming the fix."""
    _validate_script(options)
    if options.mixed_precision is not None:
        try:
            validate_mixed_precision(options.mixed_precision)
        except ValueError as error:
            raise LaunchError(f"--mixed-precision: {error}") from None
    steps = options.gradient_accumulation_steps
    if steps is not None and steps < 1:
        raise LaunchError(
            f"--gradient-accumulation-steps {steps} is below 1: it counts the micro-batches per optimizer "
            "step, so 1 means no accumulation."
        )
    if options.timeout is not None and not options.timeout > 0:
        raise LaunchError(
            f"--timeout {options.timeout:g} is not a positive number of seconds: a collective needs a "
            "finite limit so a stuck process cannot hang the others forever. Pass e.g. --timeout 600."
        )
    if options.peak_flops is not None:
        try:
            check_peak_flops(options.peak_flops, "--peak-flops")
        except ValueError as error:
            raise LaunchError(str(error)) from None
    if options.max_restarts < 0:
        raise LaunchError(f"--max-restarts {options.max_restarts} is negative: pass 0 (no restart) or more.")
    min_nodes, max_nodes = parse_nnodes(options.nnodes)
    refuse_several_launchers(os.environ, max_nodes)
    _refuse_flags_without_effect(options, max_nodes)
    if max_nodes > 1 and not options.rdzv_endpoint:
        _validate_static_multi_node(options, max_nodes, min_nodes)
    nproc_per_node = resolve_nproc_per_node(_per_node(options, min_nodes, max_nodes), options.cpu)
    if options.parallelism is not None:
        _validate_parallelism(options.parallelism, nproc_per_node, min_nodes, max_nodes)
    if options.plugin is not None:
        _validate_plugin(options.plugin, nproc_per_node, min_nodes, max_nodes)
    if options.activation_checkpointing is not None:
        try:  # a wrong mode fails here, not in N workers
            normalize_mode(options.activation_checkpointing, "--activation-checkpointing")
        except ValueError as error:
            raise LaunchError(str(error)) from None
    compile_variables(options)  # a wrong backend or mode fails here, not in N workers
    return nproc_per_node


def compile_variables(options: LaunchOptions) -> dict[str, str]:
    """UNISON_DYNAMO_* for --dynamo-backend / --dynamo-mode (checked: LaunchError naming the fix)."""
    from ..parallel.compiling import check_backend, check_mode

    env = {}
    try:
        if options.dynamo_backend is not None:
            env[env_vars.DYNAMO_BACKEND] = check_backend(options.dynamo_backend)
        if options.dynamo_mode is not None:
            env[env_vars.DYNAMO_MODE] = check_mode(options.dynamo_mode)
    except (ValueError, TypeError) as error:
        raise LaunchError(f"--dynamo-backend/--dynamo-mode: {error}") from None
    return env


def _validate_script(options: LaunchOptions) -> None:
    """The script must exist; with -m, the module's top-level package must be importable from here."""
    if options.module:
        top_level = options.script.split(".")[0]
        sys.path.insert(0, os.getcwd())  # as `python -m` in the workers, which start in this directory
        try:
            found = bool(top_level) and importlib.util.find_spec(top_level) is not None
        finally:
            sys.path.pop(0)
        if not found:
            raise LaunchError(
                f"-m {options.script}: no module named {top_level!r} is importable from {os.getcwd()} or "
                "this Python's packages: check the name, install the package, or run from its directory."
            )
    elif not os.path.isfile(options.script):
        raise LaunchError(
            f"the script {options.script!r} does not exist (looked in {os.getcwd()}): pass the path of "
            "a Python file, e.g. `unison launch --nproc-per-node 2 train.py`, or `-m package.module`."
        )


def _per_node(options: LaunchOptions, min_nodes: int, max_nodes: int) -> int | str:
    """--nproc-per-node, or Accelerate's --num-processes (processes in all) divided over the nodes."""
    if options.num_processes is None:
        return 1 if options.nproc_per_node is None else options.nproc_per_node
    total = options.num_processes
    if total < 1 or min_nodes != max_nodes or total % max_nodes:
        raise LaunchError(
            f"--num-processes {total} counts the processes of all {options.nnodes} node(s) together, so it "
            "must be a positive multiple of a fixed --num-machines/--nnodes. Pass --nproc-per-node "
            "(processes on each node) instead for an elastic or uneven job."
        )
    if options.nproc_per_node is not None and str(options.nproc_per_node) != str(total // max_nodes):
        raise LaunchError(
            f"--num-processes {total} over {max_nodes} node(s) means {total // max_nodes} per node, but "
            f"--nproc-per-node says {options.nproc_per_node}: pass one of the two."
        )
    return total // max_nodes


def _validate_parallelism(parallelism: str, nproc_per_node: int, min_nodes: int, max_nodes: int) -> None:
    """Parse --parallelism; with a fixed node count, check its degrees against the world size too."""
    if is_auto(parallelism):
        try:
            auto_options(
                parallelism
            )  # the layout is the planner's, inside the workers; its facts are checked here
        except ValueError as error:
            raise LaunchError(f"--parallelism: {error}") from None
        return
    try:
        config = ParallelismConfig.from_string(parallelism)
        if min_nodes == max_nodes:
            config.validate(nproc_per_node * max_nodes)
    except ValueError as error:
        raise LaunchError(f"--parallelism: {error}") from None


def _validate_plugin(plugin: str, nproc_per_node: int, min_nodes: int, max_nodes: int) -> None:
    """Read the plugin as the workers will, and with a fixed node count check the layout it names."""
    try:
        world = nproc_per_node * max_nodes
        layout = layout_of(read_plugin(plugin), world, nproc_per_node).parallelism
        if min_nodes == max_nodes:
            layout.validate(world)
    except (ValueError, TypeError) as error:
        raise LaunchError(str(error)) from None


def _refuse_flags_without_effect(options: LaunchOptions, max_nodes: int) -> None:
    """Rendezvous flags that the chosen rendezvous would drop are errors, not silently ignored.

    --node-rank under --rdzv-endpoint stays allowed (and ignored, as torchrun does): cluster scripts
    pass it everywhere, and the c10d rendezvous numbers nodes in the order they join.
    """
    if options.rdzv_endpoint:
        given = [
            f"--{name.replace('_', '-')} {value}"
            for name, value in (("master_addr", options.master_addr), ("master_port", options.master_port))
            if value is not None
        ]
        if given:
            raise LaunchError(
                f"{' and '.join(given)} with --rdzv-endpoint {options.rdzv_endpoint}: the c10d rendezvous "
                "at the endpoint gives every node its address and rank, so these would be ignored. Pass "
                "either --rdzv-endpoint HOST:PORT, or --master-addr/--master-port with --node-rank."
            )
        return
    given = [
        f"--{name.replace('_', '-')} {value}"
        for name, value, default in (
            ("rdzv_id", options.rdzv_id, LaunchOptions.rdzv_id),
            ("rdzv_conf", options.rdzv_conf, LaunchOptions.rdzv_conf),
        )
        if value != default
    ]
    if given:
        raise LaunchError(
            f"{' and '.join(given)} without --rdzv-endpoint: they configure the c10d rendezvous, which "
            "only --rdzv-endpoint HOST:PORT starts. Add it, or drop them."
        )
    if max_nodes == 1 and options.node_rank not in (None, 0):
        raise LaunchError(
            f"--node-rank {options.node_rank} with --nnodes {options.nnodes}: one node is node 0. Pass "
            "--nnodes with the number of nodes, or drop --node-rank."
        )


def _validate_static_multi_node(options: LaunchOptions, max_nodes: int, min_nodes: int) -> None:
    if min_nodes != max_nodes:
        raise LaunchError(
            f"--nnodes {options.nnodes} is elastic (a range) but no --rdzv-endpoint was given: a range "
            "needs the c10d rendezvous. Pass --rdzv-endpoint HOST:PORT, or a fixed --nnodes."
        )
    if not options.master_addr:
        raise LaunchError(
            f"--nnodes {max_nodes} needs to know where node 0 is: pass --master-addr HOST --master-port "
            "PORT --node-rank R on every node (static rendezvous), or --rdzv-endpoint HOST:PORT."
        )
    if options.node_rank is None or not 0 <= options.node_rank < max_nodes:
        raise LaunchError(
            f"--node-rank {options.node_rank} is not in [0, {max_nodes}): with --master-addr every node "
            "needs its own --node-rank (0 on the master node, 1, 2, ... on the others)."
        )


def plugin_from_flags(args: argparse.Namespace) -> str | None:
    """The UNISON_PLUGIN JSON the flags ask for, or None. Raises LaunchError naming a wrong flag."""
    chosen = [name for name in ("use_fsdp", "use_deepspeed") if getattr(args, name)]
    if len(chosen) == 2:
        raise LaunchError("--use_fsdp and --use_deepspeed name two layouts: pass one of them.")
    for use, flags in (("use_fsdp", FSDP_FLAGS), ("use_deepspeed", DEEPSPEED_FLAGS)):
        stray = [f"--{flag}" for flag in flags if getattr(args, flag) is not None and use not in chosen]
        if stray:
            raise LaunchError(f"{', '.join(stray)} without --{use}: add --{use}, or drop them.")
    if not chosen:
        return None
    if args.parallelism is not None:
        raise LaunchError(
            f"--parallelism {args.parallelism} and --{chosen[0]} both name the layout: pass one of them."
        )
    if chosen == ["use_fsdp"]:
        plugin: Any = FullyShardedDataParallelPlugin(**_fields(args, FSDP_FLAGS))
    else:
        fields = _fields(args, DEEPSPEED_FLAGS)
        if args.gradient_accumulation_steps is not None:  # Accelerate hands it to the DeepSpeed plugin too
            fields["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        plugin = DeepSpeedPlugin(**fields)
    return plugin_to_env(plugin)


def _fields(args: argparse.Namespace, flags: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    fields = {}
    for flag, (field, kind) in flags.items():
        value = getattr(args, flag)
        if value is not None:
            fields[field] = _boolean(flag, value) if kind == "bool" else value
    return fields


def _boolean(flag: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise LaunchError(f"--{flag} {value!r} is not true or false: pass --{flag} true or --{flag} false.")
