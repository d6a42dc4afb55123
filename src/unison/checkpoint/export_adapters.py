"""A PEFT model's checkpoint leaves unison as what users load: the base model with the adapters merged, or
PEFT's own adapter folder.

A `peft.PeftModel` saves its tensors under PEFT's names (`base_model.model.model.layers.0.self_attn.
q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`), which no `from_pretrained` of the base
class loads. At save time `describe_peft` records what rebuilding the model takes (in the manifest's
metadata, beside the base model's Hugging Face config): each adapter's PEFT config, the active adapters
and the PEFT class. On export, `rebuild` builds the PeftModel again from those on the meta device with
PEFT's own code (`get_peft_model`, `add_adapter`), puts the checkpoint's tensors in
(`load_state_dict(assign=True)`, the recorded ties restored), and then either PEFT merges the active
adapters (`merge_and_unload`) into a base model whose state dict `export_checkpoint` writes like any
other, or PEFT writes its adapter folder (`save_pretrained`: `adapter_config.json` +
`adapter_model.safetensors`, one folder per adapter, for `PeftModel.from_pretrained(base, folder)`).
Nothing here computes a merge: the arithmetic is PEFT's.

peft and transformers are imported only on export with one of the flags; saving imports neither.
"""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError

PEFT_KEY = "peft"  # a describe_models entry's record of a PEFT model (None for any other model)
INSTALL = "pip install peft transformers"
ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_WEIGHTS_BIN = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)  # what PEFT's save_pretrained writes
PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps its base model's tensors (LoRA and kin)


# -- at save time ------------------------------------------------------------------------------------
def is_peft_model(module: torch.nn.Module) -> bool:
    """A peft.PeftModel (or PeftMixedModel): by class when peft is imported, else by its attributes; or a
    transformers model holding adapters itself (its add_adapter / load_adapter)."""
    peft = sys.modules.get("peft")
    classes = tuple(getattr(peft, name, None) for name in ("PeftModel", "PeftMixedModel")) if peft else ()
    if any(isinstance(cls, type) and isinstance(module, cls) for cls in classes):
        return True
    if not isinstance(getattr(module, "peft_config", None), dict):
        return False
    return callable(getattr(module, "get_base_model", None)) or _injected(module)


