"""Activation memory under activation checkpointing: estimated from a model's shape, and measured exactly.

Estimate (what `unison estimate-memory --activation-checkpointing MODE` and `unison plan` count), per
device for one micro-batch, with A = memory.activation_bytes for one block (Korthikanti et al. 2022),
L blocks, s·b·h the activation elements of a block's input and e bytes per element:

    none            L·A + logits                               (memory.activation_bytes as it was)
    full            L·s·b·h·e    (each block keeps its input)  + head  + A (one block rebuilt in backward)
    selective:K     (L - n)·A + n·s·b·h·e, n = L // K          + head  + A
    selective (op)  L·s·b·(h + o + h')·e                        + head  + A - s·b·(h + o + h')·e

with head = logits + 2·s·b·h·e: the fp32 logits and the inputs of the final norm and the output layer.

`unison estimate-memory` adds the peak of backward's first moment: G = 2·logits, the loss's gradient over
the vocabulary, which backward computes first and in fp32 (torch's cross-entropy runs in fp32 under
autocast): the gradients of the log-probabilities and of the logits, alive together beside every kept
activation (so the last term becomes max(A, G), and G without checkpointing). For GPT-2 (a 50,304-word
vocabulary) at 8 x 1,024 tokens G is 3.1 GiB, more than twelve checkpointed blocks keep; without it the
estimated peak was 30-45% low on an H100 (benchmarks/gpu_memory.py, 2026-11-26). The planner leaves G
out for now: counting it moves three of the published runs it is checked against (tests/
test_planner_published.py: Llama 3.1 8B's FSDP over 8 H100s, and two of Megatron-LM's table, whose fused
vocabulary-parallel cross-entropy computes that gradient in place) to other layouts, and whether it
should is not settled by one single-GPU measurement.
(The Korthikanti per-block figure A counts 1-byte dropout masks, s·b·h·2 per block, which a model without
dropout does not keep; without checkpointing they stand in for those two head inputs, measured within
1% on the example GPT. With checkpointing the masks are recomputed, so the head inputs are counted.)

where o is the sum of the output widths of a block's Linear layers (the matmul outputs the save list
keeps: 9h in a GPT block, q|k|v + out + fc + proj) and h' the attention output (h); under tensor
parallel of degree t, o and h' split by t, the block input does not (it is replicated without
sequence parallelism). Op-level selective recomputes only cheap element-wise ops, one op at a time, so
no whole block is rebuilt at once in backward: its extra peak is a few element-wise tensors, not A.

Measurement (`measure_saved_activations`): the bytes autograd keeps for backward after one forward,
counted with torch.autograd.graph.saved_tensors_hooks (each storage once; parameters and buffers are
the model state, not activations). Under checkpointing, torch saves each checkpointed block's inputs
through autograd before its hooks take over, so the outer hooks see them; op-level selective keeps its
saved op outputs in a cache instead, so a TorchDispatchMode counts the outputs of the save-list ops
that run inside checkpointed blocks. This is the "bytes saved for backward per micro-batch" of the
estimate, without the allocator's rounding or the transient peak of recomputation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..parallel.checkpointing import SELECTIVE_OP, checkpointed_block_count, saved_ops
from . import memory


def estimate_activation_bytes(
    shape: memory.ModelShape,
    micro_batch_size: int,
    seq_len: int,
    element_bytes: int,
    mode: str | None = None,
    tensor_parallel: int = 1,
    attention_heads: int | None = None,
    loss_gradients: bool = False,
) -> int:
    """Activation bytes per device for one micro-batch under checkpointing `mode`: what forward keeps plus
    what backward rebuilds at once (`activation_parts`, module docstring); with `loss_gradients`, plus
    the larger of that rebuild and the loss's gradients instead (G, as `unison estimate-memory` counts)."""
    kept, rebuilt = activation_parts(
        shape, micro_batch_size, seq_len, element_bytes, mode, tensor_parallel, attention_heads
    )
    if loss_gradients:
        rebuilt = max(rebuilt, loss_gradient_bytes(shape, micro_batch_size, seq_len, tensor_parallel))
    return kept + rebuilt


