"""Find a model's repeated blocks (the transformer layers): the unit that ZeRO-3 shards and gathers.

One finder serves the memory estimator and the sharding wrappers, so the layer the estimate talks
about is the layer the run wraps.
"""

from __future__ import annotations

import torch.nn as nn


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    """The model's largest (by parameters) ModuleList/Sequential whose children share one class.

    Returns (qualified name, container), or None when the model has no such list. A list of one
    class is what a transformer's layer stack looks like; mixed lists (a head of Linear + ReLU) are
    skipped because wrapping their members one by one gains nothing.
    """
    best, best_size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0:
            if len({type(child) for child in module}) != 1:
                continue
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = (name, module), size
    return best
