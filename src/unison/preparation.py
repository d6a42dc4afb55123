"""The Accelerator's prepare(): models, optimizers, schedulers and data loaders for the run's layout.

A mixin, as training_step.py and checkpoint/methods.py are, so accelerator.py stays the façade. It
chooses the layout of parallelism="auto" from the first model, moves or materialises the model
(parallel/materialize.py for meta-built ones), wraps it for the layout (parallel/apply.py), attaches the
precision hooks, and re-points optimizers built before prepare() at the parameters the layout replaced.
It reads `parallelism`, `device_mesh`, `device`, `precision`, `ddp_kwargs`, `dynamo_plugin`,
`device_placement`, `dataloader_config`, `gradient_state` and the lists of prepared objects from the
Accelerator.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .data import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from .health.position import note_gradient_sync
from .optim import AcceleratedOptimizer, AcceleratedScheduler
from .parallel.apply import (
    attach_loss_parallel,
    data_parallel_engine,
    parallelize,
    refuse_stale_optimizers,
    replaced_parameters,
    switch_optimizer_parameters,
)
from .parallel.config import ParallelismConfig
from .parallel.ddp import unwrap
from .parallel.join import check_loader_rounds_even
from .parallel.materialize import deferred_model
from .parallel.mesh import data_parallel_mesh
from .parallel.pipeline import PipelineModel
from .planning.auto import plan_for_this_job

logger = logging.getLogger("unison")

_SCHEDULER_TYPES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_PREPARED_TYPES = (AcceleratedOptimizer, AcceleratedScheduler, DataLoaderShard, DataLoaderDispatcher)


class PreparationMethods:
    """prepare / prepare_model / prepare_optimizer / prepare_scheduler / prepare_data_loader, and the
    layout parallelism="auto" picks at the first prepared model."""

    def _plan_layout(self, model: torch.nn.Module) -> None:
        """parallelism="auto": the planner's layout for `model` on this job's hardware."""
        self.plan = plan_for_this_job(
            model,
            self.num_processes,
            self.state.num_local_processes,
            self.device,
            self.mixed_precision,
            **self._auto_options,
        )
        self._set_layout(self.plan.config.validate(self.num_processes))

    def _layout_needed(self, action: str) -> ParallelismConfig:
        if self.parallelism is None:
            raise ValueError(
                f"{action} needs the parallel layout, which parallelism='auto' chooses from the model: "
                "prepare the model first, or in the same call: accelerator.prepare(model, optimizer, loader)."
            )
        return self.parallelism

    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare each object for this run and return them in the same order (one object: itself).

        Models are prepared before optimizers, and optimizers before schedulers, whatever the order
        given, because each needs the one before it. An object prepare() returned comes back as it is
        (as in Accelerate); the object it replaced is refused with a ValueError.
        """
        if device_placement is None:
            device_placement = [self.device_placement] * len(objects)
        elif len(device_placement) != len(objects):
            raise ValueError(
                f"device_placement has {len(device_placement)} entries for {len(objects)} objects: give one "
                "True/False per object passed to prepare(), or leave it out."
            )
        returned = [self._returned_by_prepare(obj) for obj in objects]
        fresh = [obj for obj, again in zip(objects, returned) if not again]
        for obj in fresh:
            self._check_preparable(obj)
        if self.parallelism is not None:  # the layout is known: refuse a loader before any model is wrapped
            for obj in fresh:
                if isinstance(obj, DataLoader):
                    self._check_loader_rounds(obj)
        result: list[Any] = [
            self._as_prepared(obj) if again else obj for obj, again in zip(objects, returned)
        ]
        for kind in (torch.nn.Module, torch.optim.Optimizer, _SCHEDULER_TYPES, DataLoader):
            for i, obj in enumerate(objects):
                if isinstance(obj, kind) and not returned[i]:
                    result[i] = self._prepare_one(obj, device_placement[i])
        return result[0] if len(result) == 1 else tuple(result)

    def _returned_by_prepare(self, obj: Any) -> bool:
        """An object this Accelerator's prepare() returned, or a prepared optimizer, scheduler or loader
        of another (as after `AcceleratorState._reset_state()`): preparing it again returns it as it is,
        as Accelerate does, instead of wrapping the wrapper."""
        mine = (*self._models, *self._optimizers, *self._schedulers, *self._dataloaders)
        return any(obj is prepared for prepared in mine) or isinstance(obj, _PREPARED_TYPES)

    def _as_prepared(self, obj: Any) -> Any:
        """`obj` (see _returned_by_prepare), counted among this Accelerator's objects as Accelerate does."""
        kind = (
            self._optimizers
            if isinstance(obj, AcceleratedOptimizer)
            else self._schedulers
            if isinstance(obj, AcceleratedScheduler)
            else self._dataloaders
            if isinstance(obj, DataLoader)
            else self._models
        )
        if not any(obj is known for known in kind):
            kind.append(obj)
            self._prepared.add(obj)
        return obj

    def _check_preparable(self, obj: Any) -> None:
        if obj in self._prepared and not self._returned_by_prepare(obj):
            raise ValueError(
                f"this {type(obj).__name__} was already prepared, and prepare() returned another object in "
                "its place: use the object prepare() returned (preparing that one again returns it as it "
                "is), and let go of the original."
            )
        if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, *_SCHEDULER_TYPES, DataLoader)):
            raise TypeError(
                f"prepare() cannot prepare a {type(obj).__module__}.{type(obj).__qualname__}: it takes "
                "torch.nn.Module, torch.optim.Optimizer, torch LR schedulers and torch DataLoader objects. "
                "Leave other objects out of prepare()."
            )

    def _prepare_one(self, obj: Any, device_placement: bool) -> Any:
        if isinstance(obj, torch.nn.Module):
            prepared = self.prepare_model(obj, device_placement=device_placement)
        elif isinstance(obj, torch.optim.Optimizer):
            prepared = self.prepare_optimizer(obj, device_placement=device_placement)
        elif isinstance(obj, DataLoader):
            prepared = self.prepare_data_loader(obj, device_placement=device_placement)
        else:
            prepared = self.prepare_scheduler(obj)
        return prepared

    def _remember(self, original: Any, prepared: Any) -> None:
        self._prepared.update((original, prepared))

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None) -> torch.nn.Module:
        """Move `model` to the device and wrap it for the run's layout (DDP, ZeRO-1/2/3, HSDP, ...)."""
        if self._returned_by_prepare(model):
            return self._as_prepared(model)
        self._check_preparable(model)
        if self.parallelism is None:
            self._plan_layout(model)
        if self.parallelism.pp_size > 1 and self.precision.scaler is not None:
            # each rank holds some stages' gradients: an overflow anywhere skips the step everywhere
            self.precision.scaler.agree_across_processes()
        self._check_ddp_kwargs_apply()
        self._say_pipelines_reduce_every_step()
        if device_placement is None:
            device_placement = self.device_placement
        # built on the meta device (init_empty_weights): sharded first, then each rank's shards only
        deferred = deferred_model(model, self.parallelism, self.device_mesh, self.device)
        # Under offload FSDP2 moves each unit to the device in turn as it shards it and keeps the shards in
        # host memory: moved whole first, a model bigger than the GPU would not fit.
        if device_placement and deferred is None and not self.parallelism.offload:
            model = model.to(self.device)
        before = dict(unwrap(model).named_parameters(remove_duplicate=False))  # names as the user's module's
        if deferred is not None:
            model = deferred.before_parallelize(model)
        prepared = parallelize(
            model,
            self.parallelism,
            self.device_mesh,
            self.device,
            self.ddp_kwargs,
            self.precision.dtype,
            self.dynamo_plugin,
        )
        if deferred is not None:
            deferred.after_parallelize(prepared)
        if isinstance(prepared, DistributedDataParallel):  # DDP, ZeRO-1
            prepared.register_forward_hook(_note_gradient_sync)
        replaced = replaced_parameters(before, unwrap(prepared))
        self._check_no_optimizer_holds(replaced)
        self._replaced_parameters.update(replaced)
        stale = [p for p in before.values() if id(p) in replaced]
        refuse_stale_optimizers(stale, self.parallelism.describe())
        # hooks go where forward runs: the stage modules of a pipeline, else the user's module (inside
        # DDP's wrapper, so that unwrap_model gives it with autocast, as Accelerate's keep_fp32_wrapper)
        user_module = unwrap(prepared)
        for part in prepared.stage_modules if isinstance(prepared, PipelineModel) else [user_module]:
            # a stage before the last sends its outputs to the next stage: in the dtype it computed them
            last = not isinstance(prepared, PipelineModel) or part.stage_index == part.num_stages - 1
            hooks = self.precision.attach_to(part, convert_outputs=last)
            self._autocast_hooks.setdefault(id(user_module), []).extend(hooks)
            if self.parallelism.loss_parallel:
                attach_loss_parallel(part)
        self._remember(model, prepared)
        self._models.append(prepared)
        return prepared

    def _say_pipelines_reduce_every_step(self) -> None:
        """sync_each_batch=False asks for one gradient reduction per accumulation window; under pipeline
        parallelism with data-parallel replicas, torch's schedule reduce-scatters each stage's gradients
        at the end of every schedule step (PipelineStage.perform_reduce_grad), so it cannot be honoured:
        said at prepare(), rather than silently ignored (the numbers are the same either way)."""
        layout = self.parallelism
        if (
            layout.pp_size > 1
            and layout.dp_size > 1
            and self.gradient_accumulation_plugin.sync_each_batch is False
        ):
            logger.warning(
                "sync_each_batch=False under %s: torch's pipeline schedule reduces each stage's gradients "
                "at every micro-step window anyway; only the gradients of weights tied across stages wait "
                "for the window's end.",
                layout.describe(),
            )

    def _check_ddp_kwargs_apply(self) -> None:
        """DistributedDataParallelKwargs configure DDP; a layout whose replicas run on FSDP2 (ZeRO-2/3,
        HSDP, and any data parallelism beside tensor or pipeline parallelism), or with no replicas at
        all across several processes (pure tensor or pipeline parallelism), has no DDP to give them to.
        One process has no wrapper at all, so the same script still runs there unchanged."""
        engine = data_parallel_engine(self.parallelism)
        if not self.ddp_kwargs or engine == "ddp" or (engine == "none" and self.num_processes == 1):
            return
        options = ", ".join(f"{name}={value!r}" for name, value in self.ddp_kwargs.items())
        runs_on = {
            "fsdp": "trains its data-parallel replicas with FSDP2",
            "dataparallel": "trains its replicas with torch.nn.DataParallel",
            "none": "has no data-parallel replicas (one copy of the model, split over the processes)",
        }[engine]
        raise ValueError(
            f"DistributedDataParallelKwargs({options}) configure DDP, but the layout "
            f"{self.parallelism.describe()} {runs_on}, so nothing would apply them. Drop the DDP "
            "options for this layout, or use parallelism='ddp' or 'zero1' (DDP underneath)."
        )

    def _check_no_optimizer_holds(self, replaced: dict[int, torch.nn.Parameter | None]) -> None:
        """An optimizer prepared before its model would keep updating the parameters sharding replaced."""
        for optimizer in self._optimizers:
            if any(id(p) in replaced for group in optimizer.param_groups for p in group["params"]):
                raise ValueError(
                    f"the {type(optimizer.optimizer).__name__} was prepared before its model, but the layout "
                    f"{self.parallelism.describe()} replaces the model's parameters by shards: prepare the "
                    "model first, or both in one call: accelerator.prepare(model, optimizer)."
                )

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Wrap `optimizer` so that step/zero_grad wait for the end of each accumulation window."""
        if self._returned_by_prepare(optimizer):
            return self._as_prepared(optimizer)
        self._check_preparable(optimizer)
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement and optimizer.state:
            # load_state_dict casts the state onto each parameter's device (now the run's device).
            optimizer.load_state_dict(optimizer.state_dict())
        switch_optimizer_parameters(optimizer, self._replaced_parameters)
        layout = self._layout_needed("prepare_optimizer()")
        if layout.zero_stage == 1 and data_parallel_engine(layout) == "ddp":
            from .parallel.zero import shard_optimizer_state  # FSDP2's import cost only where used

            optimizer = shard_optimizer_state(optimizer, self.device_mesh["dp_shard"])
        if (layout.tp_size or 1) > 1:  # state of permuted fused projections saved in the model's own layout
            from .parallel.fused import keep_user_layout_in_optimizer

            keep_user_layout_in_optimizer(optimizer)
        prepared = AcceleratedOptimizer(optimizer, scaler=self.precision.scaler)
        self._remember(optimizer, prepared)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap `scheduler` so it steps once per real optimizer step, whatever the process count
        (under numerics="accelerate": num_processes times unless split_batches, as Accelerate)."""
        if self._returned_by_prepare(scheduler):
            return self._as_prepared(scheduler)
        self._check_preparable(scheduler)
        owners = [opt for opt in self._optimizers if opt.optimizer is getattr(scheduler, "optimizer", None)]
        prepared = AcceleratedScheduler(
            scheduler,
            owners or self._optimizers,
            self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
            num_processes=self.num_processes,
            notice=self._numerics,
        )
        self._remember(scheduler, prepared)
        self._schedulers.append(prepared)
        return prepared

    def _check_loader_rounds(self, data_loader: DataLoader) -> str | None:
        """even_batches=False: a short last round the layout's collectives cannot run is refused; under
        DDP, the warning for a pass begun outside join_uneven_inputs (parallel/join.py)."""
        if self.even_batches:
            return None
        return check_loader_rounds_even(data_loader, self.parallelism, self.split_batches)

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None
    ) -> DataLoader:
        """Re-create `data_loader` so each process reads its own shard, delivered on the device."""
        if self._returned_by_prepare(data_loader):
            return self._as_prepared(data_loader)
        self._check_preparable(data_loader)
        if device_placement is None:
            device_placement = self.device_placement
        layout = self._layout_needed("prepare_data_loader()")
        dp_mesh = data_parallel_mesh(self.device_mesh)
        if self.dispatch_batches and dp_mesh is not None and dp_mesh.size() != self.num_processes:
            raise NotImplementedError(
                f"dispatch_batches=True with the layout {layout.describe()}: process 0 would "
                "scatter batches to every process, but tensor/pipeline ranks must share one. Leave "
                "dispatch_batches unset so that each data-parallel rank reads its own shard."
            )
        unjoined_warning = self._check_loader_rounds(data_loader)
        # Ranks of one tensor-parallel group (or pipeline) read the same batch: shard by data-parallel rank.
        prepared = prepare_data_loader(
            data_loader,
            device=self.device,
            num_processes=layout.dp_size,
            process_index=self.data_parallel_index,
            split_batches=self.split_batches,
            put_on_device=device_placement,
            rng_types=self.rng_types,
            dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches,
            non_blocking=self.non_blocking,
            data_seed=self.dataloader_config.data_seed,
            use_seedable_sampler=self.use_seedable_sampler,
            shuffle_seeded_at_prepare=self._numerics.accelerate,  # Accelerate's order on N processes
        )
        prepared.unjoined_warning = unjoined_warning
        self._remember(data_loader, prepared)
        self._dataloaders.append(prepared)
        return prepared


def _note_gradient_sync(model: DistributedDataParallel, args: Any, output: Any) -> None:
    """After each forward of a DDP model: whether its backward all-reduces, for the hang watchdog, which
    cannot see that all-reduce otherwise (health/position.py)."""
    note_gradient_sync(model.process_group, model.require_forward_param_sync)
