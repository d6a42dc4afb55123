"""Consolidated model weights for use without unison: one safetensors file (or torch.save as fallback).

`consolidated_state_dict` gathers the full, unsharded state dict of a model from any layout (plain,
DDP, FSDP2/ZeRO, tensor parallel, pipeline stages that each hold some of the keys) onto process 0;
`save_consolidated_weights` writes it as the very file one process would write for the same weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..ops import broadcast_object_list
from ..parallel.ddp import unwrap
from ..parallel.engines import is_dtensor
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
    readable_as_created(path)
    return path


def readable_as_created(path: Path) -> None:
    """Give a file safetensors wrote the permissions `open()` gives a new file (0666 less the umask:
    group- and world-readable under the usual 022), as transformers' save_pretrained leaves its weights.
    safetensors creates them 0600, readable by their owner alone: a team's shared model folder would
    not open for the others."""
    path.chmod(0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read where Linux shows it (setting it to read it back is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


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
    readable_as_created(Path(f))


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

    Collective when processes run together, or when one process holds DTensors (FSDP2 offloading on
    one process): every process calls it. Process 0 receives the tensors
    (the others get an empty dict, which spares their memory) unless `all_ranks` is True. Tied weights
    share one tensor, as in `module.state_dict()`; and as there, the tensors of a model that is whole on
    each process (plain, DDP) on the CPU are the live ones: clone them to keep a snapshot while training
    goes on. Pipeline stages (processes holding different keys) each contribute their own keys,
    gathered in the order of the processes.
    """
    module = unwrap(model)
    if not _distributed() and not any(is_dtensor(p) for p in module.parameters()):
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
    model: torch.nn.Module,
    directory: Path,
    safe_serialization: bool = True,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write `model`'s consolidated weights from any layout; process 0 writes. Collective.

    Up to `max_shard_size` (bytes, or "10GB" / "5GiB"; None: no limit) the file holds exactly what one
    process would write for the same weights with `save_model_weights` (same names, tied weights once,
    same metadata). Larger weights are split into shards with an index, in Hugging Face's layout (see
    `write_shards`), and the index's path is returned. The path is returned on every process.
    """
    if safe_serialization:
        safetensors_save_model()  # a missing package fails here, on every process, before gathering
    limit = None if max_shard_size is None else parse_shard_size(max_shard_size)
    state = consolidated_state_dict(model)
    error, path = None, directory / (SAFETENSORS_FILE if safe_serialization else TORCH_FILE)
    if PartialState().is_main_process:
        try:
            shards = [state] if limit is None else split_into_shards(state, limit)
            if len(shards) > 1:
                path = write_shards(shards, directory, safe_serialization)
            else:
                write_weights(state, directory, safe_serialization)
        except Exception as exc:  # every process hears of it, not only the one that wrote
            error = exc
    raise_if_any_process_failed(error, f"writing {path}")
    return _broadcast_path(path)


def parse_shard_size(size: int | str) -> int:
    """Bytes from an int or "10GB" / "500MB" (decimal units, as Hugging Face writes them) / "5GiB"."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    units = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    text = str(size).strip().lower()
    for unit, factor in sorted(units.items(), key=lambda item: -len(item[0])):
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            value = int(float(text[: -len(unit)]) * factor)
            if value > 0:
                return value
    raise ValueError(
        f"max_shard_size={size!r} is not a size: pass bytes (an int > 0) or a string such as '10GB' "
        "(decimal units, as Hugging Face) or '5GiB'."
    )


def split_into_shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """`state` in key order, cut into dicts of at most `limit` bytes (a larger tensor alone in its own);
    a tensor stored under several names (tied weights) is kept under its first name only, as Hugging
    Face's sharded checkpoints do (the model re-ties it when loading)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, seen = 0, set()
    for name, tensor in state.items():
        key = storage_key(tensor)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def storage_key(tensor: torch.Tensor) -> tuple:
    """Equal for the names of one tensor (tied weights, which a torch.save file keeps shared)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def write_shards(shards: list[dict[str, torch.Tensor]], directory: Path, safe_serialization: bool) -> Path:
    """`model-00001-of-0000N.safetensors` (or `pytorch_model-...bin`) and the index that maps every
    name to its file (`model.safetensors.index.json`): what transformers' from_pretrained reads."""
    directory.mkdir(parents=True, exist_ok=True)
    stem, suffix = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        file_name = f"{stem}-{index:05d}-of-{len(shards):05d}{suffix}"
        shard = {name: tensor.contiguous() for name, tensor in shard.items()}
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(shard, str(directory / file_name), metadata={"format": "pt"})
            readable_as_created(directory / file_name)
        else:
            torch.save(shard, directory / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
        total += sum(tensor.numel() * tensor.element_size() for tensor in shard.values())
    index_path = directory / f"{stem}{suffix}.index.json"
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return index_path


def _broadcast_path(path: Path) -> Path:
    """Process 0's answer (which file it wrote) on every process."""
    if PartialState().num_processes == 1:
        return path
    return Path(broadcast_object_list([str(path)], from_process=0)[0])
