"""ZeRO data parallelism (stages 1, 2, 3) as plain functions over a module, on torch's own engines.

- ZeRO-1 shards only the optimizer state: the model stays under DDP (full parameters and gradients,
  one all-reduce per step) and `torch.distributed.optim.ZeroRedundancyOptimizer` gives each rank the
  state of a share of the parameters, then broadcasts the updated shares after `step()`.
- ZeRO-2 adds sharded gradients: FSDP2 `fully_shard(..., reshard_after_forward=False)` reduce-scatters
  gradients to shards and keeps the parameters gathered from forward to backward.
- ZeRO-3 adds sharded parameters: `fully_shard` on every block, then on the root, gathering one
  block's parameters at a time in forward and again in backward.

The FSDP2 stages replace the module's parameters by DTensor shards in place, so an optimizer must be
built from `model.parameters()` after `apply_zero`. ZeroRedundancyOptimizer has to be built from the
parameters too; `shard_optimizer_state` rebuilds one from an existing, not yet stepped optimizer.

ZeroRedundancyOptimizer's module is imported only where ZeRO-1 is used: importing it binds
`group=dist.group.WORLD` into a default argument, which then holds a group formed earlier past
destroy_process_group, and a gloo group alive at the interpreter's teardown can abort the process
(docs/failures.md, "Known limits").
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from unison.parallel.blocks import find_blocks
from unison.parallel.comm_hooks import register_comm_hook, split_hook_options
from unison.parallel.outputs import hook_ddp_outputs, hook_sharded_outputs
from unison.parallel.precision_units import shard_as_autocast

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

logger = logging.getLogger("unison")

ZERO_STAGES = (1, 2, 3)


def resolve_blocks(model: nn.Module, blocks: Sequence[nn.Module] | str | None) -> list[nn.Module]:
    """The modules to shard one by one: the user's (modules, or the name of a container), else found.

    An empty list means the model has no block list; it is then sharded as one unit.
    """
    if blocks is None:
        found = find_blocks(model)
        return list(found[1]) if found is not None else []
    if isinstance(blocks, str):
        try:
            return list(model.get_submodule(blocks).children())
        except AttributeError:
            pass
        # Accelerate's transformer_cls_names_to_wrap: every module of these classes, in model order
        classes = {name.strip() for name in blocks.split(",")}
        matching = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
        if not matching:
            raise ValueError(
                f"blocks={blocks!r}: the model has no submodule of that name and no module of a class so "
                "named. Give the qualified name of the block list (e.g. 'transformer.h'), block class names "
                "(e.g. 'GPT2Block,LlamaDecoderLayer'), a list of modules, or None to find it."
            )
        return matching
    modules = list(blocks)
    owned = {id(m) for m in model.modules()}
    foreign = [type(m).__name__ for m in modules if id(m) not in owned]
    if foreign:
        raise ValueError(
            f"blocks: {len(foreign)} of the given modules ({', '.join(foreign[:3])}) are not submodules "
            "of the model. Pass modules taken from the model being wrapped."
        )
    return modules


def apply_zero(
    model: nn.Module,
    stage: int,
    mesh: DeviceMesh | None = None,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    blocks: Sequence[nn.Module] | str | None = None,
    offload_policy: OffloadPolicy | None = None,
    ddp_kwargs: dict[str, Any] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Wrap `model` (already on its device, process group initialised) for ZeRO `stage` over `mesh`.

    `mesh`: the data-parallel mesh (1-D; 2-D (replicate, shard) gives HSDP for stages 2 and 3), or
    None for all processes. Stage 1 returns a DDP module (pair it with `shard_optimizer_state`);
    stages 2 and 3 shard in place and return the same module, now an FSDPModule.
    `mixed_precision_policy`: FSDP2's policy, applied to every unit as given. `compute_dtype`: instead,
    the dtype of autocast running on top: each unit gathers in it only the parameters autocast casts
    to it, so a step computes what one process under autocast computes (precision_units.py).
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage={stage!r} is not supported; choose one of {ZERO_STAGES}.")
    if stage == 1 and blocks is not None:
        raise ValueError(
            "ZeRO stage=1 runs the model whole under DDP, so blocks= (the units ZeRO-2/3 shard one by one) "
            "would be ignored: drop blocks, or use stage 2 or 3."
        )
    if stage != 1 and ddp_kwargs:
        raise ValueError(
            f"ZeRO stage={stage} runs on FSDP2, which takes no DDP options ({', '.join(ddp_kwargs)}): drop "
            "ddp_kwargs, or use stage 1 (DDP underneath)."
        )
    if mixed_precision_policy is not None and compute_dtype is not None:
        raise ValueError(
            f"apply_zero got both mixed_precision_policy and compute_dtype={compute_dtype}: the policy "
            "gathers every parameter in its param_dtype, compute_dtype only those autocast casts. Pass one."
        )
    if stage == 1:
        if mixed_precision_policy is not None or offload_policy is not None or compute_dtype is not None:
            raise ValueError(
                "ZeRO stage=1 runs the model under DDP, which takes no mixed_precision_policy, compute_dtype "
                "or offload_policy. Use autocast for mixed precision, or ZeRO stage 2/3 for these policies."
            )
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(
                f"ZeRO stage=1 needs a 1-D data-parallel mesh, got {mesh.ndim} dims {mesh.mesh_dim_names}. "
                "Pass the data-parallel sub-mesh, e.g. mesh['dp']."
            )
        device = next(model.parameters()).device
        constructor, hook = split_hook_options(ddp_kwargs or {})
        wrapped = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=mesh.get_group() if mesh is not None else None,
            **constructor,
        )
        register_comm_hook(wrapped, **hook)
        hook_ddp_outputs(wrapped)  # outputs in any container (outputs.py)
        return wrapped
    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    shard_kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": stage == 3}
    if mixed_precision_policy is not None:
        shard_kwargs["mp_policy"] = mixed_precision_policy
    if offload_policy is not None:
        shard_kwargs["offload_policy"] = offload_policy
    units = resolve_blocks(model, blocks)
    if not units:
        logger.warning(
            "ZeRO-%d: no block list found in %s; sharding it as one unit, so all its parameters are "
            "gathered at once. Pass blocks= to shard layer by layer.",
            stage,
            type(model).__name__,
        )
    if compute_dtype is not None:
        shard_as_autocast(model, units, compute_dtype, **shard_kwargs)
    else:
        for unit in [*units, model]:
            fully_shard(unit, **shard_kwargs)
    # every unit (and any sharded before, as expert parallelism's experts): outputs in any container
    hook_sharded_outputs(model)
    return model


def shard_optimizer_state(
    optimizer: torch.optim.Optimizer, mesh: DeviceMesh | None = None
) -> ZeroRedundancyOptimizer:
    """ZeRO-1: the same optimizer (class, param groups, hyper-parameters) with its state sharded.

    ZeroRedundancyOptimizer builds its per-rank inner optimizer from the parameters, so this takes the
    user's optimizer apart and builds a new one; it must not have stepped yet (its state would be lost).
    The new one shares the user's param-group dicts, so schedulers (and anything else) that change a
    group's lr through the user's optimizer still drive the training.
    The overlap-with-DDP mode is not used: its comm hook refuses gloo.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if any(optimizer.state.values()):
        raise RuntimeError(
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameters; ZeRO-1 "
            "rebuilds the optimizer and would drop it. Shard the optimizer before its first step."
        )
    # `defaults` may hold keys the constructor does not take (AdamW: decoupled_weight_decay); the
    # param groups carry every value, so the constructor gets only the keywords it accepts.
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    sharded = ZeroRedundancyOptimizer(
        # The user's group dicts themselves, not copies: a learning-rate scheduler built on the user's
        # optimizer writes into these dicts, and ZeroRedundancyOptimizer reads them at every step.
        optimizer.param_groups,
        optimizer_class=type(optimizer),
        process_group=mesh.get_group() if mesh is not None else None,
        **defaults,
    )
    sharded.register_load_state_dict_post_hook(_keep_shared_groups(sharded.param_groups))
    return sharded


def _keep_shared_groups(shared: list[dict[str, Any]]) -> Callable[[torch.optim.Optimizer], None]:
    """A load_state_dict post-hook that keeps ZeRO-1 reading the user's group dicts.

    torch's load_state_dict replaces an optimizer's param-group dicts by new ones: the scheduler, which
    writes into the user's dicts, would stop reaching the optimizer that steps, and a resumed run would
    train on with the loaded learning rate for good. The loaded values go into the shared dicts, which
    take their place again.
    """

    def hook(optimizer: torch.optim.Optimizer) -> None:
        for group, loaded in zip(shared, optimizer.param_groups, strict=True):
            group.update(loaded)
        optimizer.param_groups = shared

    return hook


def full_state_dict(model: nn.Module, all_ranks: bool = False) -> dict[str, torch.Tensor]:
    """The consolidated, unsharded model state dict on CPU, keyed as the unwrapped model's.

    Collective: every rank must call it. Only process 0 receives the tensors (the others get an
    empty dict, which spares their CPU memory) unless `all_ranks` is True.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)
    state = get_model_state_dict(model, options=options)
    if all_ranks:
        state = {
            key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()
        }
    return state
