"""Models bigger than one device: build them without memory, let prepare() give each rank its shards.

`init_empty_weights()` is Accelerate's name for building a model on torch's meta device (shapes and
dtypes, no storage). Such a model passed to `Accelerator.prepare()` is sharded first and then each
process allocates its own shards only (see unison/parallel/materialize.py for where the values come
from: the model's own init, or process 0's weights broadcast one tensor at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build the modules created inside the block on the meta device: no memory, no init compute.

    torch's own `torch.device("meta")` context underneath, so parameters and buffers are both on meta.
    Accelerate's `include_buffers=False` (buffers real, parameters on meta) would need nn.Module's
    registration patched for the block; unison does not patch torch, so it is refused: build the
    buffers the model cannot recompute in its `init_weights()` outside the block instead.
    """
    if include_buffers is False:
        raise ValueError(
            "init_empty_weights(include_buffers=False): unison builds everything in the block on the meta "
            "device (torch.device('meta')), buffers included, and does not patch nn.Module to keep "
            "buffers real. Leave include_buffers unset; prepare() refills buffers from the model's own "
            "init or from process 0's weights, and keeps any buffer built outside the block as it is."
        )
    with torch.device("meta"):
        yield
