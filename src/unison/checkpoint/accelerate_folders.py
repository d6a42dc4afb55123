"""Continuing a run started under Hugging Face Accelerate: `load_state(<a folder its save_state wrote>)`.

A team that moves a long run from Accelerate to unison keeps its checkpoints. Accelerate 1.x's save_state
writes loose files, no manifest, named by index (accelerate/checkpointing.py, utils/fsdp_utils.py); i > 0
adds `_<i>` (`model_1.safetensors`, `optimizer_1.bin`):

| file | content |
| --- | --- |
| `model.safetensors` or `pytorch_model.bin` | a whole state dict (names perhaps after DDP's `module.`) |
| `pytorch_model_fsdp.bin` | FSDP with FULL_STATE_DICT (Accelerate's default): the whole state dict |
| `pytorch_model_fsdp_<i>/` | FSDP with SHARDED_STATE_DICT: a DCP folder, keys `model.<name>` |
| `optimizer.bin` | `optimizer.state_dict()` by parameter position; by name under FSDP FULL_STATE_DICT |
| `optimizer_<j>/` | FSDP SHARDED_STATE_DICT: DCP, `optimizer.state.<name>.<k>`, `.param_groups.<g>.<k>` |
| `scheduler.bin`, `scaler.pt`, `custom_checkpoint_<n>.pkl` | their `state_dict()`s (torch.save) |
| `random_states_<rank>.pkl` | a process's `Accelerator.step`, Python, NumPy, torch (CPU, CUDA) RNG states |

The folder is recognised by `random_states_0.pkl` (every save_state writes it) without unison's
`manifest.json`. Each part loads into whatever layout this run has, as unison's own parts do (sharded.py):
whole files into shards, DCP folders into any layout. Everything is read with
torch.load(weights_only=True) (NumPy's array type allowed for the RNG files, as Accelerate allows it),
DCP folders through dcp_reading: reading a folder never executes code. As in unison's own load, every
process reads what it needs, the processes agree that every read and check passed, and only then is
anything applied; what cannot be loaded is refused on every process before that.

What Accelerate records, and no more, comes back: it records no data position by default (its examples
call `skip_first_batches` after load_state), nor the accumulation or the global batch, so the prepared
loaders start their epoch as a fresh run's, and the script's gradient_accumulation_steps stays. Not read,
refused with the reason: DeepSpeed's folders, FSDP's per-rank files (LOCAL_STATE_DICT, use_dcp=False), a
torchdata StatefulDataLoader's `dl_state_dict.bin` and a pickled `sampler.bin` (objects, not state dicts).
"""

from __future__ import annotations

import codecs
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import ops
from ..parallel.ddp import unwrap
from ..random import set_rng_state
from ..state import PartialState
from .errors import CheckpointError, check_shapes, model_keys_error
from .manifest import MANIFEST_NAME
from .storage import load_object, raise_if_any_process_failed
from .training_state import TrainingParts, models_loaded_by_hooks

logger = logging.getLogger("unison")

RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")
CUSTOM_FILE = re.compile(r"custom_checkpoint_(\d+)\.pkl")
_PER_RANK_FSDP = re.compile(r"pytorch_model_fsdp(_\d+)?_rank\d+\.bin|optimizer(_\d+)?_rank\d+\.bin")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's names around the model's
_NUMPY_CORE = getattr(np, "_core", None) or np.core
_RNG_GLOBALS = [  # what NumPy's legacy state tuple pickles as (its dtype's class from NumPy 1.25 on)
    global_
    for global_ in (
        _NUMPY_CORE.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        getattr(getattr(np, "dtypes", None), "UInt32DType", None),
        codecs.encode,
    )
    if global_ is not None
]


def is_accelerate_folder(directory: Path) -> bool:
    """Whether `directory` was written by Accelerate's save_state: its random_states_0.pkl, no manifest."""
    return (directory / "random_states_0.pkl").is_file() and not (directory / MANIFEST_NAME).exists()


