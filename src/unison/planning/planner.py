"""Pick a parallel layout (a ParallelismConfig) for a model on given hardware, by the guide's decision tree.

The multi-GPU guide (../shared/reference/multi-gpu-training-guide.txt) decides with three questions: does
the model fit onto one device (DDP), does it not (ZeRO, PP or TP, ordered by how fast the devices are
linked), does even its largest layer not (TP); across nodes, TP stays inside a node and little should cross
the slower link between nodes. The planner turns the case at hand into an ordered list of layouts (the
guide's preference), prices each with the formulas of `unison.planning.memory`, and takes the first that fits
comfortably (<= 75% of a device), else the first that fits at all (<= 90%). The rest is headroom for what
no formula counts: CUDA context, allocator fragmentation, communication buffers. docs/planner.md lists
the rules and their sources.

Planning is arithmetic on the model's shape and a description of the hardware (`hardware`, whose
Hardware, detect_hardware, parse_memory and link_from_topology are re-exported here, where they began),
so every rank that plans with the same inputs reaches the same layout without talking to the others.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ..parallel.checkpointing_modes import FULL
from ..parallel.config import ParallelismConfig
from . import memory
from . import speed as plan_speed
from .cost_model import Batch, DeviceSpec, StepCost, stages_per_device, step_cost
from .devices import DEFAULT_EFFICIENCY
from .hardware import LINKS_BETWEEN_NODES, LINKS_WITHIN_NODE, Hardware
from .hardware import detect_hardware as detect_hardware
from .hardware import link_from_topology as link_from_topology
from .hardware import parse_memory as parse_memory
from .inputs import ModelFacts, Workload, model_facts
from .layout_memory import PlanMemory, layout_memory

COMFORTABLE_FRACTION = 0.75
"""A layout 'fits comfortably' (the guide's word for case 1) when it needs at most this share of a device."""
USABLE_FRACTION = 0.90
"""A layout fits at all when it needs at most this share; the rest is left for what is not counted."""
MICROBATCHES_PER_STAGE = 4
"""Pipeline micro-batches per stage: m = 4p keeps the 1F1B bubble (p-1)/(m+p-1) under 20%."""


class PlanError(ValueError):
    """No layout fits the hardware; the message says by how much and what would make one fit."""


@dataclass(frozen=True)
class Candidate:
    """A layout with its memory and a sentence: why the guide ranks it where it is, or why it lost."""

    config: ParallelismConfig
    memory: PlanMemory
    why: str
    cost: StepCost | None = None  # the predicted step, when the run's global batch is known

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.config.describe(),
            "config": dataclasses.asdict(self.config),
            "memory": self.memory.to_dict(),
            "why": self.why,
            "cost": None if self.cost is None else self.cost.to_dict(),
        }


