"""Mixed precision: which autocast dtype, when it is active, and the fp16 gradient scaler.

Autocast reaches a prepared model through a forward pre-hook that enters `torch.autocast` and a
forward hook (always called, even when forward raises) that leaves it, so the user's `forward` is
never replaced. Floating outputs come back as fp32 so losses and metrics computed outside the model
keep full precision, as in Accelerate, except where that only costs memory (`convert_outputs_to_fp32`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from .ops import recursively_apply
from .parallel.engines import is_dtensor

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionPolicy:
    """The precision a run trains in, on one device type."""

    def __init__(
        self,
        mixed_precision: str,
        device: torch.device,
        scaler_kwargs: dict[str, Any] | None = None,
        autocast_kwargs: dict[str, Any] | None = None,
        convert_outputs_to_fp32: bool | None = None,
    ):
        """scaler_kwargs / autocast_kwargs: GradScalerKwargs' / AutocastKwargs' changed options.
        convert_outputs_to_fp32: see `outputs_to_fp32`."""
        self.convert_outputs_to_fp32 = check_convert_outputs(convert_outputs_to_fp32)
        self.mixed_precision = mixed_precision
        self.device_type = device.type
        self.dtype = AUTOCAST_DTYPES.get(mixed_precision)
        self.autocast_enabled, self.autocast_options = _autocast_settings(autocast_kwargs or {})
        self.scaler = (
            LayoutGroupedGradScaler(self.device_type, **(scaler_kwargs or {}))
            if mixed_precision == "fp16"
            else None
        )

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self, handler_kwargs: dict | None = None) -> contextlib.AbstractContextManager:
        """torch.autocast in the run's dtype, or a null context in full precision. `handler_kwargs` (an
        AutocastKwargs' fields) replace the run's own autocast options for this context."""
        enabled, options = self.autocast_enabled, self.autocast_options
        if handler_kwargs is not None:
            enabled, options = _autocast_settings(handler_kwargs)
        if not (enabled and self.enabled):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, **options)

    def attach_to(self, model: torch.nn.Module, convert_outputs: bool = True) -> list[RemovableHandle]:
        """Run `model`'s forward under autocast and hand its floating outputs back as `outputs_to_fp32`
        says (convert_outputs=False: as computed, for a pipeline stage whose outputs only go to the next
        stage); the hooks' handles are returned (removing them gives the module back its plain forward)."""
        if not self.enabled:
            return []
        active: list[contextlib.AbstractContextManager] = []

        def enter_autocast(module, args):
            context = self.autocast()
            context.__enter__()
            active.append(context)

        def leave_autocast(module, args, output):
            active.pop().__exit__(None, None, None)
            return self.outputs_to_fp32(output) if convert_outputs else output

        # Kept out of torch.compile's graphs: a model compiled whole (nn.Module.compile, or torch.compile of
        # the prepared model) traces its hooks too, and an autocast entered inside the trace is no real
        # context to leave after a graph break ("'autocast' object has no attribute 'prev'"). Run eagerly,
        # they set the autocast state that the compiled forward is traced (and guarded) under.
        return [
            model.register_forward_pre_hook(torch.compiler.disable(enter_autocast)),
            model.register_forward_hook(torch.compiler.disable(leave_autocast), always_call=True),
        ]

    def outputs_to_fp32(self, output: Any) -> Any:
        """A prepared model's output with its half-precision floating tensors made fp32, so that a loss or
        metric computed from them outside the model runs in full precision (Accelerate's behaviour).

        The copy costs memory and time in proportion to the output: the logits of 8 x 8192 tokens over a
        128,256-word vocabulary are 16.8 GB in bf16 and 33.6 GB more in fp32. So by default
        (convert_outputs_to_fp32=None) a model that returns its own loss gets only that loss converted: a
        mapping with a "loss" tensor (as Hugging Face models return when given labels), or a tuple or list
        holding a scalar (nanoGPT's `logits, loss`). Its loss was computed inside the model (under autocast,
        or upcast by the model itself), and the other outputs serve metrics. True converts everything,
        always; False nothing.
        """
        mode = self.convert_outputs_to_fp32
        if mode is False:
            return output
        if mode is None and isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            output["loss"] = _to_fp32(output["loss"])  # a ModelOutput keeps its attribute in step
            return output
        if mode is None and isinstance(output, (tuple, list)) and any(_is_scalar(item) for item in output):
            return recursively_apply(lambda t: _to_fp32(t) if t.dim() == 0 else t, output)
        return recursively_apply(_to_fp32, output)


