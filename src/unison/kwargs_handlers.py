"""Keyword-argument bundles for the engines unison drives, under Accelerate's names.

`Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])` reads the
same in unison as in Accelerate, so a migrating user keeps these lines. Each bundle holds only the
options a user changed; the rest keep torch's own defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch

from .parallel.comm_hooks import DDPCommunicationHookType, check_hook_options


class _KwargsHandler:
    def changed_kwargs(self) -> dict[str, Any]:
        """The options that differ from their defaults, ready to pass on to torch."""
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }


@dataclass
class DistributedDataParallelKwargs(_KwargsHandler):
    """Options for torch.nn.parallel.DistributedDataParallel (torch's defaults).

    comm_hook / comm_wrapper / comm_state_option register one of torch's DDP communication hooks
    (parallel/comm_hooks.py). Applied where the layout runs DDP (ddp, zero1); refused with a
    ValueError by layouts whose replicas run on FSDP2 (ZeRO-2/3, HSDP, data parallelism beside tensor
    or pipeline parallelism), which have no such options, and by pure tensor or pipeline parallelism
    over several processes, which has no replicas; ignored by a single process, which has no wrapper."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_hook_options(self.comm_hook, self.comm_wrapper, self.comm_state_option)


@dataclass
class AutocastKwargs(_KwargsHandler):
    """Options for torch.autocast in mixed precision: enabled=False runs the prepared models' forward
    (and accelerator.autocast()) in full precision; cache_enabled is torch.autocast's weight-cast cache
    (None: torch's default)."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradScalerKwargs(_KwargsHandler):
    """Options for torch.amp.GradScaler, used with mixed_precision="fp16"."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(_KwargsHandler):
    """Options for the process group, under Accelerate's names.

    timeout is the collectives' limit. The backend follows the device (NCCL on GPUs, gloo on CPUs) and
    the group forms from the launcher's rendezvous (RANK, WORLD_SIZE, MASTER_ADDR/PORT, or SLURM's),
    so `backend` may only name the backend the run uses and `init_method` only "env://": anything
    else is refused (see check_process_group_kwargs) rather than silently not applied.
    """

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


def check_process_group_kwargs(kwargs: InitProcessGroupKwargs | None, backend: str, device: Any) -> None:
    """Refuse the InitProcessGroupKwargs this run cannot apply, naming the option and the fix."""
    if kwargs is None:
        return
    if kwargs.backend is not None and kwargs.backend != backend:
        raise ValueError(
            f"InitProcessGroupKwargs(backend={kwargs.backend!r}): this run's process group uses {backend!r}, "
            f"the backend for its device ({device}): unison picks NCCL for GPUs and gloo for CPUs. Drop "
            "backend=, or run on the device the backend is for (--cpu for gloo)."
        )
    if kwargs.init_method not in (None, "env://"):
        raise ValueError(
            f"InitProcessGroupKwargs(init_method={kwargs.init_method!r}): unison forms the process group "
            "from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, or SLURM's), "
            "as init_method='env://' does. Drop init_method= and pass the address to the launcher: "
            "`unison launch --master-addr HOST --master-port PORT ...`."
        )


_PROFILER_ACTIVITIES = ("cpu", "cuda", "xpu", "mtia", "hpu")  # Accelerate's names, torch's ProfilerActivity


@dataclass
class ProfileKwargs(_KwargsHandler):
    """Options for torch.profiler.profile, used by `Accelerator.profile()` (Accelerate's names and defaults).

    Attributes:
        activities: which of "cpu", "cuda", "xpu", "mtia", "hpu" to record (None: torch's default, the
            CPU and the GPU when there is one); a name this torch has no ProfilerActivity for is refused
            here.
        schedule_option: torch.profiler.schedule's arguments (wait, warmup, active, repeat, skip_first);
            the loop then calls `prof.step()` each step, and `on_trace_ready(prof)` receives each recorded
            cycle (e.g. torch.profiler.tensorboard_trace_handler(dir)).
        record_shapes: torch.profiler.profile's, as are profile_memory, with_stack, with_flops and
            with_modules.
        output_trace_dir: at the end of profile(), each process writes the Chrome trace of what the
            profiler holds then (with a schedule: the cycle in progress) to
            output_trace_dir/profile_<process index>.json, Accelerate's file name; None writes nothing.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        kinds = torch.profiler.ProfilerActivity
        known = [name for name in _PROFILER_ACTIVITIES if hasattr(kinds, name.upper())]
        unknown = [name for name in self.activities or () if name not in known]
        if unknown:
            raise ValueError(
                f"ProfileKwargs(activities={self.activities!r}): {unknown} unknown; choose from {known}."
            )

    def build(self) -> torch.profiler.profile:
        """A torch.profiler.profile with these options, not started (enter it to profile)."""
        activities = None
        if self.activities is not None:
            activities = [getattr(torch.profiler.ProfilerActivity, name.upper()) for name in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


KWARGS_HANDLERS = (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)


def sort_kwargs_handlers(handlers: list | tuple | None) -> dict[type, _KwargsHandler]:
    """Index the handlers by type, refusing unknown objects and a type given twice."""
    by_type: dict[type, _KwargsHandler] = {}
    for handler in handlers or ():
        if not isinstance(handler, KWARGS_HANDLERS):
            names = ", ".join(cls.__name__ for cls in KWARGS_HANDLERS)
            raise TypeError(f"kwargs_handlers got a {type(handler).__name__}; unison accepts {names}.")
        if type(handler) in by_type:
            raise ValueError(
                f"kwargs_handlers holds two {type(handler).__name__} objects: pass one with every option set."
            )
        by_type[type(handler)] = handler
    return by_type
