"""`unison estimate-memory`'s table: bytes per device for every precision and strategy at a device count.

It puts together the model state and host bytes of `memory` and the activations of `activation_memory`
(which builds on `memory`'s shapes), so it sits above both.
"""

from __future__ import annotations

import math

from .activation_memory import cast_parameters, estimate_activation_bytes
from .memory import (
    PRECISIONS,
    STRATEGIES,
    DeviceMemory,
    MemoryEstimate,
    ModelShape,
    autocast_copy_bytes,
    format_bytes,
    host_bytes,
    model_state_bytes,
    zero_gathered_unit_bytes,
)


def estimate(
    shape: ModelShape,
    devices: int,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    attention_heads: int | None = None,
    activation_checkpointing: str | None = None,
) -> MemoryEstimate:
    """Bytes per device for every precision in PRECISIONS and strategy in STRATEGIES at `devices`.

    `activation_checkpointing` is a mode of parallel.checkpointing ("full", "selective:op",
    "selective:K", canonical as normalize_mode returns it) or None; its activations come from
    unison.planning.activation_memory."""
    if devices < 1:
        raise ValueError(f"devices={devices}: need at least one device.")
    if (micro_batch_size is None) != (seq_len is None):
        raise ValueError(
            f"micro_batch_size={micro_batch_size}, seq_len={seq_len}: activations need both; "
            "give both or neither."
        )
    fp32 = PRECISIONS[0]
    offloaded = host_bytes("zero3_offload", fp32, shape.parameters, shape.trainable_parameters, devices)
    notes = [
        "TP and PP rows are estimates: ~1/N of the model state (replicated norms/biases and uneven "
        "stages add some).",
        f"ZeRO-2/3 rows include the largest FSDP2 unit ({shape.largest_unit or shape.parameters:,} "
        "parameters: a block, or everything outside the blocks) held whole: its gradients before the "
        "reduce-scatter, and under ZeRO-3 its parameters while it computes (as `unison plan` counts).",
        "bf16-mixed is mixed_precision='bf16' as unison runs it: fp32 master parameters, gradients and Adam "
        "state, bf16 compute; its parameter column adds autocast's bf16 weight copies kept for backward "
        "(2 bytes per parameter computed on the device that backward passes through) except under "
        "ZeRO-2/3, whose FSDP2 gathers bf16 weights (ZeRO-2 holds them whole beside its fp32 shards).",
        "ZeRO-3 + offload keeps parameters, gradients and Adam state in host memory "
        f"({format_bytes(offloaded)} per process in fp32); the device holds the unit being computed and "
        "the activations.",
    ]
    notes += _frozen_notes(shape)
    ep = math.gcd(devices, shape.experts) if shape.experts > 1 else 1
    if shape.experts:
        notes.append(
            f"mixture of experts: {shape.expert_parameters:,} of the parameters are in {shape.expert_layers} "
            f"experts modules of {shape.experts} experts, {shape.experts_per_token} per token "
            f"({shape.active_parameters:,} parameters compute each token)"
            + (
                f"; the ep={ep} + ZeRO-3 row divides the experts over {ep} processes and shards each "
                f"process's over the {devices // ep} EP groups beside each other (docs/expert-parallel.md)"
                if ep > 1
                else ""
            )
            + "; activations count the experts as one dense MLP."
        )
    with_activations = micro_batch_size is not None
    if with_activations and shape.layers is None:
        notes.append("not recognised as a transformer (no block list with attention): activations skipped.")
        with_activations = False
    elif with_activations:
        notes.append(
            f"activations: Korthikanti et al. 2022, {shape.layers} blocks ({shape.blocks}), hidden "
            f"{shape.hidden}, "
            + (
                f"activation checkpointing {activation_checkpointing} (docs/memory-estimator.md), "
                if activation_checkpointing
                else "no recomputation, "
            )
            + (f"attention scores stored ({attention_heads} heads)" if attention_heads else "fused attention")
            + (
                f", fp32 logits over vocabulary {shape.vocab} and backward's first fp32 gradients over it"
                if shape.vocab
                else ""
            )
            + "; PP assumes 1F1B."
        )
    rows = []
    for precision in PRECISIONS:
        for strategy, _, is_estimate in STRATEGIES:
            p, g, o = model_state_bytes(
                strategy, precision, shape.parameters, shape.trainable_parameters, devices
            )
            if devices > 1:
                unit = shape.largest_unit or shape.parameters
                extra_p, extra_g = zero_gathered_unit_bytes(
                    strategy, precision, unit, shape.largest_unit_trainable
                )
                p, g = p + extra_p, g + extra_g
            split = devices if strategy in ("tp", "pp") else 1
            computed = math.ceil(shape.reached_parameters / split)
            p += autocast_copy_bytes(
                precision, cast_parameters(shape, activation_checkpointing, computed, split), strategy
            )
            activations = None
            if with_activations:
                activations = estimate_activation_bytes(
                    shape,
                    micro_batch_size,
                    seq_len,
                    precision.activation_bytes,
                    activation_checkpointing,
                    tensor_parallel=devices if strategy == "tp" else 1,
                    attention_heads=attention_heads,
                    loss_gradients=True,  # a single step's peak, as torch's cross-entropy runs it
                )
            rows.append(DeviceMemory(precision.name, strategy, is_estimate, p, g, o, activations))
            if strategy == "zero3" and ep > 1:
                rows.append(_expert_parallel_row(shape, precision, devices, ep, activations))
    return MemoryEstimate(shape, devices, micro_batch_size, seq_len, tuple(rows), tuple(notes))


def _expert_parallel_row(
    shape: ModelShape, precision, devices: int, ep: int, activations: int | None
) -> DeviceMemory:
    """ZeRO-3 with the experts divided over `ep` processes and sharded over the devices/ep EP groups."""
    dense = shape.parameters - shape.expert_parameters
    trainable = shape.trainable_parameters / shape.parameters
    p, g, o = model_state_bytes("zero3", precision, dense, math.ceil(dense * trainable), devices)
    experts = shape.expert_parameters // ep
    ep_p, ep_g, ep_o = model_state_bytes(
        "zero3", precision, experts, math.ceil(experts * trainable), devices // ep
    )
    in_block = shape.expert_parameters // max(1, shape.expert_layers)
    block = (shape.block_parameters or 0) - in_block + in_block // ep
    unit = max(block, shape.parameters - (shape.block_parameters or 0) * (shape.layers or 0))
    extra_p, extra_g = zero_gathered_unit_bytes(
        "zero3", precision, unit, min(unit, shape.largest_unit_trainable)
    )
    return DeviceMemory(
        precision.name, f"ep{ep}_zero3", False, p + ep_p + extra_p, g + ep_g + extra_g, o + ep_o, activations
    )


def _frozen_notes(shape: ModelShape) -> list[str]:
    """What the table says of a model trained in part (frozen weights, adapters) or not at all."""
    if shape.trainable_parameters == shape.parameters:
        return []
    if shape.trainable_parameters == 0:
        return [
            "no trainable parameters: every parameter has requires_grad=False, so there is nothing to "
            "train (an optimizer refuses an empty parameter list) and the gradient and optimizer columns "
            "are 0; unfreeze some or add adapters (e.g. peft's get_peft_model) in the factory."
        ]
    return [
        f"{shape.describe_trainable()}: gradients and Adam state only for the parameters with "
        "requires_grad=True (sharded as the strategy shards them); the frozen ones count as parameters. "
        "Activations are counted as for training every parameter (an over-estimate: a frozen weight's "
        "input need not be kept)."
    ]
