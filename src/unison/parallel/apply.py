"""Apply a validated layout to a model, in torchtitan's order: pipeline split, tensor parallel, data parallel.

Each strategy is a plain function of its own module (`pipeline`, `tensor`, `zero`, `ddp`); this module
only decides which run, on which sub-mesh of the one DeviceMesh, and in what order:

1. the data-parallel engine is chosen from the degrees: DDP for replicas only (and for ZeRO-1, whose
   sharding lives in the optimizer), FSDP2 `fully_shard` for ZeRO-2/3 over `dp_shard` (a 2-D
   (dp_replicate, dp_shard) mesh gives HSDP), and FSDP2 over the data-parallel dims whenever tensor
   parallelism is present, since DDP cannot wrap DTensor parameters (engine notes).
2. FSDP2 replaces parameters by new DTensor parameters, so `replaced_parameters` maps each old
   parameter to its replacement for optimizers built before prepare().
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .config import ParallelismConfig
from .ddp import wrap_data_parallel, wrap_ddp
from .mesh import data_parallel_mesh
from .zero import apply_zero

logger = logging.getLogger("unison")


def data_parallel_engine(config: ParallelismConfig) -> str:
    """ "none", "ddp" or "fsdp": how gradients are combined over the data-parallel dimensions."""
    if config.dp_size == 1:
        return "none"
    if config.zero_stage in (2, 3) or (config.tp_size or 1) > 1:
        return "fsdp"
    return "ddp"


def fsdp_stage(config: ParallelismConfig) -> int:
    """The ZeRO stage FSDP2 runs: 3 reshards parameters after forward; 2 (and replicas under TP) keep them.

    With tensor parallelism and no sharding asked for (pure replicas, or ZeRO-1), FSDP2 stands in for
    DDP with `reshard_after_forward=False`: the same arithmetic, gradients reduce-scattered instead of
    all-reduced (the same bytes on the wire), and less memory than DDP would hold.
    """
    return 3 if config.zero_stage == 3 else 2


def parallelize(
    model: nn.Module,
    config: ParallelismConfig,
    mesh: DeviceMesh | None,
    device: torch.device,
    ddp_kwargs: dict[str, Any],
) -> nn.Module:
    """Wrap `model` (already on `device`) for `config` over `mesh`; returns the module to train.

    Call on every rank with the same arguments: the wrappers create and use process groups.
    """
    engine = data_parallel_engine(config)
    if engine == "none" or not any(p.requires_grad for p in model.parameters()):
        return model
    if engine == "dataparallel":
        return wrap_data_parallel(model)
    if engine == "ddp":
        return wrap_ddp(model, device, {**ddp_kwargs, "process_group": _dp_group(mesh)})
    return apply_zero(model, fsdp_stage(config), mesh=_fsdp_mesh(mesh))


def _dp_group(mesh: DeviceMesh | None):
    """The process group of all data-parallel ranks (None: the default group, when there is no mesh)."""
    dp_mesh = data_parallel_mesh(mesh)
    return dp_mesh.get_group() if dp_mesh is not None and dp_mesh.ndim == 1 else None


def _fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp_shard, or (dp_replicate, dp_shard) for HSDP, or dp_replicate alone."""
    names = [name for name in ("dp_replicate", "dp_shard") if name in mesh.mesh_dim_names]
    return mesh[tuple(names)] if len(names) == 2 else mesh[names[0]]


def replaced_parameters(before: dict[str, nn.Parameter], model: nn.Module) -> dict[int, nn.Parameter]:
    """id(old parameter) -> the parameter now at the same name in `model`, for those that changed."""
    after = dict(model.named_parameters(remove_duplicate=False))
    return {id(old): after[name] for name, old in before.items() if name in after and after[name] is not old}


def switch_optimizer_parameters(optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    """Point a not-yet-stepped optimizer at the parameters that replaced the ones it was built from.

    Optimizers read `param_groups` on every step, so swapping the entries is enough while no state
    (keyed by parameter) exists yet.
    """
    stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) in mapping]
    if not stale:
        return
    if any(optimizer.state.values()):
        raise RuntimeError(
            f"{type(optimizer).__name__} already holds state, but the model it optimizes was re-sharded by "
            "prepare(): create the optimizer before its first step and prepare it with the model."
        )
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]