def _injected(module: torch.nn.Module) -> bool:
    """A transformers model whose own add_adapter / load_adapter put PEFT's layers in it: its tensors have
    the names a PeftModel gives them, without PEFT_PREFIX."""
    return bool(getattr(module, "_hf_peft_config_loaded", False)) and not callable(
        getattr(module, "get_base_model", None)
    )


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model a PeftModel adapts (PEFT's get_base_model); a transformers model holding adapters itself."""
    return module if _injected(module) else module.get_base_model()


def describe_peft(module: torch.nn.Module) -> dict[str, Any]:
    """What rebuilding the PeftModel `module` takes: its class, each adapter's config as JSON (PEFT's
    to_dict, sets as sorted lists) in PEFT's order, and the active adapters. A config JSON cannot hold is
    recorded as the reason, for export to refuse with (saving never fails for it)."""
    active = getattr(module, "active_adapters", None)  # a property of PeftModel, a method in transformers
    active = active() if callable(active) else active
    active = [active] if isinstance(active, str) else list(active or [])
    adapters: dict[str, Any] = {}
    unreadable: dict[str, str] = {}
    for name, config in module.peft_config.items():
        try:
            adapters[name] = json.loads(json.dumps(_json_safe(config.to_dict())))
        except (TypeError, ValueError) as error:
            unreadable[name] = f"{type(error).__name__}: {error}"
    described = {
        "class": class_name(module),
        "adapters": adapters,
        "active": active,
        "injected": _injected(module),
    }
    if unreadable:
        described["unreadable"] = unreadable
    return described


def class_name(module: torch.nn.Module) -> str:
    """The user's class of `module`, not the one FSDP2's fully_shard made of it (`FSDP<name>`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return type(module).__name__
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule)).__name__


def _json_safe(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, set | frozenset):
        return sorted((_json_safe(item) for item in value), key=str)
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


# -- on export ---------------------------------------------------------------------------------------
def _import() -> tuple[Any, Any]:
    try:
        import peft
        import transformers
    except ImportError as error:
        raise ImportError(
            f"exporting a PEFT model's merged weights or adapters rebuilds it with peft and transformers, "
            f"and {error.name or 'one of them'} is not installed: {INSTALL}"
        ) from error
    return peft, transformers


def describe_what(info: dict[str, Any]) -> str:
    """`a PeftModelForCausalLM: LoRA adapter 'default' (active) on a LlamaForCausalLM`, for messages."""
    peft_info = info[PEFT_KEY]
    kinds = ", ".join(
        f"{config.get('peft_type', '?')} adapter {name!r}"
        + (" (active)" if name in peft_info["active"] else "")
        for name, config in peft_info["adapters"].items()
    )
    for name in peft_info.get("unreadable", {}):
        kinds += f"{', ' if kinds else ''}adapter {name!r} (config not recorded)"
    base = ((info.get("config") or {}).get("architectures") or ["model without a Hugging Face config"])[0]
    if peft_info.get("injected"):
        return f"a {base} holding {kinds} (its own add_adapter / load_adapter)"
    return f"a {peft_info['class']}: {kinds} on a {base}"


def refuse_plain_export(checkpoint: Path, index: int, info: dict[str, Any]) -> None:
    """A PEFT model exported without a flag: its tensors would keep PEFT's names."""
    raise CheckpointError(
        f"{checkpoint}'s model {index} is {describe_what(info)}. Its tensors keep PEFT's names "
        "(...q_proj.base_layer.weight, ...q_proj.lora_A.<adapter>.weight), which from_pretrained does not "
        "load: it would build the base model with every weight missing and initialise them at random. "
        "Pass --merge-adapters (merge_adapters=True) for the base model with the active adapters merged "
        "in, as PEFT's merge_and_unload() computes it (from_pretrained loads it), or --adapter-only "
        "(adapter_only=True) for PEFT's adapter folder (adapter_config.json + adapter_model.safetensors, "
        "for PeftModel.from_pretrained(base_model, OUT_DIR))."
    )


def refuse_unrecorded_peft(checkpoint: Path, index: int, state: dict[str, torch.Tensor]) -> None:
    """PEFT-named tensors in a checkpoint that records no PEFT model (saved before unison recorded them)."""
    if any(name.startswith(PEFT_PREFIX) for name in state):
        example = next(name for name in state if name.startswith(PEFT_PREFIX))
        raise CheckpointError(
            f"{checkpoint}'s model {index} has tensors under PEFT's names (e.g. {example}) but the "
            "checkpoint records no PEFT model (it was saved by an older unison): exported as they are, "
            "from_pretrained would load none of them. Load it into your PeftModel in a script "
            "(accelerator.load_state) and save_state it again with this unison, then export it with "
            "--merge-adapters or --adapter-only; or call merge_and_unload().save_pretrained(...) there."
        )


def refuse_no_peft(checkpoint: Path, index: int, info: dict[str, Any], flag: str) -> None:
    config = info.get("config") or {}
    what = f"a {config['architectures'][0]}" if config.get("architectures") else "a model"
    raise CheckpointError(
        f"{flag} exports a PEFT model, and {checkpoint}'s model {index} is {what} without adapters (the "
        f"checkpoint records no PEFT model for it): export it without {flag}."
    )


def rebuild(info: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The PeftModel the checkpoint saved, rebuilt by PEFT on the meta device from the recorded configs,
    holding the checkpoint's tensors (each name's own tensor, ties as recorded), in eval mode."""
    peft, transformers = _import()
    peft_info = info[PEFT_KEY]
    if peft_info.get("unreadable"):
        raise CheckpointError(
            "the checkpoint could not record the config of adapter(s) "
            + "; ".join(f"{name!r} ({why})" for name, why in peft_info["unreadable"].items())
            + ": they cannot be rebuilt for export."
        )
    if "Mixed" in peft_info["class"]:
        raise CheckpointError(
            f"a {peft_info['class']} (adapters of several kinds at once) is not rebuilt for export: "
            "merge it in your script (merge_and_unload) or save each adapter with save_pretrained."
        )
    base = _meta_base_model(info.get("config"), transformers)
    configs = {
        name: peft.PeftConfig.from_peft_type(**dict(config)) for name, config in peft_info["adapters"].items()
    }
    names = list(configs)
    # the base model's weights on the meta device; PEFT puts its adapters' beside them (low_cpu_mem_usage),
    # its other tensors (a prompt's token ids) where it makes them
    model = peft.get_peft_model(base, configs[names[0]], adapter_name=names[0], low_cpu_mem_usage=True)
    for name in names[1:]:
        model.add_adapter(name, configs[name], low_cpu_mem_usage=True)
    active = [name for name in peft_info["active"] if name in configs] or names[:1]
    if not configs[active[0]].is_prompt_learning:
        model.base_model.set_adapter(active if len(active) > 1 else active[0])
    else:
        model.set_adapter(active[0])
    if peft_info.get("injected"):  # the transformers model held the adapters: its names, under PeftModel's
        state = {PEFT_PREFIX + name: tensor for name, tensor in state.items()}
        info = {**info, "tied": [[PEFT_PREFIX + name for name in group] for group in info.get("tied", [])]}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [name for name in missing if _is_meta(model, name)]
    if unexpected or missing:

        def few(found: list[str]) -> str:
            return ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")

        raise CheckpointError(
            f"the {peft_info['class']} rebuilt from the checkpoint's record (peft {peft.__version__}, "
            f"transformers {transformers.__version__}) does not match its tensors: "
            + "; ".join(
                part
                for part in (
                    f"the checkpoint holds {len(unexpected)} the rebuilt model has not ({few(unexpected)})"
                    if unexpected
                    else "",
                    f"it lacks {len(missing)} the rebuilt model has ({few(missing)})" if missing else "",
                )
                if part
            )
            + ". A different peft or transformers version may name them otherwise: export with the versions "
            "that trained it."
        )
    for group in info.get("tied", []):  # one tensor under each name, as the trained model held it
        present = [name for name in group if _has_parameter(model, name)]
        for name in present[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(present[0]))
    return model.eval()


def _meta_base_model(config: dict[str, Any] | None, transformers: Any) -> torch.nn.Module:
    architecture = ((config or {}).get("architectures") or [None])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    if not isinstance(cls, type) or not hasattr(cls, "config_class"):
        what = f"class {architecture}, which transformers does not have" if architecture else "no class"
        raise CheckpointError(
            f"the PEFT model's base model records {what} (its Hugging Face config's architectures): "
            "only a transformers model class can be rebuilt for export (a model of your own or of "
            "trust_remote_code is not). Merge it in your script instead: merge_and_unload()."
        )
    hf_config = cls.config_class.from_dict(dict(config))
    with torch.device("meta"):
        return cls(hf_config)


def _is_meta(model: torch.nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    tensor = getattr(model.get_submodule(owner), leaf, None)
    return isinstance(tensor, torch.Tensor) and tensor.is_meta


def _has_parameter(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def merged_state(
    info: dict[str, Any], state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The base model's state dict with the active adapters merged by PEFT (merge_and_unload), and the
    names of the adapters merged. The tensors of `state` are taken, not copied: merging changes them."""
    peft_info = info[PEFT_KEY]
    model = rebuild(info, state)
    active = [name for name in peft_info["active"] if name in model.peft_config] or list(model.peft_config)[
        :1
    ]
    prompt = [name for name in active if model.peft_config[name].is_prompt_learning]
    if prompt or not callable(getattr(model, "merge_and_unload", None)):
        kinds = sorted({str(model.peft_config[name].peft_type.value) for name in active})
        raise CheckpointError(
            f"--merge-adapters: {describe_what(info)}; {'/'.join(kinds)} has no weights to merge into "
            "the base model (prompt learning adds virtual tokens or prefixes, not weight deltas): "
            "export it with --adapter-only and load it with PeftModel.from_pretrained(base_model, OUT_DIR)."
        )
    try:
        merged = model.merge_and_unload()
    except (ValueError, NotImplementedError, AttributeError, TypeError) as error:
        raise CheckpointError(
            f"--merge-adapters: PEFT cannot merge {describe_what(info)}: {error}"
        ) from error
    result = merged.state_dict(keep_vars=False)
    still_meta = [name for name, tensor in result.items() if tensor.is_meta]
    if still_meta:  # pragma: no cover - load_state_dict's check above catches these first
        raise CheckpointError(
            f"--merge-adapters: no tensor in the checkpoint for {', '.join(still_meta[:4])}"
        )
    return {name: tensor.detach() for name, tensor in result.items()}, active


def save_adapters(
    info: dict[str, Any],
    state: dict[str, torch.Tensor],
    out_dir: Path,
    dtype: torch.dtype | None,
    safe_serialization: bool,
) -> dict[str, Path]:
    """PEFT's own folder of each adapter (save_pretrained of the rebuilt model: `default` in out_dir, any
    other adapter in out_dir/NAME), its floating tensors cast to `dtype`; the folder of each."""
    if dtype is not None:
        state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    model = rebuild(info, state)
    model.save_pretrained(str(out_dir), safe_serialization=safe_serialization)
    return {name: out_dir if name == "default" else out_dir / name for name in model.peft_config}