@dataclass(frozen=True)
class Plan:
    """The chosen layout: `config` is validated for `hardware.devices`; `reasons` say why, in order."""

    config: ParallelismConfig
    memory: PlanMemory
    reasons: tuple[str, ...]
    runners_up: tuple[Candidate, ...]
    hardware: Hardware
    workload: Workload
    model: ModelFacts
    cost: StepCost | None = None
    device: DeviceSpec | None = None  # what the cost was priced with

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "memory": self.memory.to_dict(),
            "cost": None if self.cost is None else self.cost.to_dict(),
            "device": None if self.device is None else dataclasses.asdict(self.device),
            "reasons": list(self.reasons),
            "runners_up": [candidate.to_dict() for candidate in self.runners_up],
            "layout": self.config.describe(),
            "hardware": dataclasses.asdict(self.hardware),
            "workload": dataclasses.asdict(self.workload),
            "model": {
                **dataclasses.asdict(self.model.shape),
                "trainable_fraction": self.model.shape.trainable_fraction,
                "heads": self.model.heads,
                "no_tensor_parallel": self.model.no_tensor_parallel,
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def plan_parallelism(
    model: nn.Module,
    hardware: Hardware,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    pipeline: bool = True,
    tensor_parallel: bool = True,
    global_batch_size: int | None = None,
    device: str | DeviceSpec | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
) -> Plan:
    """The layout to train `model` with on `hardware` (raises PlanError if none fits).

    Without micro_batch_size and seq_len only the model state is counted (the 25% kept free by
    'comfortably' is then all the room activations get). `activation_checkpointing` says the run
    recomputes each block in backward: the plan prices that, and its config turns it on
    (activation_checkpointing="full"), so prepare() runs what was priced.
    `pipeline=False` / `tensor_parallel=False` leave out layouts the run cannot take (a loop without the
    pipeline step, a model without a TP plan).
    With `global_batch_size` (sequences per step) and `seq_len`, every layout that fits is priced by
    unison.planning.cost_model on `device` (a name in devices.DEVICES or a DeviceSpec; default H100) at
    `efficiency` x its peak, and the fastest is chosen; without, the first in the guide's order that fits.
    """
    workload = Workload(
        precision,
        micro_batch_size,
        seq_len,
        activation_checkpointing,
        pipeline,
        tensor_parallel,
        global_batch_size,
    )
    return plan_for(model_facts(model), hardware, workload, device, efficiency)


def plan_for(
    facts: ModelFacts,
    hardware: Hardware,
    workload: Workload,
    device: str | DeviceSpec | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
) -> Plan:
    """plan_parallelism for a model already reduced to its ModelFacts."""
    if facts.shape.trainable_parameters == 0 and facts.shape.parameters:
        raise PlanError(
            f"nothing to train: every one of the model's {facts.shape.parameters:,} parameters has "
            "requires_grad=False, so an optimizer would get an empty parameter list. Plan the model as it "
            "will be trained: unfreeze the layers to train, or add adapters (e.g. peft.get_peft_model(model, "
            "LoraConfig(...))) in the factory."
        )
    if workload.global_batch_size is not None and facts.shape.layers is not None:
        return _plan_fastest(facts, hardware, workload, plan_speed.device_spec(hardware, device), efficiency)
    chosen, ranked = _choose(facts, hardware, workload)
    if chosen is None:
        raise _nothing_fits(facts, hardware, workload, ranked)
    winner = ranked[chosen]
    before = [
        dataclasses.replace(c, config=_as_run(c.config, workload), why=_why_lost(c, winner))
        for c in ranked[max(0, chosen - 6) : chosen]
    ]
    after = [
        dataclasses.replace(c, config=_as_run(c.config, workload), why="ranked lower: " + c.why)
        for c in ranked[chosen + 1 : chosen + 4]
    ]
    reasons = _reasons(facts, hardware, workload, winner)
    return Plan(
        _as_run(winner.config, workload), winner.memory, reasons, (*before, *after), hardware, workload, facts
    )


def _plan_fastest(
    facts: ModelFacts, hw: Hardware, workload: Workload, spec: DeviceSpec, efficiency: float
) -> Plan:
    """The fastest layout by predicted step time among those that fit comfortably, else at all; a layout
    within SAME_SPEED of the fastest that comes earlier in the guide's order wins (simpler, as fast)."""
    assert workload.global_batch_size is not None and workload.seq_len is not None
    sizes = (
        [workload.micro_batch_size] if workload.micro_batch_size else plan_speed.micro_batch_sizes(workload)
    )
    per_layout: list[list[Candidate]] = []  # in the guide's order; each layout at every micro-batch size
    layouts = [
        s
        for config in _ranked_layouts(facts, hw, workload)
        for s in plan_speed.schedules(config, facts.blocks)
    ]
    for config in layouts:
        priced = []
        for size in sizes:
            run = dataclasses.replace(workload, micro_batch_size=size)
            batch = Batch(
                workload.global_batch_size, workload.seq_len, size, workload.activation_checkpointing
            )
            sized = plan_speed.with_batch(config, batch, hw.devices)
            if sized is not None:
                cost = step_cost(facts.shape, sized, spec, hw.devices_per_node, batch, efficiency)
                need = layout_memory(facts, hw.device_memory, run, sized)
                priced.append(Candidate(sized, need, _why(sized, _frozen(facts)), cost))
        if priced:
            per_layout.append(priced)
    if not per_layout:
        raise PlanError(
            f"global batch {workload.global_batch_size} splits over no layout of {hw.devices} devices: make "
            f"it a multiple of a data-parallel degree that divides the devices (e.g. {hw.devices})."
        )
    for limit in (COMFORTABLE_FRACTION, USABLE_FRACTION):
        best = [  # (each layout at its micro-batch, the layout's fastest step: what layouts are ranked by)
            plan_speed.fastest_micro_batch(fits)
            for fits in ([c for c in priced if c.memory.fraction <= limit] for priced in per_layout)
            if fits
        ]
        if any(not c.config.offload for c, _ in best):  # offload is the last resort, as in the guide's order
            best = [(c, step) for c, step in best if not c.config.offload]
        if best:
            break
    else:
        raise _nothing_fits(
            facts, hw, dataclasses.replace(workload, micro_batch_size=sizes[0]), per_layout[0]
        )
    fastest = min(step for _, step in best)
    winner = next(c for c, step in best if step <= fastest * (1 + plan_speed.SAME_SPEED))
    runners_up = tuple(
        dataclasses.replace(
            c,
            config=_as_run(c.config, workload),
            why=f"{c.cost.step / winner.cost.step - 1:+.0%} step time: " + c.why,
        )
        for c in sorted((c for c, _ in best if c is not winner), key=lambda c: c.cost.step)[:4]
    )
    chosen = dataclasses.replace(workload, micro_batch_size=winner.cost.micro_batch_size)
    reasons = _reasons(facts, hw, chosen, winner, by_speed=len(best))
    return Plan(
        _as_run(winner.config, chosen),
        winner.memory,
        reasons,
        runners_up,
        hw,
        chosen,
        facts,
        winner.cost,
        spec,
    )


def _as_run(config: ParallelismConfig, workload: Workload) -> ParallelismConfig:
    """The config prepare() runs (the choice's and every runner-up's): priced with recomputation, it
    turns activation checkpointing on."""
    if workload.activation_checkpointing:
        return dataclasses.replace(config, activation_checkpointing=FULL)
    return config


def _choose(facts: ModelFacts, hw: Hardware, workload: Workload) -> tuple[int | None, list[Candidate]]:
    """(index of the first comfortable fit, else of the first fit, else None; the priced ranked layouts)."""
    ranked = [
        Candidate(
            config, layout_memory(facts, hw.device_memory, workload, config), _why(config, _frozen(facts))
        )
        for config in _ranked_layouts(facts, hw, workload)
    ]
    for limit in (COMFORTABLE_FRACTION, USABLE_FRACTION):
        for index, candidate in enumerate(ranked):
            if candidate.memory.fraction <= limit:
                return index, ranked
    return None, ranked


# -- the guide's order of layouts ---------------------------------------------------------------------
def _ranked_layouts(facts: ModelFacts, hw: Hardware, workload: Workload) -> list[ParallelismConfig]:
    """Every valid layout, the guide's preferred first (docs/planner.md: the orders and why)."""
    per_node = hw.devices_per_node
    tps = _tp_degrees(facts, per_node) if workload.tensor_parallel else []

    def plain(tp: int) -> list[tuple]:
        return [(tp, 1, "ddp")]

    def sharded(tp: int) -> list[tuple]:
        zero, hsdp = [(tp, 1, "zero2"), (tp, 1, "zero3")], [(tp, 1, "hsdp2"), (tp, 1, "hsdp3")]
        return zero + hsdp if hw.nodes == 1 or LINKS_BETWEEN_NODES[hw.inter_node] else hsdp + zero

    def pp_degrees(tp: int) -> list[int]:
        return _pp_degrees(facts, hw.devices // tp) if workload.pipeline else []

    def pipelines(tp: int) -> list[tuple]:
        return [(tp, pp, "zero1") for pp in pp_degrees(tp)]

    # a mixture of experts: its experts divided over EP groups inside a node, the rest ZeRO over all
    experts = [(1, 1, f"ep{e}_zero{z}") for e in _ep_degrees(facts, hw) for z in (2, 3)]
    order: list[tuple] = []
    if hw.nodes > 1 and _huge(facts, hw, workload):
        top = max(tps, default=1)
        order += pipelines(top) + [(top, 1, "zero3"), (top, 1, "hsdp3")]
    if hw.nodes == 1 and not LINKS_WITHIN_NODE[hw.interconnect]:
        order += plain(1) + pipelines(1) + sharded(1)
    for tp in (1, *tps):
        order += plain(tp) + (experts if tp == 1 else []) + sharded(tp)
    for tp in (1, *tps):
        order += pipelines(tp)
    # then the rest (DDP or ZeRO-2/3 under a pipeline), the smallest model split first
    for tp in (1, *tps):
        for pp in (1, *pp_degrees(tp)):
            order += [(tp, pp, data) for data in ("ddp", "zero2", "zero3")]
    # last resort: every shard in host memory, each step copying over PCIe and stepping on the CPU
    order.append((1, 1, "zero3_offload"))
    if not workload.zero:  # plain data parallelism only: ZeRO-1 beside a pipeline becomes DDP
        order = [
            (tp, pp, "ddp" if data == "zero1" else data) for tp, pp, data in order if data in ("ddp", "zero1")
        ]
    configs: list[ParallelismConfig] = []
    for tp, pp, data in order:
        config = _config(hw, tp, pp, data)
        if config is not None and config not in configs:
            configs.append(config)
    return configs


def _huge(facts: ModelFacts, hw: Hardware, workload: Workload) -> bool:
    """True when a ZeRO-3 copy does not fit inside one node, so the model must be split across nodes."""
    one_node = ParallelismConfig(
        dp_replicate_size=1, dp_shard_size=hw.devices_per_node, tp_size=1, pp_size=1, zero_stage=3
    )
    return layout_memory(facts, hw.device_memory, workload, one_node).fraction > USABLE_FRACTION


def _tp_degrees(facts: ModelFacts, per_node: int) -> list[int]:
    """TP degrees > 1 that divide a node's devices and the (kv) heads; transformers only."""
    if facts.shape.layers is None or facts.no_tensor_parallel:
        return []
    return [
        t
        for t in range(2, per_node + 1)
        if per_node % t == 0 and all(h is None or h % t == 0 for h in (facts.heads, facts.kv_heads))
    ]


def _ep_degrees(facts: ModelFacts, hw: Hardware) -> list[int]:
    """Expert-parallel degrees > 1 that divide the experts per layer and a node's devices (the all-to-alls
    then stay on the fast intra-node link, as Megatron-LM and torchtitan place them); none for a dense
    model."""
    experts, per_node = facts.shape.experts, hw.devices_per_node
    if experts < 2:
        return []
    return [e for e in range(2, per_node + 1) if experts % e == 0 and per_node % e == 0]


def _pp_degrees(facts: ModelFacts, devices: int) -> list[int]:
    """Pipeline degrees > 1 that divide `devices` and give every stage at least one block; those that
    also divide the blocks first (equal stages), so they win a tie in speed."""
    degrees = [p for p in range(2, min(devices, facts.blocks) + 1) if devices % p == 0]
    return sorted(degrees, key=lambda p: facts.blocks % p != 0)


def _config(hw: Hardware, tp: int, pp: int, data: str) -> ParallelismConfig | None:
    """The validated config for (tp, pp, data strategy over the rest), or None where it makes no sense."""
    if hw.devices % (tp * pp):
        return None
    dp = hw.devices // (tp * pp)
    options: dict[str, Any] = {"tp_size": tp, "pp_size": pp}
    if pp > 1:
        options["pp_microbatches"] = MICROBATCHES_PER_STAGE * pp
    if data == "ddp" or (data == "zero1" and dp == 1):
        options.update(dp_replicate_size=dp, dp_shard_size=1)
    elif data == "zero3_offload":
        if dp < 2 or tp > 1 or pp > 1:
            return None
        options.update(dp_replicate_size=1, dp_shard_size=dp, zero_stage=3, offload=True)
    elif data.startswith("zero"):
        if dp < 2:
            return None
        options.update(dp_replicate_size=1, dp_shard_size=dp, zero_stage=int(data[-1]))
    elif data.startswith("ep"):  # "ep4_zero3": ep_size=4 beside ZeRO-3 over every device
        ep, zero = data[2:].split("_zero")
        if tp > 1 or pp > 1 or dp % int(ep):
            return None
        options.update(dp_replicate_size=1, dp_shard_size=dp, zero_stage=int(zero), ep_size=int(ep))
    else:  # hsdp: shard inside each node, replicate across nodes
        shard = hw.devices_per_node // tp
        if pp > 1 or hw.nodes < 2 or hw.devices_per_node % tp or shard < 2:
            return None
        options.update(dp_replicate_size=hw.nodes, dp_shard_size=shard, zero_stage=int(data[-1]))
    return ParallelismConfig(**options).validate(hw.devices)


def _frozen(facts: ModelFacts) -> bool:
    """Whether some of the model's parameters are frozen (fine-tuning: LoRA, frozen layers)."""
    return facts.shape.trainable_parameters < facts.shape.parameters


def _why(config: ParallelismConfig, frozen: bool = False) -> str:
    """The guide's reason for a layout's place in the order, one clause per dimension; `frozen`: some
    parameters train no gradients, so ZeRO's gathers of every weight outweigh the gradients' traffic."""
    parts = []
    if config.tp_size > 1:
        parts.append(
            f"TP {config.tp_size} inside a node: every layer split, activations all-reduced in each layer's "
            "forward and backward, so it needs the fast intra-node link"
        )
    if config.pp_size > 1:
        p, m, v = config.pp_size, config.pp_microbatches, stages_per_device(config)
        schedule = "1F1B" if v == 1 else f"interleaved 1F1B ({v} stages per device)"
        formula = "(p-1)/(m+p-1)" if v == 1 else "(p-1)/(v·m+p-1)"
        parts.append(
            f"PP {p}: stages pass only activations, point to point; {schedule} with {m} micro-batches, "
            f"bubble {formula} = {(p - 1) / (v * m + p - 1):.0%}"
        )
    shard, stage, replicas = config.dp_shard_size, config.zero_stage, config.dp_replicate_size
    if (config.ep_size or 1) > 1:
        ep = config.ep_size
        parts.append(
            f"EP {ep} inside a node: each device computes 1/{ep} of every MoE layer's experts, tokens "
            f"sent to them and back by all-to-all; ZeRO-{stage} over {shard} for the rest, over the "
            f"{shard // ep} EP groups beside each other for the experts"
        )
        return "; ".join(parts)
    if stage and replicas > 1:
        parts.append(
            f"HSDP: ZeRO-{stage} over {shard} devices inside each node, {replicas} replicas across nodes; "
            "only a gradient all-reduce crosses the inter-node link"
        )
    elif stage == 1:
        parts.append(
            f"ZeRO-1 over {shard}: optimizer state sharded; with PP the guide uses ZeRO-1 only (ZeRO-2/3 "
            "would reduce-scatter or gather for every micro-batch)"
        )
    elif stage == 2:
        traffic = "every weight gathered, only trainable gradients reduced" if frozen else "DDP's traffic"
        parts.append(
            f"ZeRO-2 over {shard}: gradients and optimizer state sharded, {traffic}, no model change"
        )
    elif stage == 3 and config.offload:
        parts.append(
            f"ZeRO-3 over {shard} with CPU offload: parameters, gradients and optimizer state in host "
            "memory, copied in and out over PCIe every step and stepped on the CPU; the last resort, "
            "proposed only when nothing else fits"
        )
    elif stage == 3:
        traffic = (
            "every weight, frozen or not, while only the trainable ones' gradients are reduced"
            if frozen
            else "1.5x DDP's traffic"
        )
        parts.append(
            f"ZeRO-3/FSDP over {shard}: parameters sharded too and gathered block by block in forward and "
            f"backward ({traffic}), no model change"
        )
    elif replicas > 1:
        parts.append(f"DDP over {replicas}: one gradient all-reduce per step, no model change")
    return "; ".join(parts) or "one device: nothing to parallelise"


def _why_lost(candidate: Candidate, winner: Candidate) -> str:
    need = candidate.memory
    if need.fraction > USABLE_FRACTION:
        return (
            f"does not fit: needs {memory.format_bytes(need.total)} per device, more than "
            f"{USABLE_FRACTION:.0%} of {memory.format_bytes(need.device_memory)}"
        )
    return (
        f"fits only tightly ({need.fraction:.0%} of a device); {winner.config.describe()} fits comfortably "
        f"({winner.memory.fraction:.0%} <= {COMFORTABLE_FRACTION:.0%})"
    )


# -- reasons and the nothing-fits message ------------------------------------------------------------------
def _reasons(
    facts: ModelFacts, hw: Hardware, workload: Workload, winner: Candidate, by_speed: int = 0
) -> tuple[str, ...]:
    precision = workload.bytes
    one_device = ParallelismConfig(dp_replicate_size=1, dp_shard_size=1, tp_size=1, pp_size=1)
    single = layout_memory(facts, hw.device_memory, workload, one_device)
    largest_trainable = (
        facts.largest_layer_parameters
        if facts.largest_layer_trainable is None
        else facts.largest_layer_trainable
    )
    largest_state = sum(
        memory.model_state_bytes("single", precision, facts.largest_layer_parameters, largest_trainable, 1)
    )
    usable = USABLE_FRACTION * hw.device_memory
    reasons = [f"model: {facts.describe()}"]
    if single.fraction <= COMFORTABLE_FRACTION and hw.devices == 1:
        reasons.append(
            f"one device: it holds the model comfortably ({single.fraction:.0%}), nothing to split"
        )
    elif single.fraction <= COMFORTABLE_FRACTION:
        reasons.append(
            f"case 1 (the guide: the model fits onto one device): one device needs "
            f"{memory.format_bytes(single.total)} ({single.fraction:.0%}), so DDP, the guide's first choice; "
            "ZeRO would only save memory that is not needed, at the cost of more communication"
        )
    elif largest_state > usable:
        reasons.append(
            f"case 3 (the guide: the largest layer does not fit onto one device): {facts.largest_layer} "
            f"holds {facts.largest_layer_parameters:,} parameters, {memory.format_bytes(largest_state)} of "
            f"{workload.precision} training state, more than {memory.format_bytes(usable)}; PP keeps layers "
            "whole, so without ZeRO-3 only TP can split it"
        )
    else:
        reasons.append(
            f"case 2 (the guide: the model does not fit onto one device): one device would need "
            f"{memory.format_bytes(single.total)} ({single.fraction:.0%} of "
            f"{memory.format_bytes(hw.device_memory)}), so the model state is sharded or split"
        )
    if facts.shape.trainable_parameters != facts.shape.parameters:
        reasons.append(
            f"fine-tuning, {facts.shape.describe_trainable()}: gradients and optimizer state are counted "
            "(sharded, and their gradients communicated) for the parameters with requires_grad=True only, "
            "the frozen weights as parameters (sharded by ZeRO-3, split by PP and TP)"
        )
    if workload.tensor_parallel and facts.no_tensor_parallel and single.fraction > COMFORTABLE_FRACTION:
        reasons.append(f"TP not proposed: {facts.no_tensor_parallel}")
    if single.fraction > COMFORTABLE_FRACTION:
        reasons.append(_link_reason(facts, hw, workload))
    limit = (
        "comfortably (<= 75% of a device)"
        if winner.memory.fraction <= COMFORTABLE_FRACTION
        else (
            "at all (<= 90%); nothing earlier fits comfortably, so headroom is thin: a smaller micro-batch "
            "or activation checkpointing gives more"
        )
    )
    which = (
        f"the fastest of the {by_speed} layouts that fit {limit}"
        if by_speed
        else f"the first layout in this order that fits {limit}"
    )
    reasons.append(
        f"chosen: {winner.config.describe()}: {winner.why}; {memory.format_bytes(winner.memory.total)} per "
        f"device ({winner.memory.fraction:.0%}), {which}"
    )
    if winner.cost is not None:
        micro_steps = winner.cost.micro_steps
        reasons.append(
            f"global batch {workload.global_batch_size} = micro-batch {winner.cost.micro_batch_size} x "
            f"{micro_steps} micro-steps x dp {winner.config.dp_size}"
            + ("" if winner.config.pp_size > 1 else f" (gradient_accumulation_steps={micro_steps})")
        )
    if winner.config.pp_size > 1 and winner.cost is None:
        reasons.append(
            f"one step runs {winner.config.pp_microbatches} micro-batches through the pipeline (4 per "
            f"stage): global batch = micro-batch x {winner.config.pp_microbatches} x dp "
            f"{winner.config.dp_size} (the guide: mbs x chunks x dp)"
        )
    if winner.config.offload:
        shape, shards = facts.shape, winner.config.dp_shard_size
        host = memory.host_bytes(
            "zero3_offload", precision, shape.parameters, shape.trainable_parameters, shards
        )
        reasons.append(
            f"host memory: {memory.format_bytes(host)} per process for the offloaded shards (parameters, "
            "gradients, optimizer state), pinned; expect each step to be bound by PCIe copies and the "
            "CPU's optimizer step"
        )
    if workload.micro_batch_size is None:
        reasons.append("activations not counted (no micro-batch size and sequence length given)")
    elif facts.shape.layers is None:
        reasons.append("activations not counted: the model is not recognised as a transformer")
    elif workload.activation_checkpointing:
        reasons.append(
            "activation checkpointing assumed: each block keeps only its input and is recomputed in backward"
        )
    return tuple(reasons)


def _link_reason(facts: ModelFacts, hw: Hardware, workload: Workload) -> str:
    if hw.nodes == 1:
        if LINKS_WITHIN_NODE[hw.interconnect]:
            return (
                f"one node linked by {hw.interconnect}: on fast links the guide finds PP, ZeRO and TP "
                "similar; ZeRO comes first because it needs no change to the model, then TP inside the "
                "node, then PP"
            )
        return (
            f"one node linked by {hw.interconnect}: without NVLink the guide finds PP faster than TP or "
            "ZeRO, so pipelines come first (ZeRO-1 over the data-parallel rest), then ZeRO, then TP"
        )
    text = f"{hw.nodes} nodes x {hw.devices_per_node}: TP stays inside a node (tp <= {hw.devices_per_node}); "
    if _huge(facts, hw, workload):
        return text + (
            "a ZeRO-3 copy does not fit inside one node, so the model is split: TP over a node's devices, PP "
            "across nodes (only activations cross the inter-node link, point to point) and ZeRO-1 over the "
            "rest, the guide's DP + PP + TP + ZeRO"
        )
    if LINKS_BETWEEN_NODES[hw.inter_node]:
        return text + (
            f"with a fast inter-node link ({hw.inter_node}) the guide's first choice is ZeRO over all "
            "devices: it needs no change to the model"
        )
    return text + (
        f"a ZeRO-3 copy fits inside one node and the inter-node link ({hw.inter_node}) is slow: HSDP shards "
        "inside each node and only all-reduces gradients across nodes"
    )


def _nothing_fits(facts: ModelFacts, hw: Hardware, workload: Workload, ranked: list[Candidate]) -> PlanError:
    """The error when no layout fits: how short the best one falls, and each remedy re-planned."""
    best = min(ranked, key=lambda c: c.memory.total)
    fixes = []
    if workload.micro_batch_size is not None and facts.shape.layers is not None:
        if not workload.activation_checkpointing:
            checkpointed = dataclasses.replace(workload, activation_checkpointing=True)
            fixes.append(("activation checkpointing", hw, checkpointed))
        if workload.micro_batch_size > 1:
            fixes.append(("micro-batch size 1", hw, dataclasses.replace(workload, micro_batch_size=1)))
    for allowed, label in (("pipeline", "pipeline parallelism"), ("tensor_parallel", "tensor parallelism")):
        if not getattr(workload, allowed):
            fixes.append((f"allowing {label}", hw, dataclasses.replace(workload, **{allowed: True})))
    if workload.precision != "bf16":
        as_bf16 = dataclasses.replace(workload, precision="bf16")
        fixes.append(("bf16 weights (model cast to bfloat16)", hw, as_bf16))
    helps = []
    for label, hardware, changed in fixes:
        index, ranked_fix = _choose(facts, hardware, changed)
        helps.append(
            f"{label}: " + (_fit_text(ranked_fix[index]) if index is not None else "still does not fit")
        )
    for more in _more_devices(hw):
        index, ranked_more = _choose(facts, more, workload)
        if index is not None:
            helps.append(f"{more.describe().split(', ')[0]}: {_fit_text(ranked_more[index])}")
            break
    else:
        helps.append(f"more devices (up to {more.devices}): still does not fit")
    return PlanError(
        f"nothing fits: on {hw.describe()}, training {facts.describe()} in {workload.precision} needs at "
        f"least {memory.format_bytes(best.memory.total)} per device ({best.config.describe()}), more than "
        f"{USABLE_FRACTION:.0%} of {memory.format_bytes(hw.device_memory)}. What would help: "
        + "; ".join(helps)
        + "."
    )


def _fit_text(candidate: Candidate) -> str:
    return f"fits as {candidate.config.describe()} ({memory.format_bytes(candidate.memory.total)} per device)"


def _more_devices(hw: Hardware) -> list[Hardware]:
    """Bigger versions of `hw`: the node filled up to 8 devices first, then twice the nodes, up to 1024x."""
    grown = []
    per_node, nodes = hw.devices_per_node, hw.nodes
    while len(grown) < 10:
        if per_node < 8:
            per_node *= 2
        else:
            nodes *= 2
        grown.append(dataclasses.replace(hw, devices=per_node * nodes, nodes=nodes))
    return grown
