"""Apply a validated layout to a model, in torchtitan's order: pipeline split, tensor parallel, activation
checkpointing, compile, expert parallel (a mixture of experts' experts, `experts.py`), data parallel.

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

import contextlib
import dataclasses
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

from .checkpointing import SELECTIVE_OP, apply_activation_checkpointing
from .compiling import TorchDynamoPlugin, compile_model
from .config import ParallelismConfig
from .ddp import wrap_data_parallel, wrap_ddp
from .engines import is_dtensor
from .mesh import data_parallel_mesh, gradient_mesh
from .pipeline import build_pipeline, split_model

if TYPE_CHECKING:
    from torch.distributed.fsdp import OffloadPolicy

logger = logging.getLogger("unison")


def data_parallel_engine(config: ParallelismConfig) -> str:
    """ "none", "ddp", "fsdp" or "dataparallel": how gradients are combined over data-parallel copies.

    FSDP2 whenever ZeRO-2/3 is asked for, and also with tensor or pipeline parallelism: DDP cannot
    wrap DTensor parameters, and its reducer breaks under torch's pipeline schedules (engine notes,
    tests/test_pipeline.py), so replicas of a TP or PP model are FSDP2 units too. ZeRO-2/3 with offload
    on one process is FSDP2 as well: nothing to shard, but the state to keep in host memory.
    """
    if config.legacy_data_parallel:
        return "dataparallel"
    if (config.cp_size or 1) > 1:
        return "fsdp"  # context-parallel ranks average gradients too; FSDP2 over dp_shard x cp (torchtitan)
    if config.dp_size == 1:
        return "fsdp" if config.offload else "none"  # offload on one process: FSDP2 moves the state
    if config.zero_stage in (2, 3) or (config.tp_size or 1) > 1 or (config.pp_size or 1) > 1:
        return "fsdp"
    return "ddp"


def fsdp_stage(config: ParallelismConfig) -> int:
    """The ZeRO stage FSDP2 runs: 3 reshards parameters after forward; 2 (and replicas under TP) keep them.

    With tensor or pipeline parallelism and no sharding asked for (pure replicas, or ZeRO-1), FSDP2
    stands in for DDP with `reshard_after_forward=False`: the same arithmetic, gradients
    reduce-scattered instead of all-reduced (the same bytes on the wire), less memory than DDP holds.
    """
    return 3 if config.zero_stage == 3 else 2


def parallelize(
    model: nn.Module,
    config: ParallelismConfig,
    mesh: DeviceMesh | None,
    device: torch.device,
    ddp_kwargs: dict[str, Any],
    param_dtype: torch.dtype | None = None,
    dynamo: TorchDynamoPlugin | None = None,
) -> nn.Module:
    """Wrap `model` (already on `device`) for `config` over `mesh`; returns the module to train.

    Under pipeline parallelism that is a `PipelineModel` holding this rank's stages, each already
    tensor-parallel and data-parallel as the layout says. Call on every rank with the same arguments:
    the wrappers create and use process groups.
    param_dtype: the mixed-precision compute dtype (bf16, fp16), or None in full precision; FSDP2 then
    gathers in it the parameters autocast casts to it, the others in fp32 (precision_units.py).
    dynamo: compile the model (per block) before the data-parallel engine wraps it, or None.
    """
    if (config.pp_size or 1) == 1:
        return _parallelize_part(model, config, mesh, device, ddp_kwargs, param_dtype, dynamo)
    pp_mesh = mesh["pp"]
    if (config.tp_size or 1) > 1 and config.tp_plan is not None:
        from .tensor import check_tensor_parallel

        check_tensor_parallel(model, config.tp_size, config.tp_plan)  # the plan is the whole model's
    stages = split_model(
        model, pp_mesh.get_local_rank(), config.pp_size, config.pp_split_points, config.pp_schedule
    )
    parts = [
        (
            index,
            _parallelize_part(
                stage, _for_stage(config, stage), mesh, device, ddp_kwargs, param_dtype, dynamo
            ),
        )
        for index, stage in stages
    ]
    return build_pipeline(parts, pp_mesh, config.pp_schedule, pipeline_microbatches(config), device)


def _for_stage(config: ParallelismConfig, stage: nn.Module) -> ParallelismConfig:
    """`config` with its user tensor-parallel plan cut to the keys that name modules of this stage
    (the plan was checked against the whole model: an embedding's key belongs to the first stage)."""
    if (config.tp_size or 1) == 1 or config.tp_plan is None:
        return config
    from .tensor import matching_modules

    plan = {key: style for key, style in config.tp_plan.items() if matching_modules(stage, key)}
    return dataclasses.replace(config, tp_plan=plan)


def pipeline_microbatches(config: ParallelismConfig) -> int:
    """Micro-batches per pipeline step: the config's, else pp_size (the fewest that keep 1F1B busy)."""
    return config.pp_microbatches or config.pp_size


def _parallelize_part(
    model: nn.Module,
    config: ParallelismConfig,
    mesh: DeviceMesh | None,
    device: torch.device,
    ddp_kwargs: dict[str, Any],
    param_dtype: torch.dtype | None,
    dynamo: TorchDynamoPlugin | None = None,
) -> nn.Module:
    """Tensor parallel, activation checkpointing, compile, then the data-parallel engine, on a whole model
    or one pipeline stage (torchtitan's order: FSDP2 shards blocks whose checkpoint hooks are already
    there, and compiled blocks run those hooks eagerly around the compiled forward)."""
    if (config.tp_size or 1) > 1:
        # A user's plan already says which styles it wants; the two flags choose the built-in plan's.
        builtin = config.tp_plan is None
        from .tensor import apply_tensor_parallel  # DTensor loads only for layouts that use it

        apply_tensor_parallel(
            model,
            mesh["tp"],
            plan=config.tp_plan,
            sequence_parallel=config.sequence_parallel and builtin,
            loss_parallel=config.loss_parallel and builtin,
        )
    if config.activation_checkpointing:
        if config.activation_checkpointing == SELECTIVE_OP and param_dtype is not None:
            _refuse_op_level_under_sharded_precision(config)
        apply_activation_checkpointing(model, config.activation_checkpointing, config.zero_blocks)
    compile_model(model, dynamo, config)
    engine = data_parallel_engine(config)
    trainable = any(p.requires_grad for p in model.parameters())
    # A frozen model (a teacher, a reference model) has nothing for DDP to synchronise, and DDP refuses
    # it: it stays whole, as replicas are. FSDP2 shards it like any other, so ZeRO-3's memory holds.
    if engine == "none" or (not trainable and engine != "fsdp"):
        return model
    if engine == "dataparallel":
        return wrap_data_parallel(model)
    if engine == "ddp":
        return wrap_ddp(model, device, {**ddp_kwargs, "process_group": _dp_group(mesh)})
    from .zero import apply_zero  # FSDP2 loads only for layouts that use it (see engines.py)

    if (config.ep_size or 1) > 1:
        from .experts import apply_expert_parallel, expert_mesh

        mesh_of_experts = expert_mesh(config.ep_size, device.type)
        apply_expert_parallel(model, mesh_of_experts, config.dp_size, fsdp_stage(config) == 3)
    return apply_zero(
        model,
        fsdp_stage(config),
        mesh=gradient_mesh(mesh),
        blocks=config.zero_blocks,
        compute_dtype=param_dtype,  # autocast's: FSDP2 gathers in it what autocast casts (precision_units.py)
        offload_policy=host_offload(device) if config.offload else None,
    )


def _refuse_op_level_under_sharded_precision(config: ParallelismConfig) -> None:
    """Op-level selective checkpointing fails in backward when FSDP2 gathers bf16/fp16 weights (torch
    2.13: "profiler._record_function_enter_new.default encountered during backward but not found in
    storage": FSDP2's mixed-precision hooks record a profiler op in the recomputation that the forward
    did not). Said before any step, with the modes that work."""
    if data_parallel_engine(config) == "fsdp":
        raise ValueError(
            f"activation_checkpointing='selective' (op-level) with mixed precision under "
            f"{config.describe()}: torch's selective checkpointing meets FSDP2's mixed-precision hooks in "
            "the recomputation and fails in backward. Use activation_checkpointing='full' or "
            "'selective:K' (every K-th block), or op-level selective in full precision."
        )


def host_offload(device: torch.device) -> OffloadPolicy:
    """FSDP2's CPUOffloadPolicy for ZeRO-2/3 with offload=true: shards, gradients and optimizer state in
    host memory, pinned for fast copies to and from a GPU.

    On a CPU device the shards live in host memory already: the policy then runs unpinned (pinning needs
    an accelerator), moves nothing anywhere, and saves nothing, which is said once.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy  # FSDP2 loads only for layouts that use it

    if device.type == "cpu":
        logger.info("offload=true on the CPU: parameters already live in host memory, so it saves nothing")
    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


def _dp_group(mesh: DeviceMesh | None):
    """The process group of all data-parallel ranks (None: the default group, when there is no mesh)."""
    dp_mesh = data_parallel_mesh(mesh)
    return dp_mesh.get_group() if dp_mesh is not None and dp_mesh.ndim == 1 else None


def replaced_parameters(before: dict[str, nn.Parameter], model: nn.Module) -> dict[int, nn.Parameter | None]:
    """id(old parameter) -> the parameter now at its name in `model` where it changed (FSDP2), or None
    where `model` no longer has it (a pipeline rank keeps only its stages' parameters)."""
    after = dict(model.named_parameters(remove_duplicate=False))
    mapping: dict[int, nn.Parameter | None] = {}
    kept: set[int] = set()
    for name, old in before.items():
        new = after.get(name)
        if new is old:
            kept.add(id(old))  # a tied weight may survive under one of its names only
        elif new is not None or id(old) not in mapping:
            mapping[id(old)] = new
    return {key: new for key, new in mapping.items() if not (new is None and key in kept)}


def switch_optimizer_parameters(
    optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter | None]
) -> None:
    """Point a not-yet-stepped optimizer at the parameters that replaced the ones it was built from,
    and drop those this rank no longer holds (so a pipeline rank frees the other stages' weights).

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
        swapped = (mapping.get(id(p), p) for p in group["params"])
        group["params"] = [p for p in swapped if p is not None]


_REPLACED_BY = "_unison_replaced_by"
"""Set on a parameter prepare() replaced: the layout that replaced it, for `refuse_stale_optimizers`."""
_stale_step_guard = None  # the handle of the one step pre-hook all optimizers share, once registered


def refuse_stale_optimizers(stale: list[nn.Parameter], layout: str) -> None:
    """Make every later step of an optimizer over one of the `stale` parameters (those the `layout`
    replaced by shards, or moved to another pipeline rank) raise, with the fix, on every process.

    An optimizer built from the model before prepare() and passed to prepare() is switched to the new
    parameters; one that is not keeps the old ones, which no forward uses and no backward gives a
    gradient, so its steps change nothing and the model silently never trains. One step pre-hook common
    to all optimizers (torch's register_optimizer_step_pre_hook) looks at each parameter of an optimizer at
    its first step only (an attribute read, about 50 ns each), and only in a process where a layout
    replaced parameters.
    """
    global _stale_step_guard
    for parameter in stale:
        setattr(parameter, _REPLACED_BY, layout)
    if stale and _stale_step_guard is None:
        _stale_step_guard = register_optimizer_step_pre_hook(_refuse_stale_step)


_checked_optimizers: weakref.WeakSet = weakref.WeakSet()
"""Optimizers whose parameters passed at a step: their later steps are not checked again (a Python loop
over every parameter on every step would sit on the training step's hot path)."""


def _refuse_stale_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked_optimizers:
        return
    for parameter in (p for group in optimizer.param_groups for p in group["params"]):
        layout = getattr(parameter, _REPLACED_BY, None)
        if layout is not None:
            raise RuntimeError(
                f"this {type(optimizer).__name__} steps parameters that prepare() replaced (the layout "
                f"{layout} shards them or puts them on another pipeline rank), so its steps would change "
                "nothing the model uses: it was built from the model before prepare() and never prepared. "
                "Prepare it with the model, accelerator.prepare(model, optimizer), or build it after "
                "prepare() from the prepared model's parameters."
            )
    _checked_optimizers.add(optimizer)


def attach_loss_parallel(model: nn.Module) -> None:
    """Run `model`'s forward inside torch's `loss_parallel()`, so a cross-entropy it computes on
    vocabulary-sharded logits works without gathering them; replicated DTensor outputs (the loss) are
    handed back as plain tensors, so the loop logs and reduces them as usual. Its backward must run in
    `loss_parallel()` too (Accelerator.backward does that)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import loss_parallel

    active: list[contextlib.AbstractContextManager] = []

    def enter(module: nn.Module, args: Any) -> None:
        context = loss_parallel()
        context.__enter__()
        active.append(context)

    def leave(module: nn.Module, args: Any, output: Any) -> Any:
        active.pop().__exit__(None, None, None)
        return tree_map(replicated_to_local, output)

    def replicated_to_local(value: Any) -> Any:
        if is_dtensor(value) and all(isinstance(p, Replicate) for p in value.placements):
            return value.to_local()
        return value

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