@dataclass
class _Folder:
    """What an Accelerate folder holds, by the names of its entries (the main process's listing).

    models, optimizers: (entry, "whole" | "dcp") for index 0, 1, ...; world_size: its RNG files.
    """

    directory: Path
    files: set[str]
    folders: set[str]
    models: list[tuple[str, str]]
    optimizers: list[tuple[str, str]]
    schedulers: list[str]
    customs: list[str]
    world_size: int


def _folder(directory: Path, files: set[str], folders: set[str]) -> _Folder:
    def indexed(entry) -> list[tuple[str, str]]:  # index 0, 1, ... until the first without an entry
        found: list[tuple[str, str]] = []
        while (next_entry := entry(files, folders, _suffix(len(found)), len(found))) is not None:
            found.append(next_entry)
        return found

    customs = {int(m.group(1)): name for name in files if (m := CUSTOM_FILE.fullmatch(name))}
    return _Folder(
        directory,
        files,
        folders,
        models=indexed(_model_entry),
        optimizers=indexed(_optimizer_entry),
        schedulers=[name for name, _ in indexed(_scheduler_entry)],
        customs=[customs[index] for index in sorted(customs)],
        world_size=sum(1 for name in files if RNG_FILE.fullmatch(name)),
    )


def _suffix(index: int) -> str:
    """Accelerate's file names add `_<i>` from the second model (optimizer, scheduler) on."""
    return "" if index == 0 else f"_{index}"


def _model_entry(files: set[str], folders: set[str], suffix: str, i: int) -> tuple[str, str] | None:
    whole = (f"model{suffix}.safetensors", f"pytorch_model{suffix}.bin", f"pytorch_model_fsdp{suffix}.bin")
    for name in whole:
        if name in files:
            return name, "whole"
    return (f"pytorch_model_fsdp_{i}", "dcp") if f"pytorch_model_fsdp_{i}" in folders else None


def _optimizer_entry(files: set[str], folders: set[str], suffix: str, i: int) -> tuple[str, str] | None:
    if f"optimizer{suffix}.bin" in files:
        return f"optimizer{suffix}.bin", "whole"
    return (f"optimizer_{i}", "dcp") if f"optimizer_{i}" in folders else None


def _scheduler_entry(files: set[str], _folders: set[str], suffix: str, _i: int) -> tuple[str, str] | None:
    return (f"scheduler{suffix}.bin", "whole") if f"scheduler{suffix}.bin" in files else None


def _listing(directory: Path) -> tuple[set[str], set[str]]:
    entries = list(directory.iterdir())
    return {p.name for p in entries if p.is_file()}, {p.name for p in entries if p.is_dir()}


def _refusal(folder: _Folder) -> str | None:
    """Why this folder cannot be continued by unison (None when it can), before anything is read."""
    where = folder.directory
    if "latest" in folder.files or any(
        name.startswith("pytorch_model") and not name.startswith("pytorch_model_fsdp")
        for name in folder.folders
    ):
        return (
            f"{where} is a DeepSpeed checkpoint (its engine's own per-rank files under pytorch_model/): "
            "unison does not read DeepSpeed's format. Convert it with the zero_to_fp32.py script DeepSpeed "
            "writes into the folder, load the weights into the model before prepare(), and start the "
            "optimizer afresh."
        )
    per_rank = sorted(name for name in folder.files if _PER_RANK_FSDP.fullmatch(name))
    if per_rank:
        return (
            f"{where} holds FSDP's per-rank files ({', '.join(per_rank[:3])}): Accelerate's LOCAL_STATE_DICT "
            "or save_fsdp_model(use_dcp=False), which only the same processes and wrapping can read. Load it "
            "under Accelerate once and save_state again with SHARDED_STATE_DICT or FULL_STATE_DICT."
        )
    objects = sorted(name for name in folder.files if name.startswith(("dl_state_dict", "sampler")))
    if objects:
        return (
            f"{where} holds {', '.join(objects)}: the pickled state of a torchdata StatefulDataLoader or of "
            "Accelerate's SeedableRandomSampler object, which cannot be read without running code from the "
            "file. Remove it and resume the data as Accelerate's checkpointing example does: "
            "accelerator.skip_first_batches(train_dataloader, batches_done_in_the_epoch)."
        )
    return None


