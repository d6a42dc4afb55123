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

A PEFT model's tensors keep PEFT's names, which no from_pretrained loads: it is refused unless exported
with its adapters merged into the base model or as PEFT's adapter folder (export_adapters.py, which also
records at save time what rebuilding it takes).
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
from .export_adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ADAPTER_WEIGHTS_BIN,
    PEFT_KEY,
    class_name,
    describe_peft,
    is_peft_model,
    merged_state,
    refuse_no_peft,
    refuse_plain_export,
    refuse_unrecorded_peft,
    save_adapters,
)
from .export_adapters import base_model as peft_base_model
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
        {"tied": _merged([group for process in everyone for group in process[index]]), **_described(model)}
        for index, model in enumerate(models)
    ]


def _described(model: torch.nn.Module) -> dict[str, Any]:
    """The model's Hugging Face config; for a PEFT model, its base model's and its adapters' configs."""
    root = _user_root(unwrap(model))
    if not is_peft_model(root):
        return {"config": _hf_config(root)}
    return {"config": _hf_config(peft_base_model(root)), PEFT_KEY: describe_peft(root)}


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
    # as save_pretrained: the class trained, whatever the config says (null when built in the script, the
    # pretrained class for a model of another head loaded from its checkpoint)
    as_dict["architectures"] = [class_name(root)]
    return as_dict


# -- on export ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportResult:
    """What `export_checkpoint` wrote: the weights file (or the index of its shards; with adapter_only the
    first adapter's weights), the config (None when the checkpoint recorded none), how many tensors under
    how many names, and their bytes; for a PEFT model, the adapters merged (merge_adapters) or written
    (adapter_only), and with adapter_only each adapter's folder."""

    weights: Path
    config: Path | None
    tensors: int
    names: int
    bytes: int
    adapters: tuple[str, ...] = ()
    adapter_folders: tuple[Path, ...] = ()


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    model_index: int = 0,
    max_shard_size: int | str = "10GB",
    dtype: str | None = None,
    safe_serialization: bool = True,
    merge_adapters: bool = False,
    adapter_only: bool = False,
) -> ExportResult:
    """Write model `model_index` of the unison checkpoint `checkpoint` into `out_dir` as one process would
    save it for Hugging Face: safetensors (or `pytorch_model.bin` with safe_serialization=False), split
    with an index past `max_shard_size`, tied weights once, floating tensors cast to `dtype` ("bf16",
    "fp16", "fp32"; None keeps the saved ones), and `config.json` when the model had a config.

    A PEFT model (peft.PeftModel) takes one of two flags, and is refused without: `merge_adapters` writes
    its base model with the active adapters merged as PEFT's merge_and_unload() computes them (loaded by
    the base class's from_pretrained), `adapter_only` PEFT's own folder of each adapter (save_pretrained:
    adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained(base, out_dir); an
    adapter not named "default" in out_dir/NAME). Both rebuild the model with peft and transformers.

    The checkpoint is verified first (every file's checksum); any layout's checkpoint works, on one
    process, with no GPU.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not one of {sorted(DTYPES)}: pass one of them, or None to keep "
            "the saved dtypes."
        )
    if merge_adapters and adapter_only:
        raise ValueError(
            "merge_adapters (--merge-adapters) and adapter_only (--adapter-only) write different folders "
            "(a base model's from_pretrained would find the adapter's config beside it and load it on top): "
            "export twice, into two folders."
        )
    limit = parse_shard_size(max_shard_size)
    if safe_serialization:
        safetensors_save_model()  # a missing package fails before the checkpoint is read
    checkpoint = Path(checkpoint)
    manifest = verify_checkpoint(checkpoint)
    described = manifest.get("metadata", {}).get(MODELS_KEY)
    info = described[model_index] if described and model_index < len(described) else {}
    flag = "--merge-adapters" if merge_adapters else "--adapter-only" if adapter_only else None
    if info.get(PEFT_KEY) is not None and flag is None:
        refuse_plain_export(checkpoint, model_index, info)
    state = _read_model(checkpoint, model_index)
    if info.get(PEFT_KEY) is None:
        refuse_unrecorded_peft(checkpoint, model_index, state)
        if flag is not None:
            refuse_no_peft(checkpoint, model_index, info, flag)
    out_dir = Path(out_dir)
    if adapter_only:
        return _export_adapters(info, state, out_dir, dtype, safe_serialization)
    adapters: list[str] = []
    tied = info.get("tied", [])
    if merge_adapters:  # the merged model's ties are its shared tensors (rebuild restored them)
        state, adapters = merged_state(info, state)
        tied = []
    if dtype is not None:
        cast: dict[tuple, torch.Tensor] = {}  # a tensor under several names stays one tensor
        state = {name: cast.setdefault(storage_key(t), _cast(t, DTYPES[dtype])) for name, t in state.items()}
    for group in tied:  # one tensor under each name: written once
        present = [name for name in group if name in state]
        for name in present[1:]:
            state[name] = state[present[0]]
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
        adapters=tuple(adapters),
    )


def _export_adapters(
    info: dict[str, Any], state: dict[str, torch.Tensor], out_dir: Path, dtype: str | None, safe: bool
) -> ExportResult:
    """PEFT's adapter folders (export_adapters.save_adapters), described by the first one's files and the
    tensors of all."""
    folders = save_adapters(info, state, out_dir, DTYPES[dtype] if dtype else None, safe)
    written = {}
    for folder in folders.values():
        written.update({(folder, name): tensor for name, tensor in _read_weights(folder, safe).items()})
    first = next(iter(folders.values()))
    return ExportResult(
        weights=first / (ADAPTER_WEIGHTS if safe else ADAPTER_WEIGHTS_BIN),
        config=first / ADAPTER_CONFIG,
        tensors=len(written),
        names=len(written),
        bytes=sum(tensor.numel() * tensor.element_size() for tensor in written.values()),
        adapters=tuple(folders),
        adapter_folders=tuple(folders.values()),
    )


def _read_weights(folder: Path, safe: bool) -> dict[str, torch.Tensor]:
    if safe:
        from safetensors.torch import load_file

        return load_file(str(folder / ADAPTER_WEIGHTS))
    return torch.load(folder / ADAPTER_WEIGHTS_BIN, map_location="cpu", weights_only=True)


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
