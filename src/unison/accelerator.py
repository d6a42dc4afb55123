"""The `Accelerator`: the one object a training script holds.

It owns no algorithm. It reads the shared process state, then delegates: prepare() to `preparation`
(data loaders to `data`, model wrapping to `parallel`, optimizer/scheduler gating to `optim`), the
training step to `training_step`, autocast and loss scaling to `precision`, collectives to `ops`.
Names and defaults follow Hugging Face Accelerate so that a script migrates by changing its import line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader

from . import env_vars, ops
from .checkpoint import (
    ProjectConfiguration,
)
from .checkpoint.methods import CheckpointMethods
from .collectives import CollectiveMethods
from .configs import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    resolve_accumulation,
    resolve_dataloader_config,
)
from .data import skip_first_batches
from .device_memory import release_memory
from .item_count import ItemCount
from .kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    check_process_group_kwargs,
    sort_kwargs_handlers,
)
from .numerics import NumericsNotice, resolve_numerics
from .observing.profiling import profile
from .observing.tracking.base import GeneralTracker, LoggerType, resolve_log_with
from .observing.tracking.methods import TrackingMethods
from .optim import AcceleratedOptimizer, AcceleratedScheduler
from .parallel.checkpointing import resolve_mode
from .parallel.checkpointing_modes import normalize_mode
from .parallel.compiling import TorchDynamoPlugin, resolve_dynamo_plugin
from .parallel.config import ParallelismConfig, auto_options, is_auto
from .parallel.ddp import check_data_parallel_devices, unwrap
from .parallel.join import join_uneven_inputs
from .parallel.mesh import build_device_mesh, data_parallel_mesh
from .parallel.ranks import LayoutProperties
from .planning.planner import Plan
from .plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin, resolve_plugins
from .precision import PrecisionPolicy, check_convert_outputs
from .preparation import PreparationMethods
from .state import AcceleratorState, DistributedType, GradientState
from .training_step import TrainingStepMethods

logger = logging.getLogger("unison")


def _validate_accumulation_steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"gradient_accumulation_steps={value!r} is not allowed: it is the number of micro-batches per "
            "optimizer step, a whole number >= 1. Pass e.g. gradient_accumulation_steps=4 (1: none)."
        )
    return value


class Accelerator(
    PreparationMethods,
    TrainingStepMethods,
    CheckpointMethods,
    CollectiveMethods,
    TrackingMethods,
    LayoutProperties,
):
    """Prepares model, optimizer, scheduler and data loaders for the processes this script runs in.

    Arguments left as None take their value from the `unison launch` flags (through the UNISON_*
    environment variables of `unison.env_vars`), else the defaults below; arguments given in code
    always win. `convert_outputs_to_fp32` (unison's): under mixed precision, True hands every floating
    output of a prepared model back in fp32 (Accelerate), False none, None (default) all but the logits
    of a model that returned its own loss (see PrecisionPolicy.outputs_to_fp32). `numerics` (unison's):
    "unison" (default) or "accelerate" for Accelerate's numbers where the two deliberately differ (a
    short accumulation window, the scheduler's steps and a shuffled loader's order on several
    processes); None reads UNISON_NUMERICS.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        dispatch_batches: bool | None = None,
        even_batches: bool | None = None,
        rng_types: list[str] | None = None,
        step_scheduler_with_optimizer: bool = True,
        timeout: float | timedelta | None = None,
        kwargs_handlers: list | None = None,
        project_config: ProjectConfiguration | None = None,
        project_dir: str | os.PathLike | None = None,
        parallelism: ParallelismConfig | str | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        log_with: str | LoggerType | GeneralTracker | list | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        deepspeed_plugins: Any = None,
        convert_outputs_to_fp32: bool | None = None,
        activation_checkpointing: str | bool | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        numerics: str | None = None,
    ):
        check_convert_outputs(convert_outputs_to_fp32)  # before any state exists, on every process
        numerics, chosen, overridden = resolve_numerics(numerics)  # a bad value fails here, on every process
        # Accelerate's FSDP / DeepSpeed plugins name a layout (plus precision and accumulation): plugins/
        parallelism, mixed_precision, gradient_accumulation_steps, plugin = resolve_plugins(
            (fsdp_plugin, deepspeed_plugin, deepspeed_plugins),
            parallelism,
            mixed_precision,
            gradient_accumulation_steps,
        )
        handlers = sort_kwargs_handlers(kwargs_handlers)
        self.log_with = resolve_log_with(log_with)  # a tracker that is unknown or not installed: now
        self.trackers: list[GeneralTracker] = []
        # Accelerate 1.x's configuration objects, or the older direct arguments (given both ways: must agree)
        self.dataloader_config = resolve_dataloader_config(
            dataloader_config,
            split_batches=split_batches,
            dispatch_batches=dispatch_batches,
            even_batches=even_batches,
        )
        self.gradient_accumulation_plugin = resolve_accumulation(
            gradient_accumulation_plugin, gradient_accumulation_steps
        )
        gradient_accumulation_steps = self.gradient_accumulation_plugin.num_steps
        if gradient_accumulation_steps is None:
            gradient_accumulation_steps = env_vars.env_int(env_vars.GRADIENT_ACCUMULATION_STEPS, 1)
        self.gradient_accumulation_steps = _validate_accumulation_steps(gradient_accumulation_steps)
        # torch.compile at prepare() (None: off); an unknown backend fails here, on every process
        self.dynamo_plugin = resolve_dynamo_plugin(dynamo_backend, dynamo_plugin)
        if timeout is None and InitProcessGroupKwargs in handlers:
            timeout = handlers[InitProcessGroupKwargs].timeout
        self.state = AcceleratorState(mixed_precision=mixed_precision, cpu=cpu, timeout=timeout)
        self.state.fsdp_plugin = plugin if isinstance(plugin, FullyShardedDataParallelPlugin) else None
        self.state.deepspeed_plugin = plugin if isinstance(plugin, DeepSpeedPlugin) else None
        check_process_group_kwargs(
            handlers.get(InitProcessGroupKwargs), self.state.backend, self.state.device
        )
        self.gradient_state = GradientState(gradient_accumulation_steps=self.gradient_accumulation_steps)
        self._numerics = NumericsNotice(numerics, self.state.is_main_process, chosen)  # numerics.py
        if overridden is not None and self.is_main_process:
            logger.warning(overridden)
        self.device_placement = device_placement
        self.rng_types = rng_types
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.ddp_kwargs = handlers.get(
            DistributedDataParallelKwargs, DistributedDataParallelKwargs()
        ).changed_kwargs()
        scaler_kwargs = handlers.get(GradScalerKwargs, GradScalerKwargs()).changed_kwargs()
        autocast_kwargs = handlers.get(AutocastKwargs, AutocastKwargs()).changed_kwargs()
        self.profile_handler: ProfileKwargs | None = handlers.get(ProfileKwargs)
        self.precision = PrecisionPolicy(
            self.state.mixed_precision, self.device, scaler_kwargs, autocast_kwargs, convert_outputs_to_fp32
        )
        self.step = 0  # micro-steps since the last sync (Accelerate's meaning)
        self._window_micro_steps = self.gradient_accumulation_steps  # of the window in progress
        self._in_accumulate = False  # inside accumulate(): see TrainingStepMethods._end_backward
        self._warned_outside_accumulate = False
        self._trigger = False  # set_trigger / check_trigger
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoader] = []
        # Weak: a prepared object that was freed must not be mistaken for a new one at its address.
        self._prepared: weakref.WeakSet = weakref.WeakSet()
        self._item_count = ItemCount()  # items behind summed losses, see backward(num_items=...)
        self._custom_objects: list[Any] = []
        self._autocast_hooks: dict[int, list] = {}  # id(user's module) -> its autocast hooks' handles
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to them (see checkpoint/methods.py)
        self._save_state_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._load_state_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        if parallelism is None:
            parallelism = env_vars.env_str(env_vars.PARALLELISM, "ddp")
        normalize_mode(activation_checkpointing)  # a bad mode fails here, on every rank, before any work
        self._activation_checkpointing = activation_checkpointing  # see _set_layout
        self.plan: Plan | None = None  # the planner's verdict, when parallelism="auto"
        self.parallelism: ParallelismConfig | None = None
        self.device_mesh: DeviceMesh | None = None
        self._auto_options = auto_options(parallelism) if is_auto(parallelism) else {}  # bad facts fail here
        if not is_auto(parallelism):  # "auto": chosen from the first model prepare() sees
            # Pure check of the degrees against the world size: every rank raises the same error, before work.
            asked = ParallelismConfig.coerce(parallelism)
            self._set_layout(asked.validate(self.num_processes))
            note = asked.unsharded_note(self.num_processes)
            if note is not None and self.is_main_process:
                logger.warning(note)
        # id(parameter before prepare) -> its sharded replacement, for optimizers built before prepare().
        self._replaced_parameters: dict[int, torch.nn.Parameter | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Picklable, as Accelerate's is (a spawned worker may receive it): the weak set of prepared
        objects travels as a list."""
        return {**self.__dict__, "_prepared": list(self._prepared)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _prepared=weakref.WeakSet(state["_prepared"]))

    def _set_layout(self, config: ParallelismConfig) -> None:
        if config.legacy_data_parallel:
            check_data_parallel_devices(torch.cuda.device_count() if self.device.type == "cuda" else 0)
        exported = env_vars.env_str(env_vars.ACTIVATION_CHECKPOINTING, "none")
        config = resolve_mode(config, self._activation_checkpointing, exported).validate(config.total_size)
        self.parallelism = config
        self.device_mesh = build_device_mesh(config, self.device.type)

    # -- data loader settings (the dataloader_config's) ---------------------------------------------
    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def numerics(self) -> str:
        """Whose numbers this run computes where unison and Accelerate differ: "unison" or "accelerate"."""
        return self._numerics.numerics

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The DeepSpeedPlugin this run was given (run on torch's engines), else None, as Accelerate's."""
        return self.state.deepspeed_plugin

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    # -- process facts (the shared state's) ---------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def data_parallel_index(self) -> int:
        """Which share of each batch this process reads: its rank among the data-parallel processes
        (0..parallelism.dp_size - 1). Tensor-parallel and pipeline peers read the same share."""
        dp_mesh = data_parallel_mesh(self.device_mesh)
        return dp_mesh.get_local_rank() if dp_mesh is not None else 0

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    def wait_for_everyone(self, name: str | None = None) -> None:
        """Barrier over every process; `name` labels it in a hang report (which ranks never arrived)."""
        self.state.wait_for_everyone(name)

    def main_process_first(self) -> contextlib.AbstractContextManager:
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        return self.state.local_main_process_first()

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager:
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    def on_main_process(self, function: Callable) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int = 0) -> Callable:
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int = 0) -> Callable:
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def set_trigger(self) -> None:
        """Raise a flag on this process (e.g. its loss went NaN); `check_trigger` tells every process."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process called set_trigger since the last check (then cleared).

        Collective: call it at the same point on every process, e.g. once per step to stop together.
        """
        flag = torch.tensor([1.0 if self._trigger else 0.0], device=self.device)
        self._trigger = False
        return bool(ops.reduce(flag, "sum").item() > 0)

    def print(self, *args, **kwargs) -> None:
        self.state.print(*args, **kwargs)

    # -- prepare -------------------------------------------------------------------------------
    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        return skip_first_batches(dataloader, num_batches)

    def join_uneven_inputs(
        self, joinables: list[torch.nn.Module], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager:
        """torch's Join over the DDP models while the prepared loaders run with `even_batches`, so
        processes with fewer batches do not hang the others (Accelerate's; see parallel/join.py)."""
        return join_uneven_inputs(
            self._layout_needed("join_uneven_inputs()"),
            self._dataloaders,
            joinables,
            even_batches,
            default_even_batches=self.even_batches,
            accumulation_steps=self.gradient_accumulation_steps,
            sync_with_dataloader=self.gradient_accumulation_plugin.sync_with_dataloader,
        )

    def profile(self, profile_handler: ProfileKwargs | None = None) -> contextlib.AbstractContextManager:
        """torch.profiler over the block, with `profile_handler` (default: the ProfileKwargs given in
        kwargs_handlers); yields the profiler. With output_trace_dir every process writes its Chrome trace
        there, so every process must enter it (see profiling.py)."""
        return profile(profile_handler or self.profile_handler or ProfileKwargs())

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module inside the wrappers prepare() added; if the user compiled it before prepare(),
        its torch.compile OptimizedModule, unless keep_torch_compile=False (as in Accelerate).

        Under mixed precision its forward still runs in autocast; keep_fp32_wrapper=False removes that
        from the module for good (as in Accelerate), e.g. before exporting it.
        """
        if not keep_fp32_wrapper:
            for handle in self._autocast_hooks.pop(id(unwrap(model)), []):
                handle.remove()
        return unwrap(model, keep_torch_compile)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object (models, optimizers, schedulers, loaders) and the step counters,
        then release `objects` as `release_memory` does: between two trainings in one script."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._custom_objects.clear()
        self._replaced_parameters.clear()
        self._item_count = ItemCount()
        self.step = 0
        return release_memory(*objects)

    clear = free_memory  # Accelerate's other name for it

    def end_training(self) -> None:
        """Mark the end of the run: an asynchronous checkpoint in flight is finished, the trackers are
        closed, and every process finishes its work before any goes on to exit."""
        self.wait_for_checkpoint()
        self.finish_trackers()
        self.wait_for_everyone()
