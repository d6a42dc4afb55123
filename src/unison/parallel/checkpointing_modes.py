"""The activation checkpointing modes' names and their one parser, `normalize_mode`.

A leaf: `ParallelismConfig` validates its field with it, the launch flags and the commands check their
values with it, and the planner names the modes, none of them needing the checkpointing machinery
(`parallel.checkpointing`), which imports `ParallelismConfig` itself. The modes are described there.
"""

from __future__ import annotations

from typing import Any

FULL = "full"
SELECTIVE_OP = "selective:op"
MODES_TEXT = "'full', 'selective' (op-level, = 'selective:op'), 'selective:K' (every K-th block), or 'none'"


def normalize_mode(value: Any, source: str = "activation_checkpointing") -> str | None:
    """The canonical mode for `value` ("full", "selective:op", "selective:K"), or None for no checkpointing.

    Accepts None, False/True (True is "full", as Accelerate's FSDP plugin's boolean), "none"/"no"/"off",
    "full", "selective", "selective:op" and "selective:K" with K >= 1 ("selective:1" is "full"). A pure
    function of the value, so every rank refuses a bad one the same way before any work.
    """
    if value is None or value is False:
        return None
    if value is True:
        return FULL
    if not isinstance(value, str):
        raise ValueError(f"{source}={value!r} is not a mode: pass {MODES_TEXT}.")
    text = value.strip().lower()
    if text in ("", "none", "no", "off", "false"):
        return None
    if text in ("full", "true"):
        return FULL
    if text in ("selective", SELECTIVE_OP):
        return SELECTIVE_OP
    head, colon, every = text.partition(":")
    if head == "selective" and colon and every.isdigit() and int(every) >= 1:
        return FULL if int(every) == 1 else f"selective:{int(every)}"
    raise ValueError(
        f"{source}={value!r} is not an activation checkpointing mode: pass {MODES_TEXT}, e.g. "
        f"{source}=full (every block recomputed in backward)."
    )
