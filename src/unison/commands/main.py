"""Entry point of the `unison` console script and of `python -m unison`: one subcommand per module."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .. import __version__
from . import env, estimate_memory, launch, plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unison",
        description="Run one ordinary PyTorch training script on one CPU, one GPU, many GPUs or machines.",
    )
    parser.add_argument("--version", action="version", version=f"unison {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    launch.register(subcommands)
    env.register(subcommands)
    estimate_memory.register(subcommands)
    plan.register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the subcommand, return its exit code."""
    unison_logger = logging.getLogger("unison")
    if not unison_logger.handlers:  # the launcher's own messages: plain lines on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        unison_logger.addHandler(handler)
        unison_logger.setLevel(logging.INFO)
    args = build_parser().parse_args(argv)
    return args.run(args)
