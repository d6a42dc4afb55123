"""Consolidated model weights for use without unison: one safetensors file (or torch.save as fallback).

`consolidated_state_dict` gathers the full, unsharded state dict of a model from any layout (plain,
DDP, FSDP2/ZeRO, tensor parallel, pipeline stages that each hold some of the keys) onto process 0;
`save_consolidated_weights` writes it as the very file one process would write for the same weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.ddp import unwrap
from ..state import PartialState
from .storage import raise_if_any_process_failed

SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"


def save_model_weights(model: torch.nn.Module, directory: Path, safe_serialization: bool = True) -> Path:
    """Write `model`'s weights into `directory`; returns the file written.

    safetensors stores tensors only (nothing to execute on load) and keeps tied weights once;
    `safetensors.torch.load_model(model, path)` reads them back into a freshly built model.
    One process, a model whose state dict is complete on it: for any layout use
    `save_consolidated_weights`.
    """
    return write_weights(model.state_dict(), directory, safe_serialization)


def write_weights(
    state_dict: dict[str, torch.Tensor], directory: Path, safe_serialization: bool = True
) -> Path:
    """Write a complete state dict as `model.safetensors` (or `pytorch_model.bin`); returns the file.

    Entries that are one tensor (tied weights) are written once, exactly as safetensors' save_model
    does for a module: the same names kept, the same metadata recording the dropped ones.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if not safe_serialization:
        path = directory / TORCH_FILE
        torch.save(state_dict, path)
        return path
    path = directory / SAFETENSORS_FILE
    safetensors_save_model()(_StateDictHolder(state_dict), str(path))
    return path


def save_on_main_process(
    obj: Any, f: str | os.PathLike, safe_serialization: bool = False, save_on_each_node: bool = False
) -> None:
    """`torch.save(obj, f)` (or a safetensors file of a tensor dict) by the main process only, or by
    each node's local main process with save_on_each_node. Not collective: scripts call it inside
    `if accelerator.is_main_process:` as often as outside it."""
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if not safe_serialization:
        torch.save(obj, f)
        return
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise TypeError(
            f"save(..., safe_serialization=True) writes a safetensors file, which holds a dict of tensors; "
            f"got a {type(obj).__name__}. Pass a state dict, or safe_serialization=False for torch.save."
        )
    safetensors_save_model()(_StateDictHolder(obj), os.fspath(f))  # tied tensors once, as save_model


def safetensors_save_model() -> Callable[..., None]:
    """safetensors' save_model, imported on first use: safetensors is an optional extra of unison.

    Collective savers call this on every process before any work, so a missing package fails the
    same way everywhere instead of on the writing process after the others have moved on.
    """
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise ImportError(
            "save_model writes safetensors files, but the safetensors package is not installed: "
            "`pip install 'unison[safetensors]'` (or `pip install safetensors`), or pass "
            "safe_serialization=False for a torch.save file."
        ) from None
    return save_model


class _StateDictHolder(torch.nn.Module):
    """Hands safetensors' save_model a ready state dict: it reads nothing but `state_dict()`, so its
    handling of tied weights applies to a consolidated dict as it does to the module itself."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._weights = state_dict

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return dict(self._weights)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _tie(state: dict[str, torch.Tensor], module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Entries of one shared parameter or buffer (tied weights) share one tensor again after gathering
    copied them apart, as in `module.state_dict()`.

    Pipeline stages hold a weight tied across stages as separate copies; a model that names such
    weights in `tied_names` (tuples of full-model names of one weight, as unison's PipelineModel
    does) gets them tied in the gathered dict as well.
    """
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    for group in [*names.values(), *getattr(module, "tied_names", ())]:
        present = [name for name in group if name in state]
        for name in present[1:]:
            state[name] = state[present[0]]
    return state


def consolidated_state_dict(model: torch.nn.Module, all_ranks: bool = False) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict of `model` on CPU, keyed as the user's module, from any layout.

    Collective when processes run together: every process calls it. Process 0 receives the tensors
    (the others get an empty dict, which spares their memory) unless `all_ranks` is True. Tied weights
    share one tensor, as in `module.state_dict()`; and as there, the tensors of a model that is whole on
    each process (plain, DDP) on the CPU are the live ones: clone them to keep a snapshot while training
    goes on. Pipeline stages (processes holding different keys) each contribute their own keys,
    gathered in the order of the processes.
    """
    module = unwrap(model)
    if not _distributed():
        return _tie({key: value.detach().cpu() for key, value in module.state_dict().items()}, module)
    # torch's state-dict helpers load DCP and DTensor (0.5 s): only collective saves need them.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    world = dist.get_world_size()
    keys = list(get_model_state_dict(module).keys())
    everyone: list[list[str] | None] = [None] * world
    dist.all_gather_object(everyone, keys)
    if all(other == keys for other in everyone):
        state = get_model_state_dict(
            module, options=StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)
        )
        state = {key: value.cpu() for key, value in state.items()}
        return _tie(state, module) if state else state
    # Pipeline stages: each process gathers its stage's full tensors (collective inside a stage's mesh),
    # then the lowest process holding a key sends it to process 0.
    rank = dist.get_rank()
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    owner = {}
    for process, its_keys in enumerate(everyone):
        for key in its_keys:
            owner.setdefault(key, process)
    mine = _tie({key: value.cpu() for key, value in full.items() if owner[key] == rank}, module)
    pieces: list[dict[str, torch.Tensor] | None] = [None] * world
    if all_ranks:
        dist.all_gather_object(pieces, mine)
    else:
        dist.gather_object(mine, pieces if rank == 0 else None, dst=0)
        if rank != 0:
            return {}
    return _tie({key: value for piece in pieces for key, value in piece.items()}, module)


def save_consolidated_weights(
    model: torch.nn.Module, directory: Path, safe_serialization: bool = True
) -> Path:
    """Write `model`'s consolidated weights from any layout; process 0 writes. Collective.

    The file holds exactly what one process would write for the same weights with `save_model_weights`
    (same names, tied weights once, same metadata). Returns the file's path on every process.
    """
    if safe_serialization:
        safetensors_save_model()  # a missing package fails here, on every process, before gathering
    state = consolidated_state_dict(model)
    path = directory / (SAFETENSORS_FILE if safe_serialization else TORCH_FILE)
    error = None
    if PartialState().is_main_process:
        try:
            write_weights(state, directory, safe_serialization)
        except Exception as exc:  # every process hears of it, not only the one that wrote
            error = exc
    raise_if_any_process_failed(error, f"writing {path}")
    return path
