"""`unison env`: the facts a bug report needs (versions, devices, backends, launch variables, and each
launch setting with where it came from)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from typing import Any

from .. import __version__, env_vars
from ..launching.config_file import ConfigError, current_origins, describe

RELEVANT_ENV = re.compile(
    r"^(UNISON_\w+|RANK|LOCAL_RANK|GROUP_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
    r"TORCHELASTIC_\w+|SLURM_\w+|CUDA_VISIBLE_DEVICES|NCCL_\w+|GLOO_\w+|OMP_NUM_THREADS|TORCH_DISTRIBUTED_\w+)$"
)


def collect(config: str | None = None) -> dict[str, Any]:
    """Versions, devices, process-group backends, the environment variables that steer a launch, and
    each launch setting with its origin (`config`: the settings file; default ./unison.toml if present)."""
    # torch is what this report describes: imported when the report is made, so `unison env --help`
    # needs none.
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    origins, warnings = current_origins(config)
    return {
        "unison": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "mps_available": torch.backends.mps.is_available(),
        "distributed_available": dist.is_available(),
        "backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "environment": {
            name: value
            for name, value in sorted(os.environ.items())
            if RELEVANT_ENV.match(name) and name != env_vars.CONFIG_SOURCES
        },
        "settings": describe(origins),
        **({"config_not_used": warnings} if warnings else {}),
    }


def format_text(report: dict[str, Any]) -> str:
    """The report as aligned `key: value` lines, ready to paste into an issue."""
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(f"{key}:" + ("" if value else " (none)"))
            lines.extend(f"  {name}: {item}" for name, item in value.items())
        elif key == "settings":
            lines.append(
                "settings (code argument > launch flag > UNISON_* variable > config file > default):"
            )
            lines.extend(f"  {line}" for line in value)
        elif isinstance(value, list):
            lines.append(f"{key}: {', '.join(map(str, value)) or '(none)'}")
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "env",
        help="print versions, devices, backends and launch variables (for bug reports)",
        description="Print what a bug report needs: versions, devices, backends and launch variables.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="the launch settings file to show origins from (default: ./unison.toml when present)",
    )
    parser.set_defaults(run=lambda args: run(args, parser))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        report = collect(args.config)
    except ConfigError as error:
        parser.error(str(error))
    sys.stdout.write((json.dumps(report, indent=2) if args.json else format_text(report)) + "\n")
    return 0
