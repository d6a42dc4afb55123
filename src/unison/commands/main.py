"""Entry point of the `unison` console script and of `python -m unison`: one subcommand per module."""

from __future__ import annotations

import argparse
import difflib
import gc
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from .. import __version__
from . import config, env, estimate_memory, export, launch, plan, plot


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser that answers an unknown flag with the nearest known one ("did you mean ...?")
    and takes no abbreviations (`--nproc-per-nod` is a typo, not a flag)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        unknown = re.search(r"unrecognized arguments: (\S+)", message)
        if unknown:
            close = difflib.get_close_matches(unknown.group(1).split("=")[0], self._flags(), n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]}?)"
        super().error(message)

    def _flags(self) -> list[str]:
        return [name for action in self._actions for name in action.option_strings]


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="unison",
        description="Run one ordinary PyTorch training script on one CPU, one GPU, many GPUs or machines.",
    )
    parser.add_argument("--version", action="version", version=f"unison {__version__}")
    subcommands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=SuggestingParser
    )
    launch.register(subcommands)
    env.register(subcommands)
    config.register(subcommands)
    estimate_memory.register(subcommands)
    plan.register(subcommands)
    plot.register(subcommands)
    export.register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the subcommand, return its exit code."""
    unison_logger = logging.getLogger("unison")
    if not unison_logger.handlers:  # the launcher's own messages: plain lines on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        unison_logger.addHandler(handler)
        unison_logger.setLevel(logging.INFO)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand's parser, so its usage is the one shown
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subcommands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.run(args)


def console_main() -> int:
    """The `unison` console script and `python -m unison`: main(), in a process that ends right after.

    What the command left reachable (torch, and for `unison launch` its elastic agent) stays so until the
    interpreter ends: gc.freeze() keeps the teardown's collections from walking it again, 0.5-0.7 s of
    CPU per command on the 2-core build machine. (Not in main(), which tests and notebooks call in a
    process that goes on.)
    """
    code = main()
    gc.freeze()
    return code
