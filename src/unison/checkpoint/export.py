"""A checkpoint leaves unison: its model as a Hugging Face-style folder, on one process, without the script.

A training checkpoint holds the model as the layout saved it: one `model_N.pt` file (plain, DDP) or a
DCP directory `model_N/` of shards (ZeRO, tensor and pipeline parallel). `export_checkpoint` reads
either on one process, with no process group, no GPU and no model class (DCP reassembles the full
tensors from the shards' metadata), and writes `model.safetensors`, or shards with
`model.safetensors.index.json` past `max_shard_size`, under the user's parameter names, optionally cast
to bf16 / fp16.

Two facts a checkpoint's tensors cannot tell are recorded when it is saved (`describe_models`, in the
manifest's metadata): which names are one tied weight (written once, as Hugging Face saves them; DCP
stores every name apart) and the model's Hugging Face config, written beside the weights as
`config.json` so `AutoModelForCausalLM.from_pretrained(OUT_DIR)` builds the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.ddp import unwrap
from .errors import CheckpointError
from .manifest import verify_checkpoint
from .storage import load_object
from .weights import (
    parse_shard_size,
    safetensors_save_model,
    split_into_shards,
    storage_key,
    write_shards,
    write_weights,
)

MODELS_KEY = "models"  # the manifest metadata's list: one describe_models entry per model
CONFIG_FILE = "config.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- at save time ------------------------------------------------------------------------------------
def describe_models(models: list[torch.nn.Module]) -> list[dict[str, Any]]:
    """For each prepared model: its tied-weight name groups and its Hugging Face config (None when it has
    none), as JSON for the checkpoint's manifest. Collective under pipeline parallelism, where each
    process sees only its own stages' ties (every process has the same layout, so all gather or none)."""
    local = [_tied_groups(unwrap(model)) for model in models]
    everyone = [local]
    pipeline = any(getattr(unwrap(model), "stage_modules", None) for model in models)
    if pipeline and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
    return [
        {
            "tied": _merged([group for process in everyone for group in process[index]]),
            "config": _hf_config(_user_root(unwrap(model))),
        }
        for index, model in enumerate(models)
    ]


def _user_root(module: torch.nn.Module) -> torch.nn.Module:
    """The user's model: a pipeline rank's first stage keeps a copy of its root (class, config)."""
    stages = getattr(module, "stage_modules", None)
    return getattr(stages[0], "root_module", module) if stages else module


def _tied_groups(module: torch.nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    groups = [group for group in names.values() if len(group) > 1]
    return groups + [list(group) for group in getattr(module, "tied_names", ())]  # across pipeline stages


def _merged(groups: list[list[str]]) -> list[list[str]]:
    """Groups that share a name joined into one, each in first-seen name order."""
    merged: list[list[str]] = []
    for group in groups:
        overlapping = [m for m in merged if set(m) & set(group)]
        union = list(dict.fromkeys([name for m in overlapping for name in m] + list(group)))
        merged = [m for m in merged if m not in overlapping] + [union]
    return merged


def _hf_config(root: torch.nn.Module) -> dict[str, Any] | None:
    """A Hugging Face PretrainedConfig as the dict its config.json holds, with the model's class as
    `architectures` (what save_pretrained adds); None for a model without one."""
    config = getattr(root, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    as_dict = json.loads(config.to_json_string(use_diff=False))
    as_dict.setdefault("architectures", [type(root).__name__])
    return as_dict


# -- on export ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportResult:
    """What `export_checkpoint` wrote: the weights file (or the index of its shards), the config (None
    when the checkpoint recorded none), how many tensors under how many names, and their bytes."""

    weights: Path
    config: Path | None
    tensors: int
    names: int
    bytes: int


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    model_index: int = 0,
    max_shard_size: int | str = "10GB",
    dtype: str | None = None,
    safe_serialization: bool = True,
) -> ExportResult:
    """Write model `model_index` of the unison checkpoint `checkpoint` into `out_dir` as one process would
    save it for Hugging Face: safetensors (or `pytorch_model.bin` with safe_serialization=False), split
    with an index past `max_shard_size`, tied weights once, floating tensors cast to `dtype` ("bf16",
    "fp16", "fp32"; None keeps the saved ones), and `config.json` when the model had a config.

    The checkpoint is verified first (every file's checksum); any layout's checkpoint works, on one
    process, with no GPU.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not one of {sorted(DTYPES)}: pass one of them, or None to keep "
            "the saved dtypes."
        )
    limit = parse_shard_size(max_shard_size)
    if safe_serialization:
        safetensors_save_model()  # a missing package fails before the checkpoint is read
    checkpoint = Path(checkpoint)
    manifest = verify_checkpoint(checkpoint)
    described = manifest.get("metadata", {}).get(MODELS_KEY)
    state = _read_model(checkpoint, model_index)
    if dtype is not None:
        cast: dict[tuple, torch.Tensor] = {}  # a tensor under several names stays one tensor
        state = {name: cast.setdefault(storage_key(t), _cast(t, DTYPES[dtype])) for name, t in state.items()}
    info = described[model_index] if described and model_index < len(described) else {}
    for group in info.get("tied", []):  # one tensor under each name: written once
        present = [name for name in group if name in state]
        for name in present[1:]:
            state[name] = state[present[0]]
    out_dir = Path(out_dir)
    shards = split_into_shards(state, limit)
    if len(shards) > 1:
        weights = write_shards(shards, out_dir, safe_serialization)
    else:
        weights = write_weights(state, out_dir, safe_serialization)
    config_path = None
    if info.get("config") is not None:
        config_path = out_dir / CONFIG_FILE
        config = _config_for(info["config"], dtype)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    unique = {id(tensor): tensor for shard in shards for tensor in shard.values()}
    return ExportResult(
        weights=weights,
        config=config_path,
        tensors=len(unique),
        names=len(state),
        bytes=sum(tensor.numel() * tensor.element_size() for tensor in unique.values()),
    )


def _read_model(checkpoint: Path, index: int) -> dict[str, torch.Tensor]:
    """The full state dict of model `index`: the plain file, or the DCP directory reassembled."""
    plain, sharded = checkpoint / f"model_{index}.pt", checkpoint / f"model_{index}"
    if plain.is_file():
        state = load_object(plain, map_location="cpu")
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
    if sharded.is_dir():
        from .dcp_reading import read_full_model_state  # DCP: loaded only for sharded checkpoints

        return read_full_model_state(sharded)
    models = sorted(p.name for p in checkpoint.iterdir() if p.name.startswith("model_"))
    raise CheckpointError(
        f"{checkpoint} holds no model {index} (no model_{index}.pt or model_{index}/; it has "
        f"{', '.join(models) or 'no model at all'}): pass the index of a saved model."
    )


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _config_for(config: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """The saved config, saying the exported dtype where the weights were cast."""
    if dtype is None:
        return config
    name = _HF_DTYPE_NAMES[DTYPES[dtype]]
    keys = [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]
    return {**config, **dict.fromkeys(keys, name)}
