"""`LocalSGD`: Accelerate's local SGD (accelerate.local_sgd), for scripts that use it.

Each process trains its own replica for `local_sgd_steps` calls of `step()` without the gradient
all-reduce, then every parameter is replaced by its mean over the processes; once more when the block
ends. One all-reduce of the parameters every k steps instead of one of the gradients every step: less
communication, and different numbers on purpose: between two averages the replicas drift apart, each
following its own shard's gradients, so the run is not the one-process run (plain DDP's) but local SGD
(Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019). With one process it does nothing,
as in Accelerate.

It averages whole replicas, so it runs where each process holds the whole model: plain data
parallelism (DDP, the default on several processes). A layout that shards the model or splits it
(ZeRO, HSDP, tensor, pipeline or context parallelism) is refused when the block is built, on every
process, as Accelerate refuses DeepSpeed and Megatron-LM.
"""

from __future__ import annotations

import contextlib
from types import TracebackType

import torch

from .accelerator import Accelerator
from .state import DistributedType

__all__ = ["Accelerator", "DistributedType", "LocalSGD"]


class LocalSGD:
    """`with LocalSGD(accelerator, model, local_sgd_steps=k) as local_sgd:` around the training loop,
    `local_sgd.step()` after each `optimizer.step()` (every micro-step inside `accumulate()`, as
    Accelerate's example does, so k counts micro-steps there): parameters are averaged every k-th call and
    at the end of the block. `model` is the prepared model; `enabled=False` (or one process) leaves the
    loop as plain DDP."""

    def __init__(
        self, accelerator: Accelerator, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True
    ):
        config = accelerator.parallelism_config
        if config is None:
            raise ValueError(
                "LocalSGD needs the parallel layout, which parallelism='auto' chooses when the model is "
                "prepared: build LocalSGD after accelerator.prepare(model, ...)."
            )
        if not config.is_plain_data_parallel:
            raise NotImplementedError(
                f"LocalSGD averages whole replicas of the model, but the layout {config.describe()} shards "
                "or splits it across processes: LocalSGD runs with plain data parallelism only (DDP, "
                "the default layout on several processes). Leave LocalSGD out (this layout synchronises "
                "every step), or train with parallelism='dp_replicate_size=N'."
            )
        if enabled and (isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int)):
            raise TypeError(f"local_sgd_steps={local_sgd_steps!r}: pass the number of steps, an int >= 1.")
        if enabled and local_sgd_steps < 1:
            raise ValueError(
                f"local_sgd_steps={local_sgd_steps}: parameters are averaged every local_sgd_steps "
                "optimizer steps; pass an int >= 1 (1 averages after every step)."
            )
        self.enabled = enabled and accelerator.num_processes > 1
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync = contextlib.ExitStack()

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.enabled:
            try:
                if exc_type is None:  # after an error, another process may not reach the all-reduce
                    self._average_parameters()
            finally:
                self._no_sync.close()

    def step(self) -> None:
        """Count an optimizer step; every `local_sgd_steps`-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    @torch.no_grad()
    def _average_parameters(self) -> None:
        """Every parameter replaced, in place, by its mean over the processes (sum, then / N)."""
        for parameter in self.model.parameters():
            parameter.copy_(self.accelerator.reduce(parameter, reduction="mean"))
