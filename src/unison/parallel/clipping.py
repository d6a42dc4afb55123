"""Gradient clipping by the whole model's norm, in any layout.

torch's `clip_grad_norm_` stacks per-gradient norms, which fails when a model mixes plain tensors with
DTensors (tensor parallel leaves norms whole) or holds DTensors on two meshes (FSDP2 x TP), and under
pipeline parallelism each rank sees only its stages. Here the norm is taken per mesh
(`tensor.total_grad_norm`), combined over the pipeline ranks, and every gradient is scaled by it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .engines import is_dtensor


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    counted_once: set[int] | None = None,
    pipeline_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale the gradients of `parameters` so their total norm is at most `max_norm`; return that norm.

    counted_once: ids of the parameters whose gradients enter the norm (a weight tied across pipeline
        stages is held by two ranks but counted on one); None counts them all.
    pipeline_group: the ranks whose stages' norms make up the whole model's (None: this rank's alone).
    """
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if pipeline_group is None and not any(is_dtensor(p) for p in parameters):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)  # whole, plain gradients
    from .tensor import total_grad_norm  # DTensor-aware: loaded by the layouts that get here

    counted = parameters if counted_once is None else [p for p in parameters if id(p) in counted_once]
    norm = total_grad_norm(counted, norm_type)
    if pipeline_group is not None:
        norm = _combine_norms(norm, norm_type, pipeline_group)
    # torch's foreach kernels refuse a list mixing DTensors of different meshes or with plain tensors
    groups: dict[Any, list[torch.Tensor]] = {}
    for parameter in parameters:
        key = id(parameter.device_mesh) if is_dtensor(parameter) else None
        groups.setdefault(key, []).append(parameter)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def _combine_norms(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """The norm of the concatenation of the pieces whose norms the ranks of `group` hold."""
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)