def _count_error(folder: _Folder, what: str, saved: int, prepared: int) -> str | None:
    """The refusal of a folder holding another number of `what` than this run prepared (or registered)."""
    if saved == prepared:
        return None
    return (
        f"{folder.directory} holds the state of {_counted(saved, what) or f'no {what}s'} and this run "
        f"prepared {prepared}: Accelerate numbers them in the order they were prepared, so they can only be "
        "matched one for one. Prepare the same models, optimizers and schedulers (and register the same "
        "objects), in the order the Accelerate run did."
    )


@dataclass
class _Read:
    """What this process read, before anything is applied."""

    models: dict[int, tuple[str, Any]] = field(default_factory=dict)  # (how it was saved, its state)
    optimizers: dict[int, tuple[str, Any]] = field(default_factory=dict)
    schedulers: list[Any] = field(default_factory=list)
    customs: list[Any] = field(default_factory=list)
    scaler: Any = None
    rng: dict[str, Any] | None = None
    step: int = 0


def load_accelerate_folder(
    training: TrainingParts, directory: Path, strict: bool = True, accelerate_numerics: bool = True
) -> int:
    """Load an Accelerate folder into `training` (a TrainingParts); returns Accelerate's saved
    Accelerator.step. Collective: every process calls it, with the same directory.

    accelerate_numerics: whether the run computes Accelerate's numbers (numerics.py); if not, the line says
    how to: the saved scheduler counted num_processes steps per optimizer step, as Accelerate steps it.
    """
    state = PartialState()
    listing = _listing(directory) if state.is_main_process else None  # one view of a shared filesystem
    files, folders = ops.broadcast_object_list([listing], from_process=0)[0]
    folder = _folder(directory, files, folders)
    refusal = _refusal(folder)  # the same listing on every process: the same verdict
    if refusal is not None:
        raise CheckpointError(refusal)
    # As in Accelerate, the load_state pre-hooks run first; a model a hook loaded its way is left out, and
    # the model files go to the others in order (a save hook that saved a model its way wrote none).
    left_to_hooks = set(models_loaded_by_hooks(training, directory))
    kept = [i for i in range(len(training.models)) if i not in left_to_hooks]
    refusal = _counts_refusal(folder, training, len(kept))
    if refusal is not None:
        raise CheckpointError(refusal)
    sharded = _sharded()
    layouts = sharded.model_layouts(training.models, training.optimizers)
    owner = {j: i for i, layout in enumerate(layouts) for j in layout.optimizers}
    model_keys = _model_keys(training, layouts, strict, kept)
    read, failure = _read(training, folder, layouts, owner, strict, model_keys, kept)
    raise_if_any_process_failed(failure, f"loading the Accelerate checkpoint {directory}")
    _apply(training, read, layouts, owner, strict)
    steps = [_steps_taken(optimizer) for optimizer in training.optimizers]
    steps = ops.broadcast_object_list([steps], from_process=0)[0]  # one count: checkpoint names use it
    for optimizer, count in zip(training.optimizers, steps):
        optimizer.num_steps_taken = count
    if read.rng is not None:
        set_rng_state(read.rng)
    if state.is_main_process:
        logger.warning(_summary(folder, training, state.num_processes, accelerate_numerics))
    return read.step


def _sharded():
    from . import sharded  # DCP and DTensor: imported on first use, as training_state does

    return sharded


def _counts_refusal(folder: _Folder, training: Any, models: int) -> str | None:
    """Why the folder's parts cannot be matched one for one with this run's (`models`: those to load)."""
    for what, saved, prepared in (
        ("model", len(folder.models), models),
        ("optimizer", len(folder.optimizers), len(training.optimizers)),
        ("scheduler", len(folder.schedulers), len(training.schedulers)),
        ("registered object", len(folder.customs), len(training.custom_objects)),
    ):
        error = _count_error(folder, what, saved, prepared)
        if error is not None:
            return error
    if training.scaler is not None and "scaler.pt" not in folder.files:
        return (
            f"{folder.directory} has no scaler.pt: the Accelerate run did not train in fp16, and this one "
            "does, so there is no loss scale to continue from. Resume with the mixed precision it used."
        )
    return None