def activation_parts(
    shape: memory.ModelShape,
    micro_batch_size: int,
    seq_len: int,
    element_bytes: int,
    mode: str | None = None,
    tensor_parallel: int = 1,
    attention_heads: int | None = None,
) -> tuple[int, int]:
    """(bytes saved for backward after forward, bytes one block's recomputation adds in backward).

    `mode` is a canonical mode of parallel.checkpointing.normalize_mode (None: no checkpointing, so
    nothing is recomputed). The first figure is what `measure_saved_activations` measures.
    """
    if mode is None:
        kept = memory.activation_bytes(
            shape, micro_batch_size, seq_len, element_bytes, tensor_parallel, attention_heads
        )
        return kept, 0
    one = dataclasses.replace(shape, layers=1, vocab=None)
    block = memory.activation_bytes(
        one, micro_batch_size, seq_len, element_bytes, tensor_parallel, attention_heads
    )
    tokens = seq_len * micro_batch_size
    block_input = tokens * shape.hidden * element_bytes
    logits = 4 * tokens * shape.vocab / tensor_parallel if shape.vocab else 0
    logits += 2 * block_input  # the final norm's and the output layer's inputs (module docstring)
    if mode == SELECTIVE_OP:
        outputs = (shape.block_linear_outputs or 9 * shape.hidden) + shape.hidden  # + attention's output
        kept_per_block = block_input + tokens * outputs * element_bytes / tensor_parallel
        return math.ceil(kept_per_block * shape.layers + logits), math.ceil(max(block - kept_per_block, 0))
    checkpointed = checkpointed_block_count(mode, shape.layers)
    kept = (shape.layers - checkpointed) * block + checkpointed * block_input + logits
    return math.ceil(kept), block if checkpointed else 0


def loss_gradient_bytes(
    shape: memory.ModelShape, micro_batch_size: int, seq_len: int, tensor_parallel: int = 1
) -> int:
    """G of the module docstring: the fp32 gradients of the log-probabilities and of the logits that a
    cross-entropy's backward holds together at its start (0 for a model without a vocabulary)."""
    if not shape.vocab:
        return 0
    return math.ceil(2 * 4 * seq_len * micro_batch_size * shape.vocab / tensor_parallel)


def cast_parameters(shape: memory.ModelShape, mode: str | None, computed: int, split: int = 1) -> int:
    """Of the `computed` trainable parameters a device computes with (its share: Ψ/`split` under TP and
    PP), those whose autocast bf16 copies stay saved from forward to backward under checkpointing `mode`.

    A checkpointed block's casts happen inside it, so they are not kept but made again when it is
    recomputed: full and op-level selective keep none of the blocks' (casts are cheap ops, recomputed),
    selective:K those of the blocks it does not checkpoint; one recomputed block's exist at a time.
    """
    if mode is None or not shape.block_parameters or not shape.layers:
        return computed
    dropped = shape.layers if mode == SELECTIVE_OP else checkpointed_block_count(mode, shape.layers)
    block = math.ceil(shape.block_parameters / split)
    if not dropped:
        return computed
    return min(computed, max(computed - dropped * block, 0) + block)


def measure_saved_activations(
    model: nn.Module, forward: Callable[[], Any], selective_blocks: Sequence[nn.Module] = ()
) -> tuple[int, Any]:
    """(bytes `forward()` leaves saved for backward, its result): each storage once, the model's
    parameters and buffers excluded, plus the save-list op outputs that op-level selective checkpointing
    caches inside `selective_blocks` (the blocks it was applied to; module docstring).

    For a single-process model (prepared or not); call backward on the result, or drop it, afterwards.
    """
    state = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    seen: dict[tuple, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in state:
            seen[key] = _local(tensor).untyped_storage().nbytes()
        return tensor

    counter = _CachedOutputs(seen)
    handles = [
        hook
        for block in selective_blocks
        for hook in (
            block.register_forward_pre_hook(counter.enter),
            block.register_forward_hook(counter.leave, always_call=True),
        )
    ]
    try:
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = forward()
    finally:
        for handle in handles:
            handle.remove()
    return sum(seen.values()), result


class _CachedOutputs(TorchDispatchMode):
    """Counts the outputs of the save-list ops (parallel.checkpointing.saved_ops) run inside a block that
    op-level selective checkpointing covers: torch caches them outside autograd's saved tensors."""

    def __init__(self, seen: dict[tuple, int]) -> None:
        super().__init__()
        self.seen = seen
        self.depth = 0  # selective blocks whose forward is running

    def enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth and func in saved_ops():
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.seen[_storage_key(tensor)] = _local(tensor).untyped_storage().nbytes()
        return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _storage_key(tensor: torch.Tensor) -> tuple:
    local = _local(tensor)
    return (local.device, local.untyped_storage().data_ptr())
