"""`unison plan`: the parallel layout for a model (built on meta): the fastest that fits when the run's
global batch is given (unison.planning.cost_model), else the first that fits in the guide's order."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ..planning.devices import (
    DEFAULT_EFFICIENCY,
    DEVICES,
    LINKS_BETWEEN_NODES,
    LINKS_WITHIN_NODE,
    DeviceSpec,
    parse_device_spec,
    parse_memory,
)
from ..planning.memory_terms import PRECISIONS, format_bytes

if TYPE_CHECKING:
    from ..planning.cost_model import StepCost
    from ..planning.layout_memory import PlanMemory
    from ..planning.planner import Plan

DESCRIPTION = """\
Build TARGET on the meta device (no memory is allocated) and pick the parallel layout for --devices N
over --nodes M: the guide's decision tree (fits on one device: DDP; does not: ZeRO, PP or TP by how fast
the devices are linked; largest layer does not: TP; across nodes: TP inside nodes, PP across them for
huge models, HSDP over slow inter-node links), priced with unison's memory formulas. With
--global-batch-size and --seq-len it also predicts each fitting layout's step time (compute at --mfu of
the --device's peak, each collective over the link it crosses, the pipeline bubble) and picks the
fastest, trying micro-batch sizes unless --micro-batch-size is given. Prints the ParallelismConfig, the
memory per device, the predicted step, the reasons and the runners-up. Rules: docs/planner.md.
"""

EPILOG = (
    """\
TARGET is module:factory, as for `unison estimate-memory` (a callable taking no arguments that returns
an nn.Module). Memory sizes are binary (80GB = 80 GiB). Example:
    unison plan examples/gpt/my_model.py:build --devices 16 --nodes 2 --device-memory 80GB \\
        --precision bf16-mixed --micro-batch-size 1 --seq-len 4096 --json
    unison plan examples/gpt/my_model.py:build --devices 64 --nodes 8 --device h100 \\
        --inter-node infiniband --precision bf16-mixed --seq-len 4096 --global-batch-size 512
Devices known to --device: """
    + ", ".join(DEVICES)
    + """ (docs/planner.md: their figures); another is