class LayoutGroupedGradScaler(torch.amp.GradScaler):
    """torch's GradScaler, unscaling plain and DTensor gradients in separate calls.

    torch unscales every gradient of a device and dtype with one fused op, which refuses a list that mixes
    plain tensors and DTensors: exactly what tensor parallelism leaves (the plan shards the linear layers;
    norms stay plain tensors), so fp16 under TP alone failed at its first unscale. Each layout (plain, or
    one DTensor mesh and placement) gets its own call here. The DTensor calls also make the overflow flag
    agree across the mesh (torch all-reduces it by the max over the dimensions the *first* gradient of a
    call is sharded on: one placement per call makes that the right set). Only `_unscale_grads_` is
    replaced, torch's private method that `unscale_` calls (pinned in tests/test_torch_private_apis.py).

    Under pipeline parallelism each rank holds some stages' gradients only, so an overflow in one stage
    would skip the step on its rank alone and the stages would drift apart (and clipping by the whole
    model's norm would turn the others' gradients into NaNs that they then step with).
    `agree_across_processes()` makes every unscale end with one all-reduce (MAX) of the found-inf flag,
    as Megatron-LM does over its model-parallel group: every rank then skips, lowers its scale, and
    keeps its scheduler, together.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._agree = False
        self._agree_group: dist.ProcessGroup | None = None

    def agree_across_processes(self, group: dist.ProcessGroup | None = None) -> None:
        """From now on an overflow found on any process of `group` (None: all of them) counts on each:
        one all-reduce of a single flag per unscaled optimizer. Collective: every process of the group
        must then unscale the same optimizers in the same order (the training loop does)."""
        self._agree, self._agree_group = True, group

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found = self._unscale_by_layout(optimizer, inv_scale, found_inf, allow_fp16)
        return self._agreed(found, found_inf) if self._agree else found

    def _agreed(
        self, found: dict[torch.device, torch.Tensor], found_inf: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """`found` with every flag set to the maximum over this process's devices and the group's
        processes. A process with no gradient to unscale still takes part (with its zero `found_inf`),
        and records that flag, so that its step is skipped or taken with the others'."""
        flags = list(found.values()) or [found_inf]
        agreed = torch.stack([flag.to(found_inf.device) for flag in flags]).amax()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._agree_group)
        for flag in flags:
            flag.copy_(agreed)
        return found or {found_inf.device: found_inf}

    def _unscale_by_layout(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's unscale, one call per gradient layout; the per-device found-inf flags, merged."""
        groups = _params_by_gradient_layout(optimizer.param_groups)
        if len(groups) <= 1:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        found_per_device: dict[torch.device, torch.Tensor] = {}
        for params in groups:
            one_layout = _ParamGroupsOnly([{"params": params}])
            found_here = super()._unscale_grads_(one_layout, inv_scale, found_inf, allow_fp16)
            for device, found in found_here.items():
                seen = found_per_device.get(device)
                merged = found if seen is None or seen is found else torch.maximum(seen, found)
                found_per_device[device] = merged
        return found_per_device


class _ParamGroupsOnly:
    """What GradScaler._unscale_grads_ reads of an optimizer: its param_groups."""

    def __init__(self, param_groups: list[dict[str, Any]]):
        self.param_groups = param_groups


def _params_by_gradient_layout(param_groups: list[dict[str, Any]]) -> list[list[torch.Tensor]]:
    """The parameters with a gradient, grouped by the gradient's layout: plain, or (mesh, placements)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for group in param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            layout = (grad.device_mesh, tuple(grad.placements)) if is_dtensor(grad) else None
            groups.setdefault(layout, []).append(param)
    return list(groups.values())


def check_convert_outputs(value: Any) -> bool | None:
    """`value` if it is a choice of PrecisionPolicy.outputs_to_fp32, else the error saying which are."""
    if value not in (None, True, False):
        raise ValueError(
            f"convert_outputs_to_fp32={value!r}: pass True (every floating output of a prepared model in "
            "fp32, as Accelerate does), False (outputs as the model computed them) or None (True, except "
            "that a model which returns its own loss, a `loss` entry or a scalar beside its logits, keeps "
            "its other outputs)."
        )
    return value


def _is_scalar(value: Any) -> bool:
    """A zero-dimensional floating tensor: what a loss computed inside a model comes out as."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _autocast_settings(kwargs: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(enabled, torch.autocast's other options) of AutocastKwargs' fields; None means torch's default."""
    options = {k: v for k, v in kwargs.items() if v is not None}
    return options.pop("enabled", True), options
