"""Optimizer and LR-scheduler wrappers that know about gradient accumulation and fp16 skips.

While gradients accumulate, `optimizer.step()`, `optimizer.zero_grad()` and `scheduler.step()` do
nothing, so the user's loop calls them every micro-step and the real update happens once per
accumulation window. The scheduler steps exactly once per real optimizer step, whatever the number
of processes: the schedule is written in optimizer steps and means the same on 1 or 64 processes
(Accelerate steps it num_processes times per call unless told otherwise, its issue #2926). Under
numerics="accelerate" (UNISON_NUMERICS=accelerate, numerics.py) it steps as Accelerate's does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .health import watchdog
from .numerics import SCHEDULER_STEPS, NumericsNotice
from .state import GradientState


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer; an `Optimizer` itself so schedulers and utilities accept it.

    The wrapped optimizer does the work; this class only decides *whether* a call happens now and
    routes fp16 steps through the GradScaler (which skips a step whose gradients overflowed).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None):
        # Deliberately no super().__init__: the state lives in the wrapped optimizer.
        self.optimizer = optimizer
        self.scaler = scaler
        self.gradient_state = GradientState()
        self.step_was_skipped = False
        self.num_steps_taken = 0
        self._unscaled = False

    # -- the wrapped optimizer's data, shared rather than copied -------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    # -- torch.optim.Optimizer's hooks: registered on the wrapped optimizer, which runs them when it
    # really steps or saves (hooks receive it, the optimizer that does the work) ---------------------
    def register_step_pre_hook(self, hook: Callable) -> RemovableHandle:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable) -> RemovableHandle:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend=prepend)

    def register_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_state_dict_post_hook(hook, prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend=prepend)

    def register_load_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend=prepend)

    # Optimizer pickles only defaults/state/param_groups and rebuilds its own fields on load; this
    # wrapper's fields are its whole state (copy.deepcopy, pickle).
    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- the calls that accumulation gates ------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale_gradients(self) -> None:
        """Divide fp16 gradients by the loss scale, once per step (before clipping them)."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return None
        self._unscaled = False
        watchdog.first_step_done()  # the shorter stall timeout applies from the next wait on
        if self.scaler is None:
            self.step_was_skipped = False
            self.num_steps_taken += 1
            return self.optimizer.step(closure)
        scale_before = self.scaler.get_scale()
        result = self.scaler.step(self.optimizer, closure) if closure else self.scaler.step(self.optimizer)
        self.scaler.update()
        # GradScaler lowers the scale exactly when it skipped the step for inf/nan gradients.
        self.step_was_skipped = self.scaler.get_scale() < scale_before
        if not self.step_was_skipped:
            self.num_steps_taken += 1
        return result

    def train(self) -> None:
        """Forward to optimizers with train/eval modes (schedule-free optimizers)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """Wraps an LR scheduler so it steps once per real (not skipped) optimizer step.

    With step_with_optimizer=False it steps on every call instead, for schedules written in
    micro-batches (Accelerate's step_scheduler_with_optimizer=False). Under Accelerate's numerics
    (`notice.accelerate`) a real optimizer step steps it `num_processes` times unless split_batches,
    as Accelerate's AcceleratedScheduler does: its batches grew with the processes, so its schedules
    are sized in per-process batches (transformers' no_trainer scripts multiply by num_processes).
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        step_with_optimizer: bool = True,
        split_batches: bool = False,
        num_processes: int = 1,
        notice: NumericsNotice | None = None,
    ):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self.num_processes = num_processes
        self.notice = notice or NumericsNotice("unison", is_main_process=False)
        self.gradient_state = GradientState()

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        if any(optimizer.step_was_skipped for optimizer in self.optimizers):
            return  # fp16 overflow: the optimizer did not step, so neither does the schedule
        times = 1 if self.split_batches else self.num_processes
        if times > 1 and not self.notice.accelerate:
            self.notice.differs(
                SCHEDULER_STEPS,
                f"The prepared scheduler steps once per optimizer step on {times} processes; Accelerate "
                f"steps it {times} times (split_batches=False), so a schedule sized for Accelerate (e.g. "
                f"max_train_steps * num_processes) advances {times}x slower here.",
            )
            times = 1
        capped = self.notice.accelerate and not self.split_batches  # Accelerate's own branch
        with warnings.catch_warnings():
            if self._drives_a_rebuilt_optimizer():
                # torch checks that the scheduler's optimizer stepped first; the one that stepped is the
                # rebuilt one, which shares its param groups, so the check looks at the wrong object
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for _ in range(times):
                if capped and self._past_its_total_steps():
                    return
                self.scheduler.step(*args, **kwargs)

    def _past_its_total_steps(self) -> bool:
        """A schedule with a fixed length (OneCycleLR's total_steps) that one more step would overrun:
        Accelerate skips the step rather than let torch raise, where a short last window adds a step.
        Its check reads torch's private _step_count, which is last_epoch + 1 for a scheduler built
        without a last_epoch, so the public last_epoch is read here."""
        total = getattr(self.scheduler, "total_steps", None)
        return total is not None and self.scheduler.last_epoch + 1 > total

    def _drives_a_rebuilt_optimizer(self) -> bool:
        """Whether prepare() rebuilt the scheduler's optimizer (ZeRO-1's ZeroRedundancyOptimizer shares
        the user's param groups, so the schedule still sets the learning rate it steps with)."""
        target = getattr(self.scheduler, "optimizer", None)
        return target is not None and all(target is not prepared.optimizer for prepared in self.optimizers)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Anything else (get_lr, base_lrs, last_epoch, ...) is the wrapped scheduler's.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
