"""parallelism="auto": the planner's layout for a model on the hardware of the running job."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .. import ops
from ..state import PartialState
from .hardware import detect_hardware
from .planner import Plan, PlanError, plan_parallelism
from .speed import device_key

logger = logging.getLogger("unison")


def plan_for_this_job(
    model: nn.Module,
    num_processes: int,
    num_local_processes: int,
    device: torch.device,
    mixed_precision: str,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    micro_batch_size: int | None = None,
) -> Plan:
    """The planner's verdict for `model` here, the same on every rank (process 0's, broadcast).

    Every input is the same on every rank, but the link probe (nvidia-smi) runs per node, so process
    0 plans alone and sends its plan, or its refusal, to all: the ranks must build the same mesh (or
    raise the same error) or they would wait on each other forever. Pipelines are never chosen: they
    need the loop's forward_backward call, which prepare() cannot see. Tensor parallel only where a
    built-in plan recognises the model. With the run's global batch and sequence length
    ("auto:global_batch_size=G,seq_len=S") the layouts that fit are ranked by predicted step time on this
    device (unison.planning.cost_model; a CPU or an unlisted GPU is priced as an H100: the ranking, not the
    seconds, is what counts there).
    """
    precision = "fp32" if mixed_precision == "no" else "bf16-mixed"
    plan, refusal = None, None
    if PartialState().is_main_process:  # the others wait for its verdict, a plan or a refusal
        hardware = detect_hardware(num_processes, num_local_processes, device)
        try:
            plan = plan_parallelism(
                model,
                hardware,
                micro_batch_size=micro_batch_size,
                seq_len=seq_len,
                precision=precision,
                pipeline=False,
                tensor_parallel=_has_tensor_parallel_plan(model),
                global_batch_size=global_batch_size,
                device=device_key(device),
            )
        except PlanError as error:
            refusal = str(error)
    if num_processes > 1:
        plan, refusal = ops.broadcast_object_list([plan, refusal])
    if refusal is not None:
        raise PlanError(refusal)
    logger.info("parallelism='auto' chose %s: %s", plan.config.describe(), " ".join(plan.reasons))
    return plan


def _has_tensor_parallel_plan(model: nn.Module) -> bool:
    from ..parallel.tensor import tensor_parallel_plan  # loads DTensor: only when planning, not at import

    try:
        tensor_parallel_plan(model)
    except ValueError:
        return False
    return True
