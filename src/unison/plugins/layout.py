"""What an Accelerate plugin asks of unison, and the shared wording of a refused option."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..parallel.config import ParallelismConfig


@dataclass(frozen=True)
class PluginLayout:
    """What a plugin asks for: the layout, and mixed precision / accumulation when it names them."""

    parallelism: ParallelismConfig
    mixed_precision: str | None = None
    gradient_accumulation_steps: int | None = None


def unsupported(plugin: str, option: str, value: Any, advice: str) -> ValueError:
    """The error for an option unison cannot carry out: named, never ignored silently."""
    return ValueError(
        f"{plugin}({option}={value!r}): unison does not support this option (yet), so it cannot be honoured "
        f"and is not ignored silently. {advice}"
    )


def enum_name(value: Any) -> str:
    """An enum member (torch's ShardingStrategy, ...) or a string, as its upper-case name."""
    return str(getattr(value, "name", value)).upper()
