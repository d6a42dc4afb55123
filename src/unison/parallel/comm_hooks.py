"""DDP communication hooks by name (Accelerate's `DDPCommunicationHookType`), mapped onto torch's own
hooks in `torch.distributed.algorithms.ddp_comm_hooks`: gradients compressed to fp16/bf16 for the
all-reduce, or PowerSGD's low-rank approximation. They change what is communicated, so they change the
numbers (by the compression's rounding); they apply wherever the layout runs DDP (ddp, zero1).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's names for torch's DDP communication hooks."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


HOOK_OPTIONS = ("comm_hook", "comm_wrapper", "comm_state_option")
"""DistributedDataParallelKwargs fields that configure the hook, not DDP's constructor."""

_POWER_SGD = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
_WRAPPERS = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16)


def split_hook_options(ddp_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DDP constructor options, communication hook options) of one DistributedDataParallelKwargs."""
    constructor = {name: value for name, value in ddp_kwargs.items() if name not in HOOK_OPTIONS}
    hook = {name: value for name, value in ddp_kwargs.items() if name in HOOK_OPTIONS}
    return constructor, hook


def check_hook_options(
    comm_hook: Any = DDPCommunicationHookType.NO,
    comm_wrapper: Any = DDPCommunicationHookType.NO,
    comm_state_option: dict[str, Any] | None = None,
) -> tuple[DDPCommunicationHookType, DDPCommunicationHookType]:
    """The hook and wrapper as enum members; options that would be ignored are refused."""
    hook, wrapper = (
        _member(name, value) for name, value in (("comm_hook", comm_hook), ("comm_wrapper", comm_wrapper))
    )
    if wrapper not in (
        DDPCommunicationHookType.NO,
        DDPCommunicationHookType.FP16,
        DDPCommunicationHookType.BF16,
    ):
        raise ValueError(
            f"comm_wrapper={wrapper.value!r}: a wrapper compresses what a hook sends, so it is 'fp16' or "
            "'bf16' (or 'no')."
        )
    if wrapper is not DDPCommunicationHookType.NO and hook not in _POWER_SGD:
        raise ValueError(
            f"comm_wrapper={wrapper.value!r} with comm_hook={hook.value!r}: the wrapper compresses a "
            "PowerSGD hook's traffic. Use comm_hook='power_sgd' or 'batched_power_sgd', or "
            "comm_hook='fp16'/'bf16' alone."
        )
    if comm_state_option and hook not in _POWER_SGD:
        raise ValueError(
            f"comm_state_option={comm_state_option!r} configures PowerSGD's state, but comm_hook="
            f"{hook.value!r}. Use comm_hook='power_sgd' or 'batched_power_sgd', or drop comm_state_option."
        )
    return hook, wrapper


def register_comm_hook(
    model: DistributedDataParallel,
    comm_hook: Any = DDPCommunicationHookType.NO,
    comm_wrapper: Any = DDPCommunicationHookType.NO,
    comm_state_option: dict[str, Any] | None = None,
) -> None:
    """Register torch's hook for `comm_hook` (wrapped by `comm_wrapper`) on a DDP model."""
    hook_type, wrapper_type = check_hook_options(comm_hook, comm_wrapper, comm_state_option)
    if hook_type is DDPCommunicationHookType.NO:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks: dict[DDPCommunicationHookType, Callable] = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
        DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
        DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
    }
    wrappers = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
    }
    hook = hooks[hook_type]
    if wrapper_type in wrappers:
        hook = wrappers[wrapper_type](hook)
    if hook_type in _POWER_SGD:
        state: Any = powerSGD_hook.PowerSGDState(
            process_group=model.process_group, **(comm_state_option or {})
        )
    else:
        state = model.process_group
    model.register_comm_hook(state, hook)


def _member(name: str, value: Any) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(value)
    except ValueError:
        choices = ", ".join(repr(member.value) for member in DDPCommunicationHookType)
        raise ValueError(
            f"{name}={value!r} is not a DDP communication hook: choose one of {choices}."
        ) from None
