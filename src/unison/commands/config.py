"""`unison config`: write the project's launch settings file (unison.toml), from questions or flags.

The file sits in the project, visible and versioned with the code; `unison launch` reads it from the
current directory (or --config FILE). The questions use input() and show each default; with flags,
--non-interactive or no terminal on stdin, the file is written from the flags alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..env_vars import validate_mixed_precision
from ..launching.config_file import (
    DEFAULT_FILE,
    PLUGIN_KEYS,
    SETTINGS,
    ConfigError,
    Setting,
    check_values,
    example,
)
from ..parallel.checkpointing_modes import normalize_mode

HEADER = """\
# unison launch settings: `unison launch` reads this file from the current directory (or --config FILE).
# Precedence: code argument > launch flag > UNISON_* variable > this file > default (docs/configuration.md).
"""

QUESTIONS = (
    ("nproc_per_node", "processes on this node (a number, or auto: one per GPU)"),
    ("cpu", "run on the CPU even if GPUs are present (yes/no)"),
    ("mixed_precision", "mixed precision (no, bf16, fp16)"),
    ("gradient_accumulation_steps", "micro-batches per optimizer step"),
    ("parallelism", "layout (ddp, zero1, zero2, zero3, or FIELD=VALUE pairs such as tp_size=2)"),
    ("activation_checkpointing", "activation checkpointing (none, full, selective, selective:K)"),
    ("dynamo_backend", "torch.compile backend (no, inductor, ...)"),
)


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "config",
        help="write a unison.toml of launch settings (questions, or flags for scripts)",
        description=__doc__.split("\n\n")[0] + " Keys are the launch flags' names with underscores.",
    )
    parser.add_argument("--output", default=DEFAULT_FILE, metavar="FILE", help="default: ./unison.toml")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    parser.add_argument("--non-interactive", action="store_true", help="ask nothing: write the flags alone")
    settings = parser.add_argument_group("settings (the `unison launch` flags of the same names)")
    for setting in SETTINGS.values():
        spellings = {setting.flag, f"--{setting.key}"}
        if setting.types == (bool,) and setting.key not in PLUGIN_KEYS:
            settings.add_argument(*sorted(spellings), dest=setting.key, action="store_true", default=None)
        else:
            settings.add_argument(*sorted(spellings), dest=setting.key, default=None, metavar="VALUE")
    parser.set_defaults(run=lambda args: run(args, parser))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    output = Path(args.output)
    if output.exists() and not args.force:
        parser.error(f"{output} already exists: pass --force to overwrite it, or --output another file.")
    try:
        values = {
            key: parse_value(SETTINGS[key], getattr(args, key))
            for key in SETTINGS
            if getattr(args, key) is not None
        }
        if not values and not args.non_interactive and sys.stdin.isatty():
            values = ask()
        text = HEADER + dumps(check_values(values, str(output)))
    except ConfigError as error:
        parser.error(str(error))
    output.write_text(text)
    sys.stdout.write(
        f"wrote {output} ({len(values)} setting(s)); `unison env` shows them with their origins\n"
    )
    return 0


def parse_value(setting: Setting, raw: Any) -> Any:
    """A flag's or an answer's text as the setting's TOML type; ConfigError naming the setting if not."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if bool in setting.types:
        if text.lower() in ("1", "true", "yes", "y"):
            return True
        if text.lower() in ("0", "false", "no", "n"):
            return False
        raise ConfigError(f"{setting.key} = {raw!r} is not yes or no: answer true or false.")
    for kind in setting.types:
        try:
            return check_value(setting.key, text if kind is str else kind(text))
        except ValueError as error:
            if isinstance(error, ConfigError):
                raise
    wanted = " or ".join(kind.__name__ for kind in setting.types)
    raise ConfigError(f"{setting.key} = {raw!r} is not a {wanted}: e.g. {setting.flag} 2.")


def check_value(key: str, value: Any) -> Any:
    """The launch's own checks of the values it can judge on any machine, so a wrong one is refused
    when written, not at the next launch."""
    try:
        if key == "mixed_precision":
            return validate_mixed_precision(value)
        if key == "activation_checkpointing":
            normalize_mode(value, key)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if key == "nproc_per_node" and isinstance(value, str) and value != "auto":
        raise ConfigError(f"nproc_per_node = {value!r} is neither a number nor 'auto': e.g. 2, or auto.")
    if key in ("gradient_accumulation_steps", "timeout") and not value > 0:
        raise ConfigError(f"{key} = {value} must be above 0: e.g. {key} = {example(SETTINGS[key])}.")
    return value


def ask() -> dict[str, Any]:
    """The questions, each with its default in brackets; an empty answer keeps the default (not written)."""
    values = {}
    for key, question in QUESTIONS:
        setting = SETTINGS[key]
        while True:
            answer = input(f"{question} [{_shown(setting.default)}]: ").strip()
            if not answer:
                break
            try:
                values[key] = parse_value(setting, answer)
                break
            except ConfigError as error:
                print(error)
    return values


def _shown(default: Any) -> str:
    return ("yes" if default else "no") if isinstance(default, bool) else str(default)


def dumps(values: dict[str, Any]) -> str:
    """The settings as TOML, written by tomli-w (the optional `config` extra)."""
    try:
        import tomli_w
    except ModuleNotFoundError:
        raise ConfigError(
            "writing unison.toml needs tomli-w, which is not installed: pip install 'unison[config]' "
            "(or write the file by hand: one `key = value` line per setting)."
        ) from None
    return tomli_w.dumps(values)
