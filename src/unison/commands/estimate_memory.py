"""`unison estimate-memory`: bytes per device per precision and strategy, from a model built on meta."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING

from ..parallel.checkpointing_modes import normalize_mode
from ..planning.memory_terms import PRECISIONS, STRATEGIES, expert_parallel_label, format_bytes

if TYPE_CHECKING:
    from ..planning.memory import MemoryEstimate

DESCRIPTION = """\
Build TARGET on the meta device (no memory is allocated, even for a 70B model) and print, per
precision and per strategy at --devices N, the bytes each device holds for parameters, gradients,
Adam state and (with --micro-batch-size and --seq-len, for transformers) activations.
Formulas and sources: docs/memory-estimator.md and the unison.planning.memory docstring.
"""

EPILOG = """\
TARGET is module:factory: a dotted module (importable from the current directory) or a .py file,
and a callable in it that takes no arguments and returns an nn.Module. For a model that needs a
config, write a wrapper, e.g. in my_model.py next to examples/gpt/model.py:
    from model import GPT, GPTConfig
    def build():
        return GPT(GPTConfig(n_layer=32, n_head=32, n_embd=4096, vocab_size=50304, block_size=2048))
then: unison estimate-memory examples/gpt/my_model.py:build --devices 8 --micro-batch-size 1 --seq-len 2048
"""


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "estimate-memory",
        help="estimate memory per device for each precision and strategy (model built on meta)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="TARGET", help="module:factory returning an nn.Module")
    parser.add_argument("--devices", type=_positive, default=1, metavar="N", help="devices (default 1)")
    parser.add_argument("--micro-batch-size", type=_positive, metavar="B", help="sequences per device")
    parser.add_argument("--seq-len", type=_positive, metavar="T", help="tokens per sequence")
    parser.add_argument(
        "--attention-heads",
        type=_positive,
        metavar="A",
        help="add the stored attention-score term (attention without a fused SDPA/flash kernel)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        default=None,
        metavar="MODE",
        help="count activations as under activation checkpointing: full, selective (op-level), "
        "selective:K (every K-th block); default none",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes)")
    parser.set_defaults(run=run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def run(args: argparse.Namespace) -> int:
    if (args.micro_batch_size is None) != (args.seq_len is None):
        sys.stderr.write(
            "unison estimate-memory: error: activations need both --micro-batch-size and --seq-len\n"
        )
        return 2
    if args.attention_heads is not None and args.seq_len is None:
        sys.stderr.write(
            f"unison estimate-memory: error: --attention-heads {args.attention_heads} prices the attention "
            "scores among the activations, which need --micro-batch-size and --seq-len too: add both\n"
        )
        return 2
    try:
        mode = normalize_mode(args.activation_checkpointing, "--activation-checkpointing")
    except ValueError as error:
        sys.stderr.write(f"unison estimate-memory: error: {error}\n")
        return 2
    # Building the model and estimating import torch: loaded when the command runs, so that
    # `unison estimate-memory --help` needs none.
    from ..planning import memory, memory_table

    try:
        model = memory.build_on_meta(args.target)
    except memory.TargetError as error:
        sys.stderr.write(f"unison estimate-memory: error: {error}\n")
        return 2
    result = memory_table.estimate(
        memory.inspect_model(model),
        args.devices,
        args.micro_batch_size,
        args.seq_len,
        args.attention_heads,
        activation_checkpointing=mode,
    )
    sys.stdout.write(
        (to_json(args.target, result) if args.json else format_table(args.target, result)) + "\n"
    )
    return 0


def to_json(target: str, result: MemoryEstimate) -> str:
    rows = [{**dataclasses.asdict(row), "total": row.total} for row in result.rows]
    return json.dumps(
        {
            "target": target,
            "devices": result.devices,
            "micro_batch_size": result.micro_batch_size,
            "seq_len": result.seq_len,
            "model": {
                **dataclasses.asdict(result.shape),
                "trainable_fraction": result.shape.trainable_fraction,
            },
            "estimates": rows,
            "notes": list(result.notes),
        },
        indent=2,
    )


def format_table(target: str, result: MemoryEstimate) -> str:
    shape = result.shape
    lines = [
        f"{target}: {shape.parameters:,} parameters, "
        + (
            "all trainable"
            if shape.trainable_parameters == shape.parameters
            else f"{shape.describe_trainable()}: gradients and optimizer state of those only"
        ),
        f"bytes per device at {result.devices} device(s)"
        + (f", micro-batch {result.micro_batch_size} x {result.seq_len} tokens" if result.seq_len else ""),
    ]
    labels = {name: label + (" (est.)" if is_estimate else "") for name, label, is_estimate in STRATEGIES}
    header = f"  {'strategy':<26}" + "".join(
        f"{name:>{13 if name == 'activations' else 12}}"
        for name in ("parameters", "gradients", "optimizer", "activations", "total")
    )
    for precision in PRECISIONS:
        lines += ["", f"{precision.name}: {precision.description}", header]
        for row in (r for r in result.rows if r.precision == precision.name):
            cells = [row.parameters, row.gradients, row.optimizer]
            activations = "-" if row.activations is None else format_bytes(row.activations)
            lines.append(
                f"  {labels.get(row.strategy) or expert_parallel_label(row.strategy):<26}"
                + "".join(f"{format_bytes(c):>12}" for c in cells)
                + f"{activations:>13}{format_bytes(row.total):>12}"
            )
    lines += [""] + [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