NAME:peak=FLOP/s,memory=SIZE,nvlink=BYTES/s,network=BYTES/s.
"""
)


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
        default=None,
        metavar="SIZE",
        help="memory per device (default: the --device's, else 80GB)",
    )
    parser.add_argument(
        "--device",
        type=_device,
        default=None,
        metavar="NAME",
        help=f"the accelerator, for its peak FLOP/s and links: {', '.join(DEVICES)} or "
        "NAME:peak=...,memory=...,nvlink=...,network=... (default h100 when a step is priced)",
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
        choices=[p.name for p in PRECISIONS],
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
    parser.add_argument(
        "--global-batch-size",
        type=_positive,
        metavar="G",
        help="sequences per optimizer step over all devices: price each layout's step and pick the fastest "
        "(needs --seq-len)",
    )
    parser.add_argument(
        "--mfu",
        type=_fraction,
        default=DEFAULT_EFFICIENCY,
        metavar="F",
        help=f"share of the device's peak a wide model's step reaches (default {DEFAULT_EFFICIENCY})",
    )
    parser.add_argument(
        "--no-zero",
        action="store_true",
        help="leave out layouts that shard over the data-parallel ranks (ZeRO-1/2/3, HSDP)",
    )
    measuring = parser.add_argument_group("measuring on this machine")
    measuring.add_argument(
        "--measure",
        nargs="?",
        const=3,
        type=_positive,
        metavar="K",
        help="time the best K layouts (default 3) on this node, each in its own `unison launch` of --devices "
        "processes with the real model, and pick by measurement (needs --global-batch-size)",
    )
    measuring.add_argument(
        "--measure-steps", type=_positive, default=3, metavar="S", help="timed optimizer steps per layout"
    )
    measuring.add_argument(
        "--cpu", action="store_true", help="measure on the CPU (gloo) even if GPUs are visible"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes, seconds)")
    parser.set_defaults(run=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not a share of the peak: give one in (0, 1], e.g. 0.4")
    return value


def _device(text: str) -> DeviceSpec:
    try:
        return parse_device_spec(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
    # The planner builds the model on meta and may launch measurements: it imports torch, loaded when
    # the command runs, so that `unison plan --help` needs none.
    from ..planning import measure as plan_measure
    from ..planning import memory, planner

    try:
        device_memory = args.device_memory or (args.device.memory if args.device else parse_memory("80GB"))
        hardware = planner.Hardware(
            args.devices, device_memory, args.nodes, args.interconnect, args.inter_node
        )
        workload = planner.Workload(
            args.precision,
            args.micro_batch_size,
            args.seq_len,
            args.activation_checkpointing,
            pipeline=not args.no_pipeline,
            tensor_parallel=not args.no_tensor_parallel,
            global_batch_size=args.global_batch_size,
            zero=not args.no_zero,
        )
        model = memory.build_on_meta(args.target)
        plan = planner.plan_for(planner.model_facts(model), hardware, workload, args.device, args.mfu)
        measured = (
            plan_measure.measure(args.target, plan, args.measure, args.measure_steps, args.cpu)
            if args.measure
            else None
        )
    except ValueError as error:  # TargetError, PlanError and bad hardware are all ValueErrors
        sys.stderr.write(f"unison plan: error: {error}\n")
        return 2
    if args.json:
        report = plan.to_dict()
        if measured is not None:
            report["measured"] = [m.to_dict() for m in measured]
            best = plan_measure.fastest(measured)
            report["measured_choice"] = None if best is None else best.to_dict()
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return 0
    text = format_plan(args.target, plan)
    if measured is not None:
        text += (
            f"\n\nmeasured on this machine ({plan.hardware.devices} processes, {args.measure_steps} timed "
            "steps each, the slowest process's median):\n"
            + "\n".join(plan_measure.format_measurements(measured))
        )
    sys.stdout.write(text + "\n")
    return 0


def format_plan(target: str, plan: Plan) -> str:
    """The human-readable plan: layout, config fields, memory per device, reasons, runners-up."""
    workload = plan.workload
    batch = (
        f", micro-batch {workload.micro_batch_size} x {workload.seq_len} tokens"
        if workload.micro_batch_size
        else ", model state only (no --micro-batch-size/--seq-len)"
    )
    layout = plan.config.to_string()  # what the user pastes
    lines = [
        f"{target}: {plan.model.describe()}",
        f"hardware: {plan.hardware.describe()}",
        f"training: {workload.precision}{batch}"
        + (", activation checkpointing" if workload.activation_checkpointing else ""),
        "",
        f"recommended: {plan.config.describe()}",
        f"  --parallelism {layout}   (in code: Accelerator(parallelism={layout!r}))",
        "",
        "memory per device"
        + (
            ""
            if plan.model.shape.trainable_parameters == plan.model.shape.parameters
            else f", {plan.model.shape.describe_trainable()}: gradients and optimizer state of those only"
        )
        + ":",
        _memory_header(),
        _memory_row("chosen", plan.memory),
        "",
        "reasons:",
        *(f"  - {reason}" for reason in plan.reasons),
        "",
    ]
    if plan.cost is not None:
        lines += [
            f"predicted step ({plan.device.name}, {plan.workload.global_batch_size} sequences of "
            f"{workload.seq_len} tokens; docs/planner.md: the model and its limits):",
            *format_costs(
                [("chosen: " + plan.config.describe().split(", activation")[0], plan.cost)]
                + [(c.config.describe(), c.cost) for c in plan.runners_up if c.cost is not None]
            ),
            "",
        ]
    lines += ["runners-up:", _memory_header()]
    for candidate in plan.runners_up:
        lines += [_memory_row(candidate.config.describe(), candidate.memory), f"      {candidate.why}"]
    if not plan.runners_up:
        lines[-1] = "  none: one device has one layout"
    return "\n".join(lines)


def format_costs(rows: list[tuple[str, StepCost]]) -> list[str]:
    """A line per layout: the step and its parts in seconds (exposed communication by kind), tokens/s, MFU."""
    kinds = sorted({kind for _, cost in rows for kind, seconds in cost.exposed.items() if seconds > 0})
    widths = [max(9, len(kind) + 2) for kind in kinds]
    label_width = max(len(label) for label, _ in rows) + 2
    header = (
        f"  {'layout':<{label_width}}{'step s':>9}{'compute':>9}{'overhead':>10}"
        + f"{'pp imbalance':>14}{'bubble':>9}"
        + "".join(f"{kind:>{width}}" for kind, width in zip(kinds, widths))
        + f"{'tokens/s':>13}{'MFU':>7}"
    )
    lines = [header]
    for label, cost in rows:
        lines.append(
            f"  {label:<{label_width}}{cost.step:>9.3g}{cost.compute:>9.3g}{cost.overhead:>10.3g}"
            + f"{cost.imbalance:>14.3g}{cost.bubble:>9.3g}"
            + "".join(f"{cost.exposed.get(kind, 0.0):>{width}.3g}" for kind, width in zip(kinds, widths))
            + f"{cost.tokens_per_second:>13,.0f}{cost.mfu:>7.1%}"
        )
    return lines


def _memory_header() -> str:
    return f"  {'layout':<56}" + "".join(
        f"{name:>12}"
        for name in ("parameters", "gradients", "optimizer", "activations", "total", "of device")
    )


def _memory_row(label: str, need: PlanMemory) -> str:
    activations = "-" if need.activations is None else format_bytes(need.activations)
    cells = [format_bytes(c) for c in (need.parameters, need.gradients, need.optimizer)]
    return (
        f"  {label:<56}"
        + "".join(f"{c:>12}" for c in cells)
        + f"{activations:>12}{format_bytes(need.total):>12}{need.fraction:>12.0%}"
    )
