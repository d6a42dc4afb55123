"""Module names and the patterns plans key them by ('model.layers.*.self_attn.q_proj'), shared by the
tensor-parallel plans, their checks and the adapter layers they see through."""

from __future__ import annotations

from fnmatch import fnmatch

import torch.nn as nn


def join_names(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def leaf_name(pattern: str) -> str:
    return pattern.rpartition(".")[2]


def matching_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs `parallelize_module` applies `pattern` to: fnmatch per name part."""
    found = [("", model)]
    for token in pattern.split("."):
        found = [
            (join_names(prefix, name), child)
            for prefix, module in found
            for name, child in module.named_children()
            if fnmatch(name, token)
        ]
    return found