def _model_keys(training, layouts, strict: bool, kept: list[int]) -> dict[int, frozenset[str]]:
    """The keys each live sharded model has on any process, for a strict check (collective)."""
    indices = [i for i in kept if layouts[i].sharded] if strict else []
    if not indices:
        return {}
    keys = _sharded().model_keys_everywhere([training.models[i] for i in indices])
    return dict(zip(indices, keys))


def _read(training, folder, layouts, owner, strict, model_keys, kept) -> tuple[_Read, Exception | None]:
    """Read and check every part on this process; the first failure is returned, not raised. The DCP
    folders are read by every process in the same order whatever failed before (they are collective)."""
    read, failures = _Read(), []
    directory = folder.directory

    def attempt(name: str, action, *args):
        """action(directory / name, *args), or None and the failure noted, naming the file."""
        if failures:
            return None
        try:
            return action(directory / name, *args)
        except CheckpointError as error:
            failures.append(error)
        except (ImportError, OSError, ValueError, KeyError, RuntimeError) as error:
            failures.append(
                CheckpointError(
                    f"cannot read {directory / name} ({type(error).__name__}: {error}): the file is damaged "
                    "or was not written by Accelerate's save_state. Resume from an intact checkpoint."
                )
            )
        return None

    def collective(action, *args):
        try:
            return action(*args)
        except CheckpointError as error:
            failures.append(error)
            return None

    for i, (name, kind) in zip(kept, folder.models):
        model, keys = training.models[i], model_keys.get(i)
        if kind == "dcp":
            read_model = _sharded().read_model_state
            read.models[i] = kind, collective(read_model, model, directory / name, strict, keys, "model.")
        else:
            read.models[i] = kind, attempt(name, _read_whole_model, model, layouts[i].sharded, strict, keys)
    for j, (name, kind) in enumerate(folder.optimizers):
        model, optimizer = training.models[owner[j]] if j in owner else None, training.optimizers[j]
        if kind == "dcp":
            read.optimizers[j] = kind, collective(_read_dcp_optimizer, model, optimizer, directory / name)
        else:
            read.optimizers[j] = attempt(name, _read_whole_optimizer, model, optimizer)
    read.schedulers = [attempt(name, load_object) for name in folder.schedulers]
    read.customs = [attempt(name, load_object) for name in folder.customs]
    if training.scaler is not None:
        read.scaler = attempt("scaler.pt", load_object)
    own = f"random_states_{PartialState().process_index}.pkl"
    saved = attempt(own if own in folder.files else "random_states_0.pkl", _load_rng_file)
    if saved is not None:
        read.step = int(saved.get("step", 0))
        read.rng = _rng_state(saved) if own in folder.files else None
    return read, failures[0] if failures else None


