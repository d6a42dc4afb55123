"""Normalising summed losses by the global number of items (tokens, samples) behind them.

A loss averaged over each micro-batch's own items weights every micro-batch equally, so when the
micro-batches hold different numbers of valid items (padding, masks, variable lengths) the gradient
changes with how the global batch is split across processes and accumulation steps:
(x1 / n1 + x2 / n2) / 2 is not (x1 + x2) / (n1 + n2). The exact gradient of the mean over all items
of an optimizer step needs the global count, which no process knows until the step's last micro-batch.

Gradients are linear in the loss, so the division can wait: each micro-step back-propagates the *sum*
of its item losses and adds its item count here; on the micro-step that ends the accumulation window
(after DDP has averaged the accumulated gradients over the N processes) one all-reduce of the counts
gives the global total T, and multiplying every gradient by N / T turns the average of the per-process
sums into the sum over all items divided by T. Cost: one scalar all-reduce and one pass over the
gradients per optimizer step (0.3 ms for 4.2M fp32 gradients on one CPU thread).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .parallel.engines import is_dtensor

NumItems = int | float | torch.Tensor


def _checked(num_items: object) -> NumItems:
    """num_items as a number or a detached 0-d tensor, or a clear error naming what was wrong."""
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
            raise ValueError(
                f"num_items is a {num_items.dtype} tensor of shape {tuple(num_items.shape)}: it must hold "
                "one real number, the count of items summed in this micro-batch's loss. Pass e.g. "
                "num_items=mask.sum() (not the mask itself)."
            )
        return num_items.detach().reshape(())
    if isinstance(num_items, bool) or not isinstance(num_items, numbers.Real):
        raise TypeError(
            f"num_items={num_items!r} is a {type(num_items).__name__}: pass the number of items (tokens, "
            "samples) summed in this micro-batch's loss as an int, a float or a one-element tensor."
        )
    if not 0 <= num_items < float("inf"):
        raise ValueError(
            f"num_items={num_items!r} is not allowed: it counts the items summed in this micro-batch's "
            "loss, a finite number >= 0."
        )
    return num_items


class ItemCount:
    """The items behind the summed losses of the current accumulation window, on this process.

    It also remembers whether the window's backward calls pass num_items at all: a window mixing
    summed and averaged losses has no meaningful normalisation, so that is refused.
    """

    def __init__(self) -> None:
        self.local_total: NumItems = 0
        self.counting: bool | None = None  # None: no backward yet in this window

    def begin_backward(self, num_items: object) -> NumItems | None:
        """Check one backward call against the window's earlier ones; num_items checked, or None.

        Raises before anything is back-propagated, so a refused call leaves the gradients untouched.
        """
        counting = num_items is not None
        if self.counting is not None and counting != self.counting:
            given, earlier = ("with", "without") if counting else ("without", "with")
            raise ValueError(
                f"backward() was called {given} num_items after a backward() {earlier} num_items in the "
                "same accumulation window. With num_items the loss is a sum over items and unison divides "
                "the gradients by the global item count; without it the loss is a mean and unison divides "
                "by gradient_accumulation_steps; the two cannot be combined. Pass num_items on every "
                "backward() call (each loss a sum over its items), or on none."
            )
        checked = _checked(num_items) if counting else None
        self.counting = counting
        return checked

    def add(self, num_items: NumItems) -> None:
        """Count items whose gradients are now accumulated (called after their backward succeeded)."""
        self.local_total = self.local_total + num_items

    def end_window(self) -> None:
        """Forget the window: the next backward call starts a new one."""
        self.local_total = 0
        self.counting = None

    def gradient_factor(
        self, num_processes: int, device: torch.device, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """N / (items summed over the N processes of `group` and the window's micro-steps); 0 if none.

        `group` holds the processes whose gradients were averaged (the data-parallel ranks; None: all).

        The count is all-reduced on `device` (NCCL needs the process's own GPU) and the factor stays a
        tensor there, so a GPU run never waits for the host here. A window without any item has zero
        gradients; a factor of 0 keeps them zero instead of turning them into 0/0 = NaN.
        """
        wide = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        local = self.local_total
        exact = isinstance(local, (torch.Tensor, numbers.Integral))  # int counts all-reduce as int64
        total = torch.as_tensor(local, device=device, dtype=None if exact else wide)
        if num_processes > 1:
            dist.all_reduce(total, group=group)
        total = total.to(wide)
        return torch.where(total > 0, num_processes / total, torch.zeros_like(total))


def scale_gradients(parameters: Iterable[torch.nn.Parameter], factor: torch.Tensor) -> None:
    """Multiply every existing gradient among `parameters` by `factor`, each gradient tensor once."""
    by_device: dict[torch.device, dict[int, torch.Tensor]] = {}
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            if is_dtensor(grad):  # sharded (FSDP2, TP): scale this rank's piece in place
                grad = grad.to_local()
            by_device.setdefault(grad.device, {})[id(grad)] = grad
    for device, grads in by_device.items():
        torch._foreach_mul_(list(grads.values()), factor.to(device))
