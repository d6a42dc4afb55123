"""The Accelerator's training step: accumulation windows, backward, forward_backward, clipping.

A mixin, as collectives.py and checkpoint/methods.py are, so accelerator.py stays the façade. It
decides which micro-step synchronises gradients, normalises them (by the accumulation steps, by the
micro-batches a window really had, or by `num_items`), and runs a pipeline's schedule where no rank
holds the whole model. It reads `gradient_state`, `gradient_accumulation_steps`,
`gradient_accumulation_plugin`, `step`, `_models`, `_numerics`,
`_optimizers`, `_item_count`, `precision`, `parallelism`, `device_mesh` and `device` from the
Accelerator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .item_count import scale_gradients
from .kwargs_handlers import AutocastKwargs
from .numerics import SHORT_WINDOW
from .parallel.apply import data_parallel_engine
from .parallel.clipping import clip_grad_norm
from .parallel.ddp import check_every_parameter_got_a_gradient, skip_gradient_sync, trigger_sync_in_backward
from .parallel.engines import is_dtensor
from .parallel.mesh import loss_mesh
from .parallel.pipeline import PipelineModel

logger = logging.getLogger("unison")


class TrainingStepMethods:
    """accumulate / no_sync / trigger_sync_in_backward / maybe_context_parallel / backward /
    forward_backward / forward_loss / autocast / unscale_gradients / clip_grad_norm_ / clip_grad_value_,
    and the sync_gradients they decide."""

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step that ends an accumulation window: gradients all-reduced, optimizer steps."""
        return self.gradient_state.sync_gradients

    @property
    def sync_each_batch(self) -> bool:
        """Whether accumulate() reduces gradients on every micro-step: the plugin's choice, else by memory
        (GradientAccumulationPlugin.sync_each_batch): True where FSDP2 shards gradients."""
        chosen = self.gradient_accumulation_plugin.sync_each_batch
        if chosen is not None:
            return chosen
        return self.parallelism is not None and data_parallel_engine(self.parallelism) == "fsdp"

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped for fp16 overflow."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    def _do_sync(self) -> None:
        """Decide whether this micro-step synchronises: every k-th, and always on a loader's last batch
        (a window the loader cuts short then holds fewer than k micro-batches: `_window_micro_steps`),
        unless gradient_accumulation_plugin.sync_with_dataloader=False lets windows run across it."""
        if self.gradient_state.end_of_dataloader and self.gradient_accumulation_plugin.sync_with_dataloader:
            self._window_micro_steps = self.step % self.gradient_accumulation_steps + 1
            self.step = 0
            self.gradient_state.sync_gradients = True
        else:
            self.step += 1
            self._window_micro_steps = self.gradient_accumulation_steps
            self.gradient_state.sync_gradients = self.step % self.gradient_accumulation_steps == 0

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-step: skip the gradient all-reduce unless this micro-step ends the window (or
        gradient_accumulation_plugin.sync_each_batch asks for it on every micro-step)."""
        self._do_sync()
        with contextlib.ExitStack() as stack:
            if not self.sync_gradients and not self.sync_each_batch:
                for model in models:
                    stack.enter_context(skip_gradient_sync(model))
            self._in_accumulate = True
            try:
                yield
            finally:
                self._in_accumulate = False

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Accumulate local gradients without the all-reduce (DDP's no_sync) for the enclosed backward."""
        with skip_gradient_sync(model):
            yield

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Average `model`'s gradients over the processes for a backward whose forward ran under no_sync
        (Accelerate's; done with a public all-reduce rather than DDP's private reducer: parallel/ddp.py)."""
        return trigger_sync_in_backward(model)

    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Accelerate's context for context parallelism: with cp_size > 1, `buffers` (the batch tensors
        with a sequence dimension: inputs, labels, positions) are sharded in place along
        `buffer_seq_dims` over the cp ranks, and every scaled_dot_product_attention in the block attends
        over the whole sequences (torch's context_parallel: parallel/context.py). Put the forward and
        the backward inside; the buffers are restored at exit, except those in `no_restore_buffers`.
        With cp_size 1 the block runs as it is, as in Accelerate."""
        if self.parallelism is None or (self.parallelism.cp_size or 1) == 1:  # ("auto" never picks cp)
            yield
            return
        from .parallel.context import context_parallel_block

        with context_parallel_block(self.device_mesh, buffers, buffer_seq_dims, no_restore_buffers):
            yield

    def backward(
        self, loss: torch.Tensor, num_items: int | float | torch.Tensor | None = None, **kwargs
    ) -> None:
        """loss.backward(), normalised for accumulation and scaled for fp16; kwargs go to loss.backward.

        Without num_items, `loss` is a mean and is divided by gradient_accumulation_steps.
        With num_items, `loss` is a SUM over this micro-batch's items (e.g. valid tokens) and num_items
        their number (int, float or one-element tensor such as `mask.sum()`): after the backward of the
        micro-step that ends the accumulation window, every gradient of the prepared models is divided
        by the number of items over all processes and micro-steps of the window, so the update is the
        gradient of the mean over all items, whatever the split (docs/loss-normalization.md). Call it
        once per micro-step, on every micro-step of the window, with optimizer.zero_grad() after the
        step as usual; clip_grad_norm_ and the optimizer then see the normalised gradients.
        """
        counted = self._item_count.begin_backward(num_items)
        if counted is None and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.precision.scaler is not None:
            loss = self.precision.scaler.scale(loss)
        with self._loss_parallel():
            loss.backward(**kwargs)
        self._check_unused_parameters()
        self._end_backward(counted)

    def _check_unused_parameters(self) -> None:
        """Parameters a DDP model's loss never reached, said at its first reduced backward with the fix
        rather than by torch's error at the next forward (see check_every_parameter_got_a_gradient)."""
        for model in self._models:
            check_every_parameter_got_a_gradient(model)

    def _end_backward(self, counted: Any) -> None:
        """Count this micro-step's items; on the window's last, normalise the summed gradients by them.

        Mean losses were divided by k; a window the loader cut short after r < k micro-batches is
        multiplied by k / r here, so its update is the mean over its own micro-batches, as one process
        with the same samples in one batch computes it (every process ends the loader together). Under
        numerics="accelerate" it stays divided by k, as in Accelerate (numerics.py).
        """
        if counted is not None:
            self._item_count.add(counted)
        if self.gradient_accumulation_steps > 1 and not self._in_accumulate:
            self._warn_outside_accumulate()
        if self.sync_gradients:
            if counted is not None:
                self._normalise_by_item_count()
            elif self._window_micro_steps < self.gradient_accumulation_steps:
                self._average_short_window()
            self._item_count.end_window()

    def _average_short_window(self) -> None:
        """A window of r < k micro-batches: gradients times k / r (unison's), or left divided by k
        under numerics="accelerate"; unison's says once where it differs from Accelerate's."""
        if self._numerics.accelerate:
            return
        k, r = self.gradient_accumulation_steps, self._window_micro_steps
        self._numerics.differs(
            SHORT_WINDOW,
            f"The loader ended an accumulation window after {r} of {k} micro-batches: its gradients are "
            f"averaged over the {r} it had (Accelerate divides each loss by {k}).",
        )
        scale_gradients((p for model in self._models for p in model.parameters()), torch.tensor(k / r))

    def _warn_outside_accumulate(self) -> None:
        """Only accumulate() counts micro-steps: outside it every backward ends a window of its own,
        so the optimizer steps on each micro-batch with a loss divided by k, k times too small."""
        if not self._warned_outside_accumulate:
            self._warned_outside_accumulate = True
            k = self.gradient_accumulation_steps
            logger.warning(
                "backward() outside accelerator.accumulate(model) with gradient_accumulation_steps=%d: "
                "nothing counts the micro-steps there, so the optimizer steps after every backward with the "
                "loss divided by %d. Wrap each micro-step in `with accelerator.accumulate(model):`, or "
                "leave gradient_accumulation_steps at 1 if you accumulate by hand.",
                k,
                k,
            )

    def forward_backward(
        self,
        model: torch.nn.Module,
        inputs: torch.Tensor | tuple[torch.Tensor, ...],
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        num_items: int | float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One micro-step's forward and backward in any layout; returns the loss (detached).

        `model(*inputs)` (a lone tensor is one argument), then `loss_fn(output, target)` and
        `backward(loss, num_items=num_items)`. This is the one call a loop needs to also run under
        pipeline parallelism, where no rank holds the whole model: there it runs the pipeline schedule
        over the micro-batches and every rank gets the loss. Use it inside `accumulate()` as usual.
        """
        if isinstance(model, PipelineModel):
            counted = self._item_count.begin_backward(num_items)
            scaler = self.precision.scaler
            # fp16: the scale as a tensor on every rank (scale() also creates the scaler's state on the
            # ranks whose stages compute no loss, which unscale_ needs there)
            grad_scale = scaler.scale(torch.ones((), device=self.device)) if scaler is not None else None
            # a mean loss: gradients of the micro-batches' mean, divided over the accumulation window;
            # a summed loss (num_items): gradients of the micro-batches' sum, normalised at the window end
            with self._loss_parallel():
                loss = model.step(
                    inputs,
                    target,
                    loss_fn,
                    divide_by=self.gradient_accumulation_steps if counted is None else 1,
                    sync=self.sync_gradients or self.sync_each_batch,
                    reduction="mean" if counted is None else "sum",
                    grad_scale=grad_scale,
                )
            self._end_backward(counted)
            return loss
        loss = self._forward_and_loss(model, inputs, target, loss_fn)
        self.backward(loss, num_items=num_items)
        loss = loss.detach()
        return loss.full_tensor() if is_dtensor(loss) else loss

    @torch.no_grad()
    def forward_loss(
        self,
        model: torch.nn.Module,
        inputs: torch.Tensor | tuple[torch.Tensor, ...],
        target: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> torch.Tensor:
        """Forward only (evaluation): `loss_fn(model(*inputs), target)`, detached, on every rank.

        The evaluation twin of `forward_backward`: under pipeline parallelism it runs the schedule's
        forward over the micro-batches; elsewhere it is the plain call under torch.no_grad().
        """
        if isinstance(model, PipelineModel):
            with self._loss_parallel():
                return model.evaluate(inputs, target, loss_fn)
        loss = self._forward_and_loss(model, inputs, target, loss_fn)
        return loss.full_tensor() if is_dtensor(loss) else loss

    def _forward_and_loss(self, model, inputs, target, loss_fn) -> torch.Tensor:
        """`loss_fn(model(*inputs), target)`, the loss inside loss_parallel() when the layout uses it."""
        output = model(*(inputs if isinstance(inputs, tuple) else (inputs,)))
        with self._loss_parallel():
            return loss_fn(output, target)

    def _loss_parallel(self) -> contextlib.AbstractContextManager:
        """torch's loss_parallel() when the layout computes the loss on vocabulary-sharded logits."""
        if self.parallelism is not None and self.parallelism.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel  # see parallel/engines.py

            return loss_parallel()
        return contextlib.nullcontext()

    def _normalise_by_item_count(self) -> None:
        """Turn the window's summed gradients into the gradient of the mean over all its items.

        Every prepared model with gradients is data-parallel wrapped (DDP or FSDP2) over the N
        data-parallel processes (and their context-parallel peers, which count their own parts), so
        after this backward each gradient is the average of their local
        sums: N / global count makes it the global sum over the global count (with fp16 the loss scale
        stays in until unscaling). Tensor/pipeline ranks of one replica count the same items once.
        """
        dp_mesh = loss_mesh(self.device_mesh)  # with cp, the cp peers too: each counted its own part
        factor = self._item_count.gradient_factor(
            dp_mesh.size() if dp_mesh is not None else 1,
            self.device,
            group=dp_mesh.get_group() if dp_mesh is not None else None,
        )
        scale_gradients((p for model in self._models for p in model.parameters()), factor)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Autocast in the run's mixed precision, for computation outside the prepared model; with an
        `autocast_handler`, its options (enabled, cache_enabled) instead of the Accelerator's, as in
        Accelerate."""
        if autocast_handler is None:
            return self.precision.autocast()
        if not isinstance(autocast_handler, AutocastKwargs):
            raise TypeError(
                f"autocast({autocast_handler!r}): pass an AutocastKwargs (e.g. AutocastKwargs(enabled=False))"
                " or nothing for the Accelerator's own autocast options."
            )
        return self.precision.autocast(dataclasses.asdict(autocast_handler))

    def unscale_gradients(self) -> None:
        """Divide fp16 gradients by the loss scale (done for you by the clip_grad_* methods)."""
        for optimizer in self._optimizers:
            optimizer.unscale_gradients()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients' total norm (all-reduced on sync steps); returns the norm before clipping.

        Over sharded gradients (DTensors) torch computes the norm of the whole gradient; under pipeline
        parallelism the stages' norms are combined over the pipeline ranks (a tied weight counted once),
        so every rank clips by the norm of the whole model's gradient, returned as a plain tensor.
        """
        self.unscale_gradients()
        pipeline = next((m for m in self._models if isinstance(m, PipelineModel)), None)
        if pipeline is None:
            return clip_grad_norm(parameters, max_norm, norm_type)
        once = {id(p) for p in pipeline.norm_parameters()}
        return clip_grad_norm(parameters, max_norm, norm_type, once, self.device_mesh["pp"].get_group())

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp each gradient element to [-clip_value, clip_value]."""
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)
