"""`unison plan`: the parallel layout the guide's decision tree picks for a model (built on meta)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .. import memory, planner
from ..hardware import LINKS_BETWEEN_NODES, LINKS_WITHIN_NODE, Hardware, parse_memory

DESCRIPTION = """\
Build TARGET on the meta device (no memory is allocated) and pick the parallel layout for --devices N
over --nodes M: the guide's decision tree (fits on one device: DDP; does not: ZeRO, PP or TP by how fast
the devices are linked; largest layer does not: TP; across nodes: TP inside nodes, PP across them for
huge models, HSDP over slow inter-node links), priced with unison's memory formulas. Prints the
ParallelismConfig, the memory per device, the reasons and the runners-up. Rules: docs/planner.md.
"""

EPILOG = """\
TARGET is module:factory, as for `unison estimate-memory` (a callable taking no arguments that returns
an nn.Module). Memory sizes are binary (80GB = 80 GiB). Example:
    unison plan examples/gpt/my_model.py:build --devices 16 --nodes 2 --device-memory 80GB \\
        --precision bf16-mixed --micro-batch-size 1 --seq-len 4096 --json
"""


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "plan",
        help="recommend a parallel layout (ParallelismConfig) for a model on given hardware",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="TARGET", help="module:factory returning an nn.Module")
    parser.add_argument("--devices", type=_positive, required=True, metavar="N", help="devices in all")
    parser.add_argument("--nodes", type=_positive, default=1, metavar="M", help="nodes (default 1)")
    parser.add_argument(
        "--device-memory",
        type=_memory,
        default="80GB",
        metavar="SIZE",
        help="memory per device (default 80GB)",
    )
    parser.add_argument(
        "--interconnect",
        type=_link(LINKS_WITHIN_NODE, "--interconnect"),
        default="nvlink",
        metavar="LINK",
        help="link between the devices of a node: nvlink (default) or pcie",
    )
    parser.add_argument(
        "--inter-node",
        type=_link(LINKS_BETWEEN_NODES, "--inter-node"),
        default="ethernet",
        metavar="LINK",
        help="link between nodes: ethernet (default), infiniband or nvlink",
    )
    parser.add_argument(
        "--micro-batch-size", type=_positive, metavar="B", help="sequences per device per step"
    )
    parser.add_argument("--seq-len", type=_positive, metavar="S", help="tokens per sequence")
    parser.add_argument(
        "--precision",
        choices=[p.name for p in memory.PRECISIONS],
        default="fp32",
        help="training precision: bf16-mixed is mixed_precision='bf16' (autocast over fp32 weights), bf16 a "
        "model cast to bfloat16 (default fp32)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="count activations as with full recomputation (each block keeps only its input)",
    )
    parser.add_argument(
        "--no-pipeline",
        action="store_true",
        help="leave out pipeline layouts (loop without the pipeline step)",
    )
    parser.add_argument(
        "--no-tensor-parallel", action="store_true", help="leave out TP layouts (model without a TP plan)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    parser.set_defaults(run=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _link(links: dict[str, bool], flag: str):
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in links:
            other = "--inter-node" if flag == "--interconnect" else "--interconnect"
            hint = (
                f" ({value!r} is a link for {other})"
                if value in {**LINKS_WITHIN_NODE, **LINKS_BETWEEN_NODES}
                else ""
            )
            raise argparse.ArgumentTypeError(
                f"unknown link {text!r}{hint}: {flag} takes one of {', '.join(links)}"
            )
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    try:
        hardware = Hardware(args.devices, args.device_memory, args.nodes, args.interconnect, args.inter_node)
        workload = planner.Workload(
            args.precision,
            args.micro_batch_size,
            args.seq_len,
            args.activation_checkpointing,
            pipeline=not args.no_pipeline,
            tensor_parallel=not args.no_tensor_parallel,
        )
        model = memory.build_on_meta(args.target)
        plan = planner.plan_for(planner.model_facts(model), hardware, workload)
    except ValueError as error:  # TargetError, PlanError and bad hardware are all ValueErrors
        sys.stderr.write(f"unison plan: error: {error}\n")
        return 2
    sys.stdout.write((plan.to_json() if args.json else format_plan(args.target, plan)) + "\n")
    return 0


def format_plan(target: str, plan: planner.Plan) -> str:
    """The human-readable plan: layout, config fields, memory per device, reasons, runners-up."""
    workload = plan.workload
    batch = (
        f", micro-batch {workload.micro_batch_size} x {workload.seq_len} tokens"
        if workload.micro_batch_size
        else ", model state only (no --micro-batch-size/--seq-len)"
    )
    config_fields = ", ".join(
        f"{field.name}={getattr(plan.config, field.name)!r}"
        for field in dataclasses.fields(plan.config)
        if field.name not in ("tp_plan", "pp_split_points")
    )
    lines = [
        f"{target}: {plan.model.describe()}",
        f"hardware: {plan.hardware.describe()}",
        f"training: {workload.precision}{batch}"
        + (", activation checkpointing" if workload.activation_checkpointing else ""),
        "",
        f"recommended: {plan.config.describe()}",
        f"  ParallelismConfig({config_fields})",
        "",
        "memory per device:",
        _memory_header(),
        _memory_row("chosen", plan.memory),
        "",
        "reasons:",
        *(f"  - {reason}" for reason in plan.reasons),
        "",
        "runners-up:",
        _memory_header(),
    ]
    for candidate in plan.runners_up:
        lines += [_memory_row(candidate.config.describe(), candidate.memory), f"      {candidate.why}"]
    if not plan.runners_up:
        lines[-1] = "  none: one device has one layout"
    return "\n".join(lines)


def _memory_header() -> str:
    return f"  {'layout':<56}" + "".join(
        f"{name:>12}"
        for name in ("parameters", "gradients", "optimizer", "activations", "total", "of device")
    )


def _memory_row(label: str, need: planner.PlanMemory) -> str:
    activations = "-" if need.activations is None else memory.format_bytes(need.activations)
    cells = [memory.format_bytes(c) for c in (need.parameters, need.gradients, need.optimizer)]
    return (
        f"  {label:<56}"
        + "".join(f"{c:>12}" for c in cells)
        + f"{activations:>12}{memory.format_bytes(need.total):>12}{need.fraction:>12.0%}"
    )
