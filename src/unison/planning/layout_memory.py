"""What one device holds under a planned layout: the formulas of `memory` applied to one config.

The planner ranks layouts and takes the first that fits; this module is the pricing it ranks by (model
state of this device's share, ZeRO's gathered unit, autocast's copies, activations), apart from the
ranking so each can be read, and tested, on its own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..parallel.checkpointing_modes import FULL
from ..parallel.config import ParallelismConfig
from . import memory
from .activation_memory import estimate_activation_bytes

if TYPE_CHECKING:  # the planner's types; the planner imports this module
    from .inputs import ModelFacts, Workload


@dataclass(frozen=True)
class PlanMemory:
    """Bytes one device holds under a layout (the most loaded device: first pipeline stage)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int | None
    device_memory: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + (self.activations or 0)

    @property
    def fraction(self) -> float:
        return self.total / self.device_memory

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total, "fraction": round(self.fraction, 4)}


def layout_memory(
    facts: ModelFacts, device_memory: int, workload: Workload, config: ParallelismConfig
) -> PlanMemory:
    """Model state (memory.model_state_bytes of this device's share), ZeRO's gathered unit, activations.

    Share: Ψ/tp without a pipeline; with one, the heaviest stage (its blocks, rounded up, plus half the
    parameters outside the blocks: embedding on the first stage, output layer on the last), over tp.
    Under expert parallelism the experts' share is 1/ep, sharded over the shard/ep EP groups beside it.
    ZeRO-2 and -3 also hold one unit's full gradients before the reduce-scatter, ZeRO-3 its full parameters
    (in the compute dtype: bf16 under bf16-mixed). Gradients and optimizer state count the share's
    trainable parameters only (the heaviest stage's: its blocks' and half the root's), and the unit's
    gradients its trainable ones. bf16-mixed adds autocast's bf16 copies of the share's weights that
    backward passes through (frozen ones too), where they are fp32 when computed
    (memory.autocast_copy_bytes: not under ZeRO-2/3);
    with activation checkpointing, of one block's only (the block being recomputed). offload=true moves
    the model state to host memory: the device keeps the gathered unit (memory.host_bytes).
    """
    precision = workload.bytes
    tp, pp, shard, stage = config.tp_size, config.pp_size, config.dp_shard_size, config.zero_stage
    shape = facts.shape
    held, held_trainable = shape.parameters, shape.trainable_parameters
    if pp > 1:
        stage_blocks = math.ceil(facts.blocks / pp)
        heaviest = stage_blocks * facts.block_parameters + math.ceil(facts.root_parameters / 2)
        if heaviest < held:
            held = heaviest
            held_trainable = min(
                held_trainable, stage_blocks * facts.block_trainable + math.ceil(facts.root_trainable / 2)
            )
    held, trainable = math.ceil(held / tp), math.ceil(held_trainable / tp)
    # what backward passes through (autocast keeps those weights' copies): all but the frozen ones before
    # the first trainable parameter, this device's share of them
    reached = -(-held * shape.reached_parameters // shape.parameters) if shape.parameters else 0
    strategy = f"zero{stage}" if stage else "ddp"
    if config.offload:
        strategy += "_offload"
    ep = config.ep_size or 1
    experts = shape.expert_parameters if ep > 1 else 0  # EP runs without tp and pp: every expert is held
    params, grads, optim = memory.model_state_bytes(
        strategy,
        precision,
        held - experts,
        -(-(held - experts) * trainable // held) if held else 0,  # ceil, in exact integers
        shard if stage else 1,
    )
    if experts:  # each process's experts/ep, sharded over the EP groups beside it (shard/ep of them)
        expert_state = memory.model_state_bytes(
            strategy, precision, experts // ep, -(-experts * trainable // held) // ep, shard // ep
        )
        params, grads, optim = (a + b for a, b in zip((params, grads, optim), expert_state))
    if stage in (2, 3) and shard > 1:
        unit, unit_trainable = _gathered_unit(facts, ep)
        extra_params, extra_grads = memory.zero_gathered_unit_bytes(
            strategy, precision, math.ceil(unit / tp), math.ceil(unit_trainable / tp)
        )
        params, grads = params + extra_params, grads + extra_grads
    cast = (
        min(reached, math.ceil(facts.block_parameters / tp)) if workload.activation_checkpointing else reached
    )
    params += memory.autocast_copy_bytes(precision, cast, strategy)
    return PlanMemory(params, grads, optim, activations(facts, workload, tp), device_memory)


def _gathered_unit(facts: ModelFacts, ep: int) -> tuple[int, int]:
    """(parameters ZeRO-3 gathers at once: a block with, under expert parallelism, its experts' 1/ep; the
    most trainable parameters of such a unit, whose gradients are whole before the reduce-scatter)."""
    shape = facts.shape
    if ep == 1 or not shape.expert_layers or not facts.blocks:
        return facts.largest_unit, facts.largest_unit_trainable
    in_block = shape.expert_parameters // shape.expert_layers
    unit = max(facts.block_parameters - in_block + in_block // ep, facts.root_parameters)
    return unit, min(unit, facts.largest_unit_trainable)


def activations(facts: ModelFacts, workload: Workload, tp: int) -> int | None:
    """activation_memory.estimate_activation_bytes, with full checkpointing when the workload says so.

    Full recomputation keeps s·b·h·e bytes per block (Korthikanti et al. 2022 §5: 2sbhL in 16-bit), not
    split by TP without sequence parallelism; one block's full activations exist again during backward
    (the same formula `unison estimate-memory --activation-checkpointing full` prints, measured against
    torch's saved tensors in tests/test_activation_checkpointing.py). With 1F1B the first stage holds p
    micro-batches of L/p blocks: the same total (memory.py docstring).
    """
    shape = facts.shape
    if workload.micro_batch_size is None or shape.layers is None:
        return None
    b, s, e = workload.micro_batch_size, workload.seq_len, workload.bytes.activation_bytes
    mode = FULL if workload.activation_checkpointing else None
    return estimate_activation_bytes(shape, b, s, e, mode, tensor_parallel=tp)
