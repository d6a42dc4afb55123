"""Models bigger than one device: build them without memory, let prepare() give each rank its shards.

`init_empty_weights()` is Accelerate's name for building a model on torch's meta device (shapes and
dtypes, no storage). Such a model passed to `Accelerator.prepare()` is sharded first and then each
process allocates its own shards only (see unison/parallel/materialize.py for where the values come
from: the model's own init, or process 0's weights broadcast one tensor at a time).

Built on meta, the init draws nothing from the CPU generator; so that prepare() can replay it with the
draws a normal build would make (unison/parallel/init_replay.py), each tensor registered in the block
notes the generator's state at that moment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from .accelerate_surface.names import mirror
from .parallel.init_replay import BuildNotes

# Accelerate's value (the layers its layerwise casting upcasts); unison has no such hooks
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose1d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
    torch.nn.Linear,
)


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build the modules created inside the block on the meta device: no memory, no init compute.

    torch's own `torch.device("meta")` context underneath, so parameters and buffers are both on meta.
    Each tensor registered in the block notes the CPU generator's state (torch's global module
    registration hooks, for the block only), which prepare() replays the model's init from.
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
    notes = BuildNotes()
    hooks = [
        register_module_parameter_registration_hook(notes.note),
        register_module_buffer_registration_hook(notes.note),
    ]
    try:
        with torch.device("meta"):
            yield
    finally:
        for hook in hooks:
            hook.remove()


# Accelerate's other names of accelerate.big_modeling (dispatch, offload, hooks): stand-ins that say why
__getattr__, __dir__, _ = mirror(__name__, globals())
