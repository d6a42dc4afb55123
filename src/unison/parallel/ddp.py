"""Data parallelism with torch's DistributedDataParallel: bucketed all-reduce overlapped with backward.

Also the one place that knows how each data-parallel engine skips its gradient sync.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .comm_hooks import register_comm_hook, split_hook_options
from .engines import is_fsdp_module
from .outputs import hook_ddp_outputs


def wrap_ddp(
    model: torch.nn.Module, device: torch.device, ddp_kwargs: dict[str, Any]
) -> DistributedDataParallel:
    """Wrap `model` (already on `device`) in DDP; parameters are broadcast from process 0 here.

    `ddp_kwargs` are DistributedDataParallelKwargs' changed options: DDP's own, and a communication
    hook (parallel/comm_hooks.py) registered on the result.
    """
    constructor, hook = split_hook_options(ddp_kwargs)
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=device_ids, **constructor)
    register_comm_hook(wrapped, **hook)
    hook_ddp_outputs(wrapped)  # outputs in any container, with find_unused_parameters or static_graph
    return wrapped


def wrap_data_parallel(model: torch.nn.Module) -> torch.nn.DataParallel:
    """Legacy single-process torch.nn.DataParallel over every visible GPU (opt-in, see check below).

    Each forward scatters the batch from GPU 0, replicates the module to every GPU, gathers the outputs
    back on GPU 0, and backward reduces the gradients there: five exchanges per step where DDP has one.
    """
    check_data_parallel_devices(torch.cuda.device_count())
    return torch.nn.DataParallel(model)


def check_data_parallel_devices(visible_gpus: int) -> None:
    """nn.DataParallel only makes sense over two or more GPUs of one process: refuse anything else."""
    if visible_gpus < 2:
        raise ValueError(
            f"parallelism='dataparallel' (torch.nn.DataParallel) needs at least 2 visible GPUs, but this "
            f"process sees {visible_gpus}: it splits each batch over the GPUs of one process. Use 'ddp' "
            "(one process per device, faster), or run where CUDA_VISIBLE_DEVICES lists 2 or more GPUs."
        )


_STATIC_GRAPH_SEEN: weakref.WeakSet = weakref.WeakSet()
"""DDP modules with static_graph=True that ran a synchronised micro-step (see skip_gradient_sync)."""


@contextlib.contextmanager
def skip_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """Backward inside accumulates local gradients without communication (non-final micro-steps).

    DDP (and ZeRO-1, which runs under DDP) keeps them local until a backward outside `no_sync`
    all-reduces; FSDP2 (ZeRO-2/3) keeps unsharded gradients until a synchronised backward
    reduce-scatters their sum. Anything else has nothing to skip.

    DDP with static_graph=True cannot skip before one synchronised backward has shown it the graph (torch
    2.13's reducer fails an internal assert, expect_autograd_hooks_): that first micro-step all-reduces.
    The window's result is the same, as the last backward all-reduces the accumulated sum, and the
    mean of a sum whose first part is already averaged is the mean of the whole.
    """
    if isinstance(model, DistributedDataParallel):
        if model.static_graph and model not in _STATIC_GRAPH_SEEN:
            _STATIC_GRAPH_SEEN.add(model)
            yield
            return
        with model.no_sync():
            yield
    elif is_fsdp_module(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


_JUDGED = "_unison_every_parameter_reduced"
"""Set on a DDP model once a reduced backward gave every parameter a gradient: it is checked no more."""


def check_every_parameter_got_a_gradient(model: torch.nn.Module) -> None:
    """After a backward: raise RuntimeError naming the parameters of a DDP `model` that got no gradient
    while others did, in a backward DDP reduces (a forward outside no_sync, no find_unused_parameters).

    DDP finishes a backward's reduction when every parameter has reported its gradient. A parameter the
    loss does not reach never reports, and torch raises only at the next forward ("Expected to have
    finished reduction in the prior iteration"), advising an argument of DDP's constructor, which a
    prepared model does not take. A model with no gradient at all was not reached by this loss (a
    script's second model) and is judged at a later backward; one that passed once is not checked again,
    so the check costs nothing per step.
    """
    if not isinstance(model, DistributedDataParallel) or getattr(model, _JUDGED, False):
        return
    if model.find_unused_parameters or model.static_graph or not model.require_forward_param_sync:
        return  # DDP copes with unused parameters, or this backward (forward under no_sync) reduces nothing
    trained = [(name, p.grad is None) for name, p in model.module.named_parameters() if p.requires_grad]
    unused = [name for name, no_gradient in trained if no_gradient]
    if len(unused) == len(trained):
        return
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise RuntimeError(
            f"{shown} of the {type(model.module).__name__} got no gradient in this backward (not used by "
            "forward, or not part of the loss), and DDP waits for every parameter's gradient: the next "
            "forward would fail with torch's 'Expected to have finished reduction in the prior iteration'. "
            "Freeze them before prepare() (requires_grad_(False)) or make them part of the loss; if they are "
            "unused only on some steps, pass Accelerator(kwargs_handlers=[DistributedDataParallelKwargs("
            "find_unused_parameters=True)]) (DDP then searches the graph after every forward)."
        )
    setattr(model, _JUDGED, True)


def wrapper_prefix(model: torch.nn.Module) -> str:
    """What the wrappers around the user's module add to its state-dict keys ("module." for DDP)."""
    prefix = ""
    while True:
        if isinstance(model, DistributedDataParallel | torch.nn.DataParallel):
            prefix, model = prefix + "module.", model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            prefix, model = prefix + "_orig_mod.", model._orig_mod
        else:
            return prefix


def unwrap(model: torch.nn.Module, keep_torch_compile: bool = False) -> torch.nn.Module:
    """The user's module inside any wrapper unison (or torch.compile) put around it.

    keep_torch_compile: the OptimizedModule of torch.compile(the user's module) instead, as Accelerate's
    unwrap_model gives by default: the user compiled the model before prepare() (prepare()'s own
    compilation, dynamo_backend=, compiles in place and adds no wrapper). A compiled wrapper
    (torch.compile of what prepare() returned) is unwrapped all the same: it is not the user's module
    compiled.
    """
    compiled = None
    while True:
        if isinstance(model, DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            compiled, model = model, model._orig_mod
        else:
            break
    return compiled if keep_torch_compile and compiled is not None and compiled._orig_mod is model else model


@contextlib.contextmanager
def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """Average the gradients of a DDP `model` over its processes at the end of the block, for a backward
    whose forward ran under no_sync (Accelerate's trigger_sync_in_backward).

    DDP decides in forward whether the next backward all-reduces, so a forward under no_sync leaves its
    backward local wherever that backward runs. Accelerate re-arms DDP's private reducer
    (`reducer.prepare_for_backward`); here the block's end all-reduces the gradients with
    torch.distributed.all_reduce over DDP's group instead: the mean over the processes of each one's
    accumulated gradient, what DDP's all-reduce gives (without a communication hook's compression). If
    the block's forward ran outside no_sync (DDP's `require_forward_param_sync`, set by every forward, says
    it armed its all-reduce), DDP averages in the backward and the block adds nothing. FSDP2 decides at
    backward time, so a backward outside no_sync synchronises by itself; other models have no processes
    to synchronise with: for both the block runs as it is.
    """
    armed = not isinstance(model, DistributedDataParallel) or model.require_forward_param_sync
    yield
    if not armed:
        _average_gradients(model)


def _average_gradients(model: DistributedDataParallel) -> None:
    """The mean of each gradient over DDP's processes; a parameter without gradient here counts as zeros
    where another process has one (DDP's rule for unused parameters), and stays without where none has."""
    params = [p for p in model.parameters() if p.requires_grad]
    group, size = model.process_group, torch.distributed.get_world_size(model.process_group)
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    torch.distributed.all_reduce(present, group=group)
    grads = []
    for p, anywhere in zip(params, present.tolist()):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)
        if anywhere:
            grads.append(p.grad)
    for dtype in {grad.dtype for grad in grads}:  # one all-reduce per dtype, of the gradients flattened
        same = [grad for grad in grads if grad.dtype == dtype]
        flat = torch.cat([grad.reshape(-1) for grad in same]).div_(size)
        torch.distributed.all_reduce(flat, group=group)
        for grad, piece in zip(same, flat.split([grad.numel() for grad in same])):
            grad.copy_(piece.view_as(grad))