def _own_names(state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """`state` under the module's own names: without the `module.` (DDP) or `_orig_mod.` (torch.compile)
    that Accelerate's save_state keeps when it saves the wrapper, and with every name of a tied weight
    (safetensors stores one; Accelerate's save dropped the others)."""
    live = module.state_dict()
    for prefix in _WRAPPER_PREFIXES:
        if (
            state
            and all(key.startswith(prefix) for key in state)
            and not any(key.startswith(prefix) for key in live)
        ):
            state = {key.removeprefix(prefix): value for key, value in state.items()}
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    for group in names.values():
        present = [name for name in group if name in state]
        for name in group if present else ():
            state.setdefault(name, state[present[0]])
    return state


def _read_whole_model(path: Path, model, sharded_layout: bool, strict: bool, model_keys) -> dict[str, Any]:
    """A whole state dict (safetensors or torch.save), under the model's names, checked against it."""
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(
                f"{path} is a safetensors file and the safetensors package is not installed: "
                "`pip install safetensors` (Accelerate, which wrote it, depends on it)."
            ) from None
        state = load_file(path, device="cpu")
    else:
        state = load_object(path, map_location="cpu")
    module = unwrap(model)
    state = _own_names(dict(state), module)
    if sharded_layout:
        if strict:
            _sharded().check_full_model_state(model, state, model_keys)
        return state
    live = module.state_dict()
    missing = [key for key in live if key not in state]
    unexpected = [key for key in state if key not in live]
    if strict and (missing or unexpected):
        raise model_keys_error(missing, unexpected)
    check_shapes(path.name, live, state)
    return state


def _read_whole_optimizer(path: Path, model, optimizer) -> tuple[str, dict[str, Any]]:
    """optimizer.bin: ("by position", its state) from a plain or DDP run, ("by name", ...) from FSDP's
    FULL_STATE_DICT, checked against the live optimizer."""
    state = load_object(path, map_location="cpu")
    params = [p for group in state["param_groups"] for p in group["params"]]
    by_name = bool(params) and isinstance(params[0], str)
    if by_name:
        if model is None:
            raise CheckpointError(
                f"{path} holds optimizer state keyed by parameter name (FSDP's FULL_STATE_DICT), but this "
                "run's optimizer of that index optimizes no prepared model. Prepare the model with it."
            )
        live = {name for name, _ in unwrap(model).named_parameters()}
        foreign = sorted(set(params) - live)
        if foreign:
            raise CheckpointError(
                f"{path} holds optimizer state of parameters the model has not ({', '.join(foreign[:3])}): "
                "it was saved from another model. Prepare the model the Accelerate run trained."
            )
    else:
        _sharded().check_full_optimizer_state(optimizer, state)
    return ("by name" if by_name else "by position"), state


def _read_dcp_optimizer(model, optimizer, path: Path):
    """Accelerate's FSDP optimizer folder (`optimizer.state.<name>.<k>`, hyper-parameters per param group
    `optimizer.param_groups.<g>.<k>` with the group's parameter names in `.params`), read into new tensors
    laid out like this process's optimizer and keyed as unison's sharded parts are. Collective."""
    from .dcp_reading import SafeFileSystemReader, SafeLoadPlanner, dcp_load

    sharded = _sharded()
    if model is None:
        raise CheckpointError(
            f"{path} holds sharded optimizer state, keyed by the names of its model's parameters, but this "
            "run's optimizer of that index optimizes no prepared model. Prepare the model with its optimizer."
        )
    live = sharded.empty_optimizer_state(model, optimizer)
    saved = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    request: dict[str, Any] = {
        f"optimizer.{key}": value for key, value in live.items() if key.startswith("state.")
    }
    request.update((key, None) for key in saved if key.startswith("optimizer.param_groups."))
    planner = SafeLoadPlanner(optional_prefix="optimizer.state.")
    dcp_load(request, path, planner)
    state = {
        key.removeprefix("optimizer."): value
        for key, value in request.items()
        if key.startswith("optimizer.state.")
    }
    groups: dict[str, dict[str, Any]] = {}
    for key, value in request.items():
        if key.startswith("optimizer.param_groups."):
            group, hyper = key.removeprefix("optimizer.param_groups.").split(".", 1)
            groups.setdefault(group, {})[hyper] = value
    for group in groups.values():
        for name in group.pop("params"):
            state.update((f"param_groups.{name}.{hyper}", value) for hyper, value in group.items())
    missing = sorted(key for key in live if key.startswith("param_groups.") and key not in state)
    if missing:
        raise CheckpointError(
            f"{path} has no hyper-parameters for {', '.join(missing[:3])}: it was saved from another model "
            "or optimizer. Prepare the model and optimizer the Accelerate run trained."
        )
    return sharded.OptimizerState(
        {key: state[key] for key in live if key in state}, planner.found_optional or not live
    )


def _load_rng_file(path: Path) -> dict[str, Any]:
    """random_states_<rank>.pkl: torch.save of plain values, a torch tensor and NumPy's legacy state tuple
    (an array of uint32), read with weights_only and NumPy's array type allowed, as Accelerate reads it."""
    with torch.serialization.safe_globals(_RNG_GLOBALS):
        return load_object(path)


def _rng_state(saved: dict[str, Any]) -> dict[str, Any]:
    """Accelerate's RNG record as unison's random.set_rng_state takes it. Devices other than CUDA (XPU,
    NPU, ...) are not restored: unison runs on CPU and CUDA."""
    name, key, pos, has_gauss, gauss = saved["numpy_random_seed"]
    states = {
        "python": saved["random_state"],
        "numpy": {
            "bit_generator": name,
            "state": {"key": key.tolist(), "pos": pos},
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "torch": saved["torch_manual_seed"],
    }
    if "torch_cuda_manual_seed" in saved:
        states["cuda"] = saved["torch_cuda_manual_seed"]
    return states


def _apply(training, read: _Read, layouts, owner, strict: bool) -> None:
    """Put what was read into the live objects (every check has passed on every process)."""
    sharded = _sharded()
    for i, (kind, state) in read.models.items():
        model = training.models[i]
        if kind == "dcp":
            sharded.apply_model_state(model, state, strict)
        elif layouts[i].sharded:
            sharded.apply_full_model_state(model, state, strict)
        else:
            unwrap(model).load_state_dict(state, strict=strict)
    for j, (kind, state) in read.optimizers.items():
        optimizer, model = training.optimizers[j], training.models[owner[j]] if j in owner else None
        if kind == "dcp":
            sharded.apply_optimizer_state(model, optimizer, state)
        elif kind == "by name":
            sharded.apply_named_optimizer_state(model, optimizer, state)
        elif model is not None and layouts[owner[j]].sharded:
            sharded.apply_full_optimizer_state(model, optimizer, state)
        else:
            optimizer.load_state_dict(state)
    for scheduler, state in zip(training.schedulers, read.schedulers):
        scheduler.load_state_dict(state)
    for obj, state in zip(training.custom_objects, read.customs):
        obj.load_state_dict(state)
    if training.scaler is not None:
        training.scaler.load_state_dict(read.scaler)


def _steps_taken(optimizer: Any) -> int:
    """Optimizer steps taken, which Accelerate does not record: the optimizer's own count where it keeps
    one (Adam's and most others' `step` per parameter), else 0 (SGD keeps none)."""
    local = _sharded()._local_optimizer(optimizer)  # ZeRO-1: this process's optimizer, which holds state
    steps = [int(value["step"]) for value in local.state.values() if "step" in value]
    return max(steps, default=0)


def _summary(folder: _Folder, training: Any, num_processes: int, accelerate_numerics: bool) -> str:
    """The one line that says an Accelerate folder was read, and what came from it."""
    loaded = [
        _counted(len(folder.models), "model"),
        _counted(len(folder.optimizers), "optimizer"),
        _counted(len(folder.schedulers), "scheduler"),
        _counted(len(folder.customs), "registered object"),
    ]
    if training.scaler is not None:
        loaded.append("the fp16 loss scale")
    loaded = [part for part in loaded if part]
    processes = (
        "each process its random states and Accelerator.step"
        if folder.world_size == num_processes
        else f"random states saved by {folder.world_size} processes, resumed by {num_processes}: processes "
        f"0 to {min(folder.world_size, num_processes) - 1} take those of their rank, the others keep theirs"
    )
    sharded = any(kind == "dcp" for _, kind in folder.models)
    return (
        f"read an Accelerate checkpoint ({folder.directory}{', FSDP sharded' if sharded else ''}): "
        f"{', '.join(loaded)}, {processes}. Accelerate records no data position: the loaders start their "
        "epoch afresh (skip_first_batches skips what was done, as under Accelerate), and the script's "
        "gradient_accumulation_steps is kept."
        + (
            ""
            if accelerate_numerics
            else " This run computes unison's numbers: to go on with the Accelerate run's (its scheduler "
            "stepped num_processes times per optimizer step, its short accumulation windows, its shuffle), "
            "set UNISON_NUMERICS=accelerate or Accelerator(numerics='accelerate')."
        )
    )


def _counted(count: int, what: str) -> str:
    return "" if count == 0 else f"{count} {what}{'s' if count > 1 else ''}"
