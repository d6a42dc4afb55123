"""The launch config file (`unison.toml`) and where each launch setting comes from.

A project keeps its launch settings in a visible file beside the code, read by `unison launch` from
`--config FILE` or `./unison.toml`, never from a hidden file in the home directory: Accelerate's
`~/.cache/huggingface/accelerate/default_config.yaml` silently overriding flags is one of its
long-standing complaints (accelerate#1133, #2920). The file fills only what nothing stronger gave:

    code argument  >  launch flag  >  UNISON_* environment variable  >  config file  >  default

Keys are the launch flags' names with underscores (`mixed_precision = "bf16"`), Accelerate's FSDP and
DeepSpeed flags included (`use_fsdp = true`, `fsdp_sharding_strategy = "FULL_SHARD"`). Settings that
belong together (the process count, the layout, the rendezvous address) are taken as a group: a flag
for one of them sets the file's whole group aside, so a file never mixes with a flag into a
combination nobody wrote. The launcher passes each setting's value and origin to the workers as JSON
in UNISON_CONFIG_SOURCES, which `unison env` prints ("mixed_precision = bf16 (from unison.toml)").
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import env_vars
from .accelerate_config import read_accelerate_yaml
from .errors import ConfigError
from .plugin_flags import DEEPSPEED_FLAGS, FSDP_FLAGS

DEFAULT_FILE = "unison.toml"
DEFAULT_ORIGIN = "default"


@dataclass(frozen=True)
class Setting:
    """One launch setting: its key (= the flag's argparse dest), accepted TOML types, its UNISON_*
    variable, the default `unison env` shows (None: shown only when set) and its group (see resolve)."""

    key: str
    types: tuple[type, ...]
    env: str | None = None
    default: Any = None
    group: str | None = None

    @property
    def flag(self) -> str:
        return f"--{self.key.replace('_', '-')}"


_PLUGIN_TYPES = {int: (int,), float: (float, int), str: (str,), "bool": (bool,)}

SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in [
        Setting("nproc_per_node", (int, str), default=1, group="processes"),
        Setting("num_processes", (int,), group="processes"),
        Setting("nnodes", (int, str), default="1"),
        Setting("node_rank", (int,)),
        Setting("master_addr", (str,), group="rendezvous"),
        Setting("master_port", (int,), group="rendezvous"),
        Setting("rdzv_endpoint", (str,), group="rendezvous"),
        Setting("rdzv_id", (str,)),
        Setting("rdzv_conf", (str,)),
        Setting("local_addr", (str,)),
        Setting("max_restarts", (int,)),
        Setting("cpu", (bool,), env_vars.CPU, False),
        Setting("mixed_precision", (str,), env_vars.MIXED_PRECISION, "no"),
        Setting("gradient_accumulation_steps", (int,), env_vars.GRADIENT_ACCUMULATION_STEPS, 1),
        Setting(
            "timeout",
            (float, int),
            env_vars.TIMEOUT,
            f"{env_vars.DEFAULT_FIRST_STEP_TIMEOUT_SECONDS:g} s to the first step, "
            f"{env_vars.DEFAULT_TIMEOUT_SECONDS:g} s after",
        ),
        Setting("debug", (bool,), env_vars.DEBUG, False),
        Setting("parallelism", (str,), env_vars.PARALLELISM, "ddp", group="layout"),
        Setting("activation_checkpointing", (str,), env_vars.ACTIVATION_CHECKPOINTING, "none"),
        Setting("dynamo_backend", (str,), env_vars.DYNAMO_BACKEND, "no"),
        Setting("dynamo_mode", (str,), env_vars.DYNAMO_MODE, "default"),
        Setting("use_fsdp", (bool,), env_vars.PLUGIN, group="layout"),
        Setting("use_deepspeed", (bool,), env_vars.PLUGIN, group="layout"),
        *(
            Setting(flag, _PLUGIN_TYPES[kind], env_vars.PLUGIN, group="layout")
            for flag, (_, kind) in {**FSDP_FLAGS, **DEEPSPEED_FLAGS}.items()
        ),
    ]
}
"""Every key a config file may hold; the launch flags' dests. Plugin keys show only when set."""

PLUGIN_KEYS = frozenset({*FSDP_FLAGS, *DEEPSPEED_FLAGS})


def find_config(path: str | None, cwd: Path | None = None) -> Path | None:
    """The file to read: `path` (must exist), else ./unison.toml when present, else None. Never $HOME."""
    if path is not None:
        given = Path(path)
        if not given.is_file():
            raise ConfigError(
                f"--config {path}: no such file. Write one with `unison config --output {path}`, or "
                "fix the path."
            )
        return given
    default = (cwd or Path.cwd()) / DEFAULT_FILE
    return default if default.is_file() else None


def read_config(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The settings in `path` (TOML, or an Accelerate YAML by its suffix), checked; and warnings (lines
    naming the Accelerate keys that were not used)."""
    if path.suffix in (".yaml", ".yml"):
        values, warnings = read_accelerate_yaml(path)
    else:
        values, warnings = _read_toml(path), []
    return check_values(values, str(path)), warnings


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (a core dependency there)
        import tomli as tomllib
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(
            f"{path} is not valid TOML ({error}): fix the line named, or rewrite it with "
            "`unison config --force`."
        ) from None


def check_values(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`values` if every key is a setting and every value has its type; else ConfigError naming both."""
    for key, value in values.items():
        setting = SETTINGS.get(key)
        if setting is None:
            close = difflib.get_close_matches(key, SETTINGS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else "see `unison config --help` for the keys"
            raise ConfigError(
                f"{where}: unknown key {key!r} ({hint}). Keys are launch flags' names with "
                "underscores, e.g. mixed_precision."
            )
        if isinstance(value, bool) and bool not in setting.types or not isinstance(value, setting.types):
            wanted = " or ".join("true/false" if t is bool else t.__name__ for t in setting.types)
            raise ConfigError(
                f"{where}: {key} = {value!r} is a {type(value).__name__}, but {key} takes "
                f"{wanted}: e.g. {key} = {example(setting)}."
            )
    return dict(values)


def example(setting: Setting) -> str:
    """A valid TOML value for `setting`, for error messages: its default when that is one."""
    sample = setting.default
    if sample is None or not isinstance(sample, setting.types):
        sample = {bool: True, int: 2, float: 600.0}.get(setting.types[0], "VALUE")
    return json.dumps(sample) if not isinstance(sample, bool) else str(sample).lower()


def resolve(
    flags: Mapping[str, Any], environ: Mapping[str, str], file_values: Mapping[str, Any], file_label: str
) -> tuple[dict[str, Any], dict[str, tuple[Any, str]]]:
    """Merge by precedence. Returns (what the file adds: key -> value, for the launcher to apply) and
    (every set setting -> (value, origin)); origins are the flag, the variable, or the file's label.

    `flags` holds only the flags given on the command line. A group with any member given by a flag or
    variable takes nothing from the file."""
    origins: dict[str, tuple[Any, str]] = {}
    for key, value in flags.items():
        origins[key] = (value, SETTINGS[key].flag)
    for key, setting in SETTINGS.items():
        if key not in origins and setting.env not in (None, env_vars.PLUGIN) and setting.env in environ:
            origins[key] = (environ[setting.env], setting.env)
    taken_groups = {SETTINGS[key].group for key in origins} - {None}
    if env_vars.PLUGIN in environ:  # the whole plugin in one variable (`unison env` lists it as is)
        taken_groups.add("layout")
    added = {
        key: value
        for key, value in file_values.items()
        if key not in origins
        and SETTINGS[key].group not in taken_groups
        and not (SETTINGS[key].env is not None and SETTINGS[key].env in environ)
    }
    origins.update({key: (value, file_label) for key, value in added.items()})
    return added, origins


def sources_to_env(origins: Mapping[str, tuple[Any, str]]) -> str:
    """UNISON_CONFIG_SOURCES' JSON: the launcher's resolution, for `unison env` inside the workers."""
    return json.dumps({key: [value, origin] for key, (value, origin) in origins.items()})


def describe(origins: Mapping[str, tuple[Any, str]]) -> list[str]:
    """One `key = value (from ORIGIN)` line per setting, `(default)` for those nothing set (unless
    another of its group was set: num_processes makes nproc_per_node's default moot)."""
    lines = []
    groups_set = {SETTINGS[key].group for key in origins} - {None}
    for key, setting in SETTINGS.items():
        if key in origins:
            value, origin = origins[key]
            lines.append(f"{key} = {_show(value)} (from {origin})")
        elif setting.default is not None and setting.group not in groups_set:
            lines.append(f"{key} = {_show(setting.default)} ({DEFAULT_ORIGIN})")
    return lines


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def current_origins(config: str | None) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """The settings as this process sees them: the launcher's resolution inside a launched worker,
    else the environment over the config file (`config`, or ./unison.toml). Also the file's warnings."""
    passed = os.environ.get(env_vars.CONFIG_SOURCES)
    if passed and config is None:
        return {key: (value, origin) for key, (value, origin) in json.loads(passed).items()}, []
    path = find_config(config)
    values, warnings = read_config(path) if path else ({}, [])
    return resolve({}, os.environ, values, label(path) if path else "")[1], warnings


def label(path: Path) -> str:
    """How a file is named in origins: `unison.toml` for ./unison.toml, else the path as given."""
    return path.name if path.parent == Path(".") or path.resolve().parent == Path.cwd() else str(path)
