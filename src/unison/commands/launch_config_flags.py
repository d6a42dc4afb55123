"""`unison launch --config FILE` (default ./unison.toml): the file's settings fill in what no flag and
no UNISON_* variable gave (unison.launching.config_file has the precedence)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from ..launching.config_file import (
    PLUGIN_KEYS,
    SETTINGS,
    find_config,
    label,
    read_config,
    resolve,
    sources_to_env,
)

logger = logging.getLogger("unison")


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "--config_file",
        "--config-file",
        dest="config",
        default=None,
        metavar="FILE",
        help="launch settings file: TOML written by `unison config`, or an Accelerate default_config.yaml "
        "(.yaml/.yml). Default: ./unison.toml when present; never a file in the home directory. Flags "
        "and UNISON_* variables win over it (docs/configuration.md).",
    )


def apply_config_file(args: argparse.Namespace) -> str:
    """Set on `args` what the config file adds; return UNISON_CONFIG_SOURCES' JSON (every setting's
    value and origin). Raises ConfigError for a bad file, before any process starts."""
    path = find_config(args.config)
    values: dict[str, Any] = {}
    if path is not None:
        if args.config is None:
            logger.info("unison: launch settings from ./%s", path.name)
        values, warnings = read_config(path)
        if warnings:
            logger.warning("unison: %s: not used by unison: %s", path, "; ".join(warnings))
    flags = {key: getattr(args, key) for key in SETTINGS if getattr(args, key, None) is not None}
    added, origins = resolve(flags, os.environ, values, label(path) if path else "")
    for key, value in added.items():
        setattr(args, key, _as_flag_value(key, value))
    return sources_to_env(origins)


def _as_flag_value(key: str, value: Any) -> Any:
    """A TOML value as argparse would have parsed the flag (plugin booleans are "true"/"false")."""
    if key in PLUGIN_KEYS and isinstance(value, bool):
        return str(value).lower()
    if key == "timeout":
        return float(value)
    return value


def file_note(sources: str) -> str:
    """ " (N settings from FILE; ...)" for an error that may be about a config file's settings; or ""."""
    counts: dict[str, int] = {}
    for _, origin in json.loads(sources).values():
        if not origin.startswith(("--", "UNISON_")):
            counts[origin] = counts.get(origin, 0) + 1
    return "".join(
        f" ({count} setting(s) came from {origin}; `unison env --config {origin}` lists them)"
        for origin, count in counts.items()
    )
