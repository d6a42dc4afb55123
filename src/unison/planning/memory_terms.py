"""The words of a memory estimate: the precisions and their bytes per parameter, the strategies' names,
and byte counts printed in binary units.

Torch-free, so `unison plan --precision` and `unison estimate-memory`'s table need no torch to name
them; the formulas that use them are unison.planning.memory's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # Adam: first and second moment
    activation_bytes: int
    autocast_copy_bytes: int  # per trainable parameter: autocast's 16-bit casts kept for backward
    gathered_bytes: int  # per parameter FSDP2 all-gathers and computes with (its MixedPrecisionPolicy)
    description: str


PRECISIONS: tuple[Precision, ...] = (
    Precision("fp32", 4, 4, 8, 4, 0, 4, "fp32 parameters, gradients and Adam moments"),
    Precision(
        "bf16-mixed", 4, 4, 8, 2, 2, 2, "mixed_precision='bf16': fp32 master params/grads/Adam, bf16 compute"
    ),
    Precision(
        "bf16", 2, 2, 4, 2, 0, 2, "model cast to bf16: bf16 params/grads/Adam moments, no master weights"
    ),
)

# name, label, whether the figure is an estimate rather than exact model-state arithmetic
STRATEGIES: tuple[tuple[str, str, bool], ...] = (
    ("single", "single device", False),
    ("ddp", "DDP", False),
    ("zero1", "ZeRO-1", False),
    ("zero2", "ZeRO-2", False),
    ("zero3", "ZeRO-3", False),
    ("zero3_offload", "ZeRO-3 + offload", False),
    ("tp", "tensor parallel", True),
    ("pp", "pipeline parallel", True),
)


def format_bytes(count: float) -> str:
    """Binary units with two decimals: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} TiB"


def expert_parallel_label(strategy: str) -> str | None:
    """The table's label of an expert-parallel row ("ep8_zero3": "ep8 + ZeRO-3"), None for the others
    (the STRATEGIES above have fixed labels; this row's degree depends on the model and the devices)."""
    return f"{strategy.split('_')[0]} + ZeRO-3" if strategy.startswith("ep") else None
