"""Context parallelism (cp): each rank of a cp group holds 1/cp of every sequence of the batch.

Built on torch's `context_parallel` (torch.distributed.tensor.experimental), which shards the given
buffers along their sequence dimension in place and, while the block runs, turns the query, key and value
of every `F.scaled_dot_product_attention` call into DTensors sharded on the sequence over the cp mesh.

What torch 2.13 does with those DTensors depends on the SDPA kernel, measured on CPU/gloo
(docs/context-parallel.md):
- torch's ring attention handles only the CUDA kernels (flash, memory-efficient, cuDNN); CPU's fused
  kernel (`_scaled_dot_product_flash_attention_for_cpu`) has neither a ring handler nor a DTensor sharding
  rule, so the default SDPA fails under `context_parallel` on CPU ("does not have a sharding strategy").
- With the math kernel, SDPA decomposes into matmul/softmax that DTensor shards by itself: each rank keeps
  its rows of queries and gathers keys and values (all-gather context parallelism, as in Llama 3), exact
  against one process. A causal mask is a plain tensor there, so it needs `implicit_replication`, and
  torch's default head-tail load balancing must be off: it reorders the sequence, and the math kernel's
  causal mask does not know the order (outputs off by 0.3 when it is on).
So on CPU this module runs the block under the math kernel, implicit replication and no load balancing;
on CUDA it leaves torch's ring attention and its defaults alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

CP_DIM = "cp"
"""The mesh dimension of context parallelism."""


@contextlib.contextmanager
def context_parallel_block(
    mesh: DeviceMesh,
    buffers: list[torch.Tensor] | None,
    buffer_seq_dims: list[int] | None,
    no_restore_buffers: set[torch.Tensor] | None,
) -> Iterator[None]:
    """Run the block with `buffers` sharded along `buffer_seq_dims` over `mesh["cp"]` and every
    scaled_dot_product_attention computed over the whole sequence (see the module docstring)."""
    from torch.distributed.tensor.experimental import context_parallel, implicit_replication

    cp_mesh = mesh[CP_DIM]
    buffers = list(buffers or [])
    seq_dims = list(buffer_seq_dims or [])
    check_buffers(buffers, seq_dims, cp_mesh.size())
    with contextlib.ExitStack() as stack:
        if cp_mesh.device_type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            stack.enter_context(implicit_replication())
            stack.enter_context(_load_balancing(False))
        stack.enter_context(
            context_parallel(
                cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=no_restore_buffers
            )
        )
        yield


def check_buffers(buffers: list[torch.Tensor], seq_dims: list[int], cp_size: int) -> None:
    """Raise ValueError unless every buffer is a tensor whose sequence dimension divides by cp_size
    (torch shards evenly and would misplace the remainder), with one sequence dimension per buffer."""
    if not buffers:
        raise ValueError(
            f"maybe_context_parallel() was given no buffers, but cp_size={cp_size} splits every sequence "
            "over the cp ranks: pass the batch tensors that have a sequence dimension, e.g. "
            "buffers=[input_ids, labels, position_ids], buffer_seq_dims=[1, 1, 1]."
        )
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"maybe_context_parallel() got {len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims: give "
            "one sequence dimension per buffer, e.g. buffer_seq_dims=[1, 1] for two (batch, seq) tensors."
        )
    for index, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(buffer, torch.Tensor) or isinstance(buffer, torch.nn.Parameter):
            raise ValueError(
                f"buffers[{index}] is a {type(buffer).__qualname__}: context parallelism shards batch "
                "tensors in place; pass tensors of the batch (never parameters)."
            )
        if not -buffer.dim() <= dim < buffer.dim() or buffer.shape[dim] % cp_size:
            raise ValueError(
                f"buffers[{index}] has shape {tuple(buffer.shape)} and buffer_seq_dims[{index}]={dim}: its "
                f"sequence dimension must exist and divide by cp_size={cp_size}. Pad or crop the sequences "
                f"to a multiple of {cp_size}."
            )


@contextlib.contextmanager
def _load_balancing(enabled: bool) -> Iterator[None]:
    """torch's head-tail load balancing of the sequence, on or off for the block.

    private, the one switch there is (tests/test_torch_private_apis.py): `context_parallel` reads
    `_cp_options.enable_load_balance` to decide whether to reorder the sequence before sharding it.
    """
    from torch.distributed.tensor.experimental._attention import _cp_options

    before = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = enabled
    try:
        yield
    finally:
        _cp_options.enable_load_balance = before


def check_context_parallel_layout(config) -> None:
    """Raise ValueError for layouts with cp_size > 1 that unison does not run (a pure check of the
    config, so every rank raises the same error before any work)."""
    if (config.pp_size or 1) > 1:
        raise ValueError(
            f"cp_size={config.cp_size} with pp_size={config.pp_size}: context parallelism beside pipeline "
            "parallelism is not supported (the pipeline schedule runs each stage's forward itself, outside "
            "the block that maybe_context_parallel() shards the sequence in). Use cp_size with dp_shard_size "
            "and tp_size, or pp_size without cp_size."
        )
    if config.zero_stage == 1:
        raise ValueError(
            f"cp_size={config.cp_size} with zero_stage=1: context-parallel ranks average their gradients "
            "through FSDP2 (over dp_shard x cp), which ZeRO-1's sharded optimizer does not use. Use "
            "zero_stage=2 or 3 (or leave it None)."
        )
