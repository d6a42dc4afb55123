"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

Modes (the `activation_checkpointing` of ParallelismConfig, the Accelerator and `unison launch`):

- "full": every block keeps only its input; its forward runs again in backward.
- "selective:K": every K-th block (the K-th, 2K-th, ... of the block list, torchtitan's `ac_freq`) is
  checkpointed fully, the others keep all their activations: a memory/time dial between none and full.
- "selective" (= "selective:op"): op-level selective checkpointing, as torchtitan's save list: inside
  every block the outputs of the matrix multiplications and of attention (the expensive ops) are kept,
  everything else (norms, activations functions, dropout, reshapes) is recomputed. Built on torch's
  public `create_selective_checkpoint_contexts`.

The blocks are the ones ZeRO-3 shards (`parallel.zero.resolve_blocks`: `zero_blocks` when the user names
them, else `blocks.find_blocks`), so memory estimates and sharding talk about the same unit.

Why torch's composable `torch.distributed._composable.checkpoint` rather than `checkpoint_wrapper`
(torchtitan's choice) or a hand-made mechanism:
- `checkpoint_wrapper` puts a wrapper module around each block, so every parameter name gains
  `_checkpoint_wrapped_module.`: optimizers built before prepare() would no longer find their
  parameters by name, `named_parameters()` would differ from the user's, and checkpoints would not load
  across AC on/off without key rewriting. The composable API works through two forward hooks on the
  block itself, so names, `state_dict()` and the module tree stay the user's.
- It is the form FSDP2 is built to compose with: `fully_shard` applied afterwards leaves the
  recomputation's pre-forward to FSDP2's pre-backward unshard (FSDP2 skips its pre-forward during
  backward), and DTensor (tensor parallel) and the pipeline stages only see ordinary forward calls.
- Its hooks call torch.utils.checkpoint's non-reentrant engine (RNG state preserved, so dropout
  recomputes the same masks; `torch.autograd.grad` works, which the pipeline schedules use).
- The price is a private import path; it lives only here and tests/test_torch_private_apis.py pins it.
A public-API alternative that keeps names would have to call `torch.utils.checkpoint.checkpoint` from
inside the block's forward, which means replacing the user's forward: the house rules forbid that.

Applied in torchtitan's order by `parallel.apply`: after tensor parallel, before compile and the
data-parallel engine (FSDP2 / DDP), on a whole model or on each pipeline stage's module.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from .checkpointing_modes import FULL, SELECTIVE_OP, normalize_mode

if TYPE_CHECKING:
    from .config import ParallelismConfig


def resolve_mode(config: ParallelismConfig, argument: Any, exported: str | None) -> ParallelismConfig:
    """`config` with the activation checkpointing the run asked for, by precedence: the Accelerator's
    `activation_checkpointing` argument when given (False or "none" turn it off), else the config's own
    field, else `exported` (`unison launch --activation-checkpointing`'s variable), else none."""
    if argument is not None:
        mode = normalize_mode(argument)
    elif config.activation_checkpointing is not None:
        mode = normalize_mode(config.activation_checkpointing)
    else:
        mode = normalize_mode(exported, "UNISON_ACTIVATION_CHECKPOINTING")
    return dataclasses.replace(config, activation_checkpointing=mode)


def checkpoint_every(mode: str) -> int | None:
    """K of "selective:K" (1 for "full"), or None for op-level selective checkpointing."""
    if mode == FULL:
        return 1
    return None if mode == SELECTIVE_OP else int(mode.partition(":")[2])


def checkpointed_block_count(mode: str | None, blocks: int) -> int:
    """How many of `blocks` blocks a block-level mode checkpoints (blocks K, 2K, ...); 0 without AC and
    for op-level selective, whose blocks are all partially recomputed instead."""
    if mode is None or mode == SELECTIVE_OP:
        return 0
    return blocks // checkpoint_every(mode)


@functools.cache
def saved_ops() -> frozenset:
    """The ops whose outputs op-level selective checkpointing keeps: torchtitan's save list (matrix
    multiplications, every scaled_dot_product_attention kernel, including the CPU one, and the
    reduce-scatter of sequence parallel), plus addmm, which a Linear with a bias calls on CPU and GPU."""
    import torch

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    return frozenset(
        (
            aten.mm.default,
            aten.addmm.default,
            aten._scaled_mm.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            c10d.reduce_scatter_tensor.default,
        )
    )


def _selective_contexts() -> tuple[Any, Any]:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(list(saved_ops()))


def apply_activation_checkpointing(model: nn.Module, mode: str, blocks: str | None = None) -> list[nn.Module]:
    """Checkpoint `model`'s blocks (the ones `blocks` names, else those found) as `mode` says, in place.

    Returns the blocks checkpointed. Call after tensor parallel and before FSDP2/DDP (and compile).
    Parameter names, the module tree and `state_dict()` keys do not change (module docstring).
    """
    from torch.distributed._composable import checkpoint  # private path: see the module docstring

    from .zero import resolve_blocks

    units = resolve_blocks(model, blocks)
    if not units:
        raise ValueError(
            f"activation_checkpointing={mode!r}: {type(model).__name__} has no block list to checkpoint "
            "(no ModuleList/Sequential of one class). Name the blocks with ParallelismConfig(zero_blocks="
            "'transformer.h') or block class names (zero_blocks='GPT2Block'), or leave activation "
            "checkpointing off."
        )
    every = checkpoint_every(mode)
    chosen = units if every is None else units[every - 1 :: every]
    for block in chosen:
        if every is None:
            checkpoint(block, context_fn=_selective_contexts)
        else:
            checkpoint(block)
    return chosen
