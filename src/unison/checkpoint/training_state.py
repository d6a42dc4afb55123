"""The whole training state of an Accelerator, saved to and restored from one checkpoint directory.

What a checkpoint holds: every prepared model, optimizer and scheduler, the fp16 scaler, every
prepared DataLoader's position (in samples, so it loads on another number of processes), the objects
given to `register_for_checkpointing`, the step counters, and each process's RNG states. Replicated
state is written once, by the main process; each process writes its own RNG states. A model whose
state is sharded (see `sharded.model_layouts`) is written with its optimizers through DCP instead,
each process its own shards (`sharded.py`). The directory is made atomic and verifiable by
`storage.write_checkpoint`, and everything loads with `torch.load(weights_only=True)` (DCP's metadata
with an unpickler that builds only its own types): a checkpoint never executes code.

The Accelerator hands over what is saved as a `TrainingParts` (checkpoint/methods.py builds it), so
this package serves the façade without importing it: accelerator.py imports checkpoint/, never the
reverse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .. import ops
from ..parallel.ddp import unwrap
from ..random import get_rng_state, set_rng_state
from ..state import PartialState
from .errors import CheckpointError, check_shapes, model_keys_error
from .export import MODELS_KEY, describe_models
from .global_batch import TRAINING_LOADER, resumed_global_batch, training_loader_index
from .manifest import files_of_process, read_manifest, verify_files
from .storage import (
    abandon_checkpoint,
    begin_checkpoint,
    checked_metadata,
    finish_checkpoint,
    load_object,
    raise_if_any_process_failed,
)
from .writing import AsyncCheckpointWriter, CheckpointWrites, write_and_finish

logger = logging.getLogger("unison")

COUNTERS_FILE = "counters.pt"


@dataclass
class TrainingParts:
    """What a checkpoint saves and restores: the prepared objects and counters of one Accelerator.

    Each object has state_dict()/load_state_dict(); optimizers also count their steps
    (`num_steps_taken`, unison's AcceleratedOptimizer). `step` is the micro-steps since the last
    optimizer step (Accelerator.step); `gradient_accumulation_steps` is the run's, and load_training_state
    sets it to the one that keeps the saved global batch (global_batch.py); `split_batches` the
    Accelerator's; `device` where replicated files are loaded. The hooks are
    Accelerate's save_state / load_state pre-hooks, `hook(models, weights, output_dir)` and
    `hook(models, input_dir)`.
    """

    models: Sequence[torch.nn.Module] = ()
    optimizers: Sequence[Any] = ()
    schedulers: Sequence[Any] = ()
    dataloaders: Sequence[Any] = ()
    custom_objects: Sequence[Any] = ()
    scaler: torch.amp.GradScaler | None = None
    step: int = 0
    gradient_accumulation_steps: int = 1
    split_batches: bool = False
    device: torch.device | str = "cpu"
    save_hooks: Sequence[Callable[[list, list, str], None]] = ()
    load_hooks: Sequence[Callable[[list, str], None]] = ()

    @property
    def optimizer_steps(self) -> int:
        return optimizer_steps(self.optimizers)


def optimizer_steps(optimizers: Sequence[Any]) -> int:
    """Real optimizer steps taken so far: the most any optimizer took (micro-steps and fp16-skipped steps
    are not counted by them)."""
    return max((optimizer.num_steps_taken for optimizer in optimizers), default=0)


def _rng_file(process_index: int) -> str:
    return f"rng_state_{process_index}.pt"


def _sharded() -> ModuleType:
    """checkpoint.sharded, imported on first use: it loads torch's distributed checkpoint (DCP) and
    DTensor, about half a second that `import unison` should not cost a run that never saves."""
    from . import sharded

    return sharded


def _replicated_parts(training: TrainingParts) -> dict[str, Any]:
    """file name -> the object (with state_dict/load_state_dict) whose state it holds."""
    parts: dict[str, Any] = {}
    for i, model in enumerate(training.models):
        parts[f"model_{i}.pt"] = unwrap(model)
    for i, optimizer in enumerate(training.optimizers):
        parts[f"optimizer_{i}.pt"] = optimizer
    for i, scheduler in enumerate(training.schedulers):
        parts[f"scheduler_{i}.pt"] = scheduler
    for i, loader in enumerate(training.dataloaders):
        parts[f"dataloader_{i}.pt"] = loader
    for i, obj in enumerate(training.custom_objects):
        parts[f"custom_checkpoint_{i}.pt"] = obj
    if training.scaler is not None:
        parts["scaler.pt"] = training.scaler
    return parts


def _counters(training: TrainingParts) -> dict[str, Any]:
    return {
        "step": training.step,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "world_size": PartialState().num_processes,
        TRAINING_LOADER: training_loader_index(training.dataloaders),
        "optimizer_steps": [optimizer.num_steps_taken for optimizer in training.optimizers],
        "optimizer_classes": _optimizer_classes(training),
    }


def _optimizer_classes(training: TrainingParts) -> list[str]:
    """The class of each optimizer the user built (ZeRO-1's per-process optimizer is of that class)."""
    return [type(_sharded()._local_optimizer(optimizer)).__qualname__ for optimizer in training.optimizers]


def _check_optimizer_classes(counters: dict[str, Any], training: TrainingParts, directory: Path) -> None:
    """Refuse, before anything is applied, optimizer state saved from another kind of optimizer: torch
    loads an SGD's state into an AdamW without a word, and the first step fails with KeyError: 'betas'."""
    saved = counters.get("optimizer_classes", [])  # absent from checkpoints written before it was saved
    for index, (was, now) in enumerate(zip(saved, _optimizer_classes(training))):
        if was != now:
            raise CheckpointError(
                f"{directory} holds the state of optimizer {index} saved from {was}, but this run's "
                f"optimizer {index} is {now}: {was}'s state and hyper-parameters do not fit it. Prepare "
                f"{was} as the saved run did; to switch to {now}, prepare the model alone, load_state, "
                "then prepare the new optimizer."
            )


def _micro_step(counters: dict[str, Any], accumulation: int, directory: Path) -> int:
    """Accelerator.step for the resumed run: the micro-steps into the accumulation window decide where the
    next window ends (step % k == 0), so they must count in this run's micro-steps.

    Saved at the end of an optimizer step (the usual place) the resumed run starts a fresh window: 0, on
    any number of processes and accumulation (the saved count, e.g. 6 micro-steps of k=2, would otherwise
    end the first window of a k=4 run after 2 micro-batches). Saved inside a window, the count carries over
    only to the same processes and accumulation (`accumulation`: the resumed run's, see global_batch.py);
    elsewhere it is refused, on every process alike.
    """
    step, saved_k = counters["step"], counters.get("gradient_accumulation_steps")
    saved_world = counters.get("world_size", PartialState().num_processes)
    if saved_k is None:  # a checkpoint from before these counters: as it was saved
        return step
    if step % saved_k == 0:
        return 0
    if (saved_k, saved_world) == (accumulation, PartialState().num_processes):
        return step
    raise CheckpointError(
        f"{directory} was saved {step % saved_k} micro-batches into an accumulation window of {saved_k} on "
        f"{saved_world} processes; this run accumulates {accumulation} on "
        f"{PartialState().num_processes}, so that window cannot be continued. Resume it with the saved "
        "processes and accumulation, or save at the end of an optimizer step (when sync_gradients is True)."
    )


def _model_parts(training: TrainingParts) -> tuple[dict[str, tuple[torch.nn.Module, Any]], set[str]]:
    """(file name -> (its model, the model or optimizer itself)) for every model and every optimizer
    of a model's parameters, and the names of those whose live layout is sharded (saved through DCP).

    Collective: the layouts are agreed on by every process.
    """
    models, optimizers = training.models, training.optimizers
    parts: dict[str, tuple[torch.nn.Module, Any]] = {}
    sharded_names: set[str] = set()
    for i, layout in enumerate(_sharded().model_layouts(models, optimizers)):
        names = [f"model_{i}.pt", *(f"optimizer_{j}.pt" for j in layout.optimizers)]
        parts[names[0]] = (models[i], models[i])
        parts.update((f"optimizer_{j}.pt", (models[i], optimizers[j])) for j in layout.optimizers)
        if layout.sharded:
            sharded_names.update(names)
    return parts, sharded_names


def _part_directory(directory: Path, name: str) -> Path:
    return directory / name.removesuffix(".pt")


def save_training_state(
    training: TrainingParts,
    directory: Path,
    writer: AsyncCheckpointWriter | None = None,
    on_complete: Callable[[], Any] | None = None,
) -> Path:
    """Write the training state into `directory` (atomically; every process must call this).

    The save_state pre-hooks run first, inside the checkpoint being written (their output_dir is its
    temporary directory, so what they write is checksummed and renamed with it); a model whose weights
    they removed from the list is not saved (they saved it their way).

    writer: save asynchronously: the state is copied to host memory (`writer`'s staging buffers) and this
    returns; `writer` writes it, checksums it and renames it into place in the background. Without it,
    this returns once the checkpoint is complete. on_complete: called once it is (in the background too).
    """
    state = PartialState()
    metadata = {"optimizer_steps": training.optimizer_steps, "world_size": state.num_processes}
    metadata[MODELS_KEY] = describe_models(list(training.models))  # for `unison export`: ties, config
    metadata = checked_metadata(metadata)
    model_parts, sharded_parts = _model_parts(training)
    if writer is not None:
        writer.prepare()  # collective: its process group, made once, before any file exists
    staging = begin_checkpoint(directory)
    try:
        left_to_hooks = {f"model_{i}.pt" for i in _models_saved_by_hooks(training, staging)}
        writes = _writes(training, staging, model_parts, sharded_parts, left_to_hooks)
        if writer is not None:
            writes = writer.stage(writes)
    except Exception as error:
        finish_checkpoint(staging, directory, metadata, error)  # raises on every process
        raise  # (finish_checkpoint raised already; this line is never reached)
    except BaseException:
        abandon_checkpoint(staging)
        raise
    if writer is None:
        write_and_finish(writes, staging, directory, metadata)
        logger.info("saved the training state to %s", directory)
        if on_complete is not None:
            on_complete()
    else:
        writer.start(writes, staging, directory, metadata, on_complete)
    return directory


def _writes(
    training: TrainingParts,
    staging: Path,
    model_parts: dict[str, tuple[torch.nn.Module, Any]],
    sharded_parts: set[str],
    left_to_hooks: set[str],
) -> CheckpointWrites:
    """What this process writes into `staging`, as live objects: the sharded parts' states (collective:
    each process's shards) and, on the main process, the replicated files; every process its RNG file."""
    state = PartialState()
    writes = CheckpointWrites()
    for name in sorted(sharded_parts - left_to_hooks):  # collective: the same order on every process
        model, part = model_parts[name]
        if part is model:
            writes.parts[_part_directory(staging, name)] = _sharded().model_state(model)
        else:
            writes.parts[_part_directory(staging, name)] = _sharded().optimizer_state(model, part)
    if state.is_main_process:
        for name, part in _replicated_parts(training).items():
            if name not in sharded_parts and name not in left_to_hooks:
                writes.files[staging / name] = part.state_dict()
        writes.files[staging / COUNTERS_FILE] = _counters(training)
    writes.files[staging / _rng_file(state.process_index)] = get_rng_state()
    return writes


def _models_saved_by_hooks(training: TrainingParts, output_dir: Path) -> list[int]:
    """Run the save_state pre-hooks as Accelerate does, `hook(models, weights, output_dir)`; the indices
    of the models whose state dict a hook removed from `weights`, as the main process saw it (a hook
    often acts on the main process only, and which models the collective save skips must agree)."""
    if not training.save_hooks:
        return []
    weights = [unwrap(model).state_dict() for model in training.models]
    offered = [id(weight) for weight in weights]
    for hook in training.save_hooks:
        hook(list(training.models), weights, str(output_dir))
    kept = {id(weight) for weight in weights}
    removed = [i for i, ident in enumerate(offered) if ident not in kept]
    return ops.broadcast_object_list([removed], from_process=0)[0]


def models_loaded_by_hooks(training: TrainingParts, input_dir: Path) -> list[int]:
    """Run the load_state pre-hooks, `hook(models, input_dir)`; the indices of the models a hook removed
    from `models` (it loaded them its way), as the main process saw it."""
    if not training.load_hooks:
        return []
    models = list(training.models)
    for hook in training.load_hooks:
        hook(models, str(input_dir))
    kept = {id(model) for model in models}
    removed = [i for i, model in enumerate(training.models) if id(model) not in kept]
    return ops.broadcast_object_list([removed], from_process=0)[0]


def _main_process_view(directory: Path, names: list[str]) -> tuple[dict | None, list[str], str | None]:
    """(the manifest, which of the model and optimizer `names` were saved through DCP, None), or
    (None, [], why the directory is not a complete checkpoint)."""
    try:
        manifest = read_manifest(directory)
    except CheckpointError as error:
        return None, [], str(error)
    saved_sharded = [
        name
        for name in names
        if name.startswith(("model_", "optimizer_"))
        and _sharded().is_sharded_part(_part_directory(directory, name))
    ]
    return manifest, sorted(saved_sharded), None


def _verification_error(directory: Path, manifest: dict[str, Any], names: list[str]) -> Exception | None:
    """verify_files of this process's share, run beside the reads: the failure returned, not raised."""
    try:
        verify_files(directory, manifest, names)
    except Exception as error:  # an unreadable file too: every process must hear of it
        return error
    return None


def _read(
    directory: Path, files: dict[str, Any], mapped: set[str] = frozenset()
) -> tuple[dict[str, Any], Exception | None]:
    """Load the files named in `files` (name -> map_location; those in `mapped` memory-mapped on the
    CPU); the first failure is returned, not raised, for after the check."""
    loaded: dict[str, Any] = {}
    for name, map_location in files.items():
        try:
            loaded[name] = load_object(directory / name, map_location=map_location, mmap=name in mapped)
        except Exception as exc:  # judged once the checksums are known: a damaged file explains it best
            return loaded, exc
    return loaded, None


def _read_sharded(
    directory: Path,
    names: list[str],
    model_parts: dict[str, tuple[torch.nn.Module, Any]],
    strict: bool,
    model_keys: dict[str, frozenset[str]],
) -> tuple[dict[str, Any], Exception | None]:
    """Read the DCP parts into new tensors (nothing applied); the first failure is returned, not raised.

    Collective. A DCP failure is reported to every process alike, so all stop at the same part.
    strict / model_keys: see load_training_state.
    """
    staged: dict[str, Any] = {}
    for name in names:
        if name not in model_parts:
            return staged, CheckpointError(
                f"{_part_directory(directory, name)} holds sharded optimizer state, keyed by the names of "
                "its model's parameters, but this run's optimizer of that index optimizes no prepared model. "
                "Prepare the model with its optimizer, as the run that saved it did."
            )
        model, part = model_parts[name]
        path = _part_directory(directory, name)
        try:
            if part is model:
                staged[name] = _sharded().read_model_state(model, path, strict, model_keys.get(name))
            else:
                staged[name] = _sharded().read_optimizer_state(model, part, path)
        except CheckpointError as exc:
            return staged, exc
    return staged, None


def _fit_error(
    parts: dict[str, Any],
    model_parts: dict[str, tuple[torch.nn.Module, Any]],
    sharded_parts: set[str],
    loaded: dict[str, Any],
    strict: bool,
    model_keys: dict[str, frozenset[str]],
) -> Exception | None:
    """Whether the files read whole fit the live objects, checked before anything is applied: a plain
    or DDP run's model and optimizer files loaded into a sharded layout, with strict each model file's
    keys (exactly the model's, as torch's load_state_dict(strict=True) wants them), and each prepared
    data loader's position (a whole number of its steps on this run's processes)."""
    try:
        for name in [name for name in parts if name in loaded]:
            is_model = name.startswith("model_")
            if name in sharded_parts:
                model, live = model_parts[name]
                if not is_model:
                    _sharded().check_full_optimizer_state(live, loaded[name])
                elif strict:
                    _sharded().check_full_model_state(model, loaded[name], model_keys[name])
            elif is_model:  # a replicated model: the same keys on every process
                live = parts[name].state_dict()
                missing = [key for key in live if key not in loaded[name]]
                unexpected = [key for key in loaded[name] if key not in live]
                if strict and (missing or unexpected):
                    raise model_keys_error(missing, unexpected)
                check_shapes(name, live, loaded[name])  # torch would copy the others, then raise
            elif hasattr(parts[name], "check_state_dict"):  # a prepared data loader: can it go on from here?
                parts[name].check_state_dict(loaded[name])
    except CheckpointError as error:
        return error
    except ValueError as error:  # a loader's position that this run's processes cannot continue
        return CheckpointError(f"{name}: {error}")
    return None


def _apply(
    name: str,
    part: Any,
    model_parts: dict,
    sharded_parts: set[str],
    staged: dict,
    loaded: dict,
    strict: bool,
    streamed_parts: set[str],
) -> None:
    """Put one part's loaded state into the live object, whatever the saved and the live layouts."""
    if name in staged:  # saved sharded: DCP read the pieces this process's layout needs
        model, live = model_parts[name]
        if live is model:
            _sharded().apply_model_state(model, staged[name], strict)
        else:
            _sharded().apply_optimizer_state(model, live, staged[name])
    elif name in sharded_parts:  # saved whole by a plain or DDP run, loaded into a sharded layout
        model, live = model_parts[name]
        streamed = name in streamed_parts  # the main process's copy, broadcast one tensor at a time
        if live is model:
            _sharded().apply_full_model_state(model, loaded.get(name), strict, streamed)
        else:
            _sharded().apply_full_optimizer_state(model, live, loaded.get(name), streamed)
    elif name.startswith("model_"):
        part.load_state_dict(loaded[name], strict=strict)
    else:
        part.load_state_dict(loaded[name])


def load_training_state(training: TrainingParts, directory: Path, strict: bool = True) -> int:
    """Restore everything `save_training_state` wrote into the objects of `training`; returns the
    micro-step count (Accelerator.step) the resumed run continues from, and sets
    `training.gradient_accumulation_steps` to the accumulation that keeps the saved global batch per
    optimizer step (a CheckpointError, before anything is applied, where none does: global_batch.py).

    Every process verifies its share of the files (their sizes and checksums, see
    manifest.checksumming_process) while it reads the files it loads (one read of each file on each
    process, not one to check and one to load); nothing is applied until every process's check has
    passed, and a failed check raises a CheckpointError naming the file on every process. Model and
    optimizer parts saved through DCP are read, on each process, into new tensors laid out like its
    own shards; parts load across layouts (sharded <-> plain, another number of processes).
    strict: each model's saved keys must be exactly its own (a CheckpointError naming the keys, before
    anything is applied); strict=False loads the keys both have and leaves the model's others as they are.
    """
    state = PartialState()
    loaded_by_hooks = {f"model_{i}.pt" for i in models_loaded_by_hooks(training, directory)}
    parts = {name: part for name, part in _replicated_parts(training).items() if name not in loaded_by_hooks}
    model_parts, sharded_parts = _model_parts(training)
    sharded_parts -= loaded_by_hooks
    # The main process's view of the directory (its manifest, which parts DCP reads: a collective), for
    # everyone: a node whose view of a shared filesystem lags must not read another checkpoint.
    view = _main_process_view(directory, list(parts)) if state.is_main_process else None
    manifest, saved_sharded, error = ops.broadcast_object_list([view], from_process=0)[0]
    if error is not None:
        raise CheckpointError(error)
    torch_files = [name for name in [*parts, COUNTERS_FILE] if name not in saved_sharded]
    expected = {name: name for name in torch_files}
    expected.update((name, f"{name.removesuffix('.pt')}/{_sharded().DCP_METADATA}") for name in saved_sharded)
    missing = sorted(name for name, file in expected.items() if file not in manifest["files"])
    if missing:
        raise CheckpointError(
            f"{directory} has no {', '.join(missing)}: it was saved from a run that prepared fewer models, "
            "optimizers, schedulers, data loaders or registered objects (or another precision) than this "
            "one. Prepare the same objects, in the same order, as the run that saved it."
        )
    # Whole files (a plain or DDP run's) for a sharded layout: the main process alone reads them, mapped
    # on its CPU, and sends them on tensor by tensor; no process reads the whole model onto its device.
    streamed = _sharded().streamed_parts(sharded_parts - set(saved_sharded), model_parts)
    to_read = {
        name: "cpu" if name in streamed else training.device
        for name in torch_files
        if name not in streamed or state.is_main_process
    }
    rng_file = _rng_file(state.process_index)
    if rng_file in manifest["files"]:  # the saved run had this rank: its streams, read now, applied last
        to_read[rng_file] = None  # (generator states stay on the CPU)
    model_keys = _model_keys(model_parts, sharded_parts) if strict else {}
    to_verify = files_of_process(manifest, state.process_index, state.num_processes)
    with ThreadPoolExecutor(max_workers=1) as pool:
        check = pool.submit(_verification_error, directory, manifest, to_verify)
        loaded, read_error = _read(directory, to_read, mapped=streamed)
        staged, stage_error = _read_sharded(directory, saved_sharded, model_parts, strict, model_keys)
        verification_error = check.result()
    raise_if_any_process_failed(verification_error, f"verifying {directory}")  # the clearest error first
    failure = read_error or stage_error
    failure = failure or _fit_error(parts, model_parts, sharded_parts, loaded, strict, model_keys)
    raise_if_any_process_failed(failure, f"loading {directory}")
    counters = loaded[COUNTERS_FILE]
    saved_loaders = [loaded.get(f"dataloader_{i}.pt") for i in range(len(training.dataloaders))]
    global_batch = resumed_global_batch(
        counters,
        saved_loaders,
        training.dataloaders,
        training.gradient_accumulation_steps,
        state.num_processes,
        training.split_batches,
        directory,
    )  # like the micro-step, refused before anything is applied
    micro_step = _micro_step(counters, global_batch.accumulation, directory)
    _check_optimizer_classes(counters, training, directory)
    for name, part in parts.items():
        _apply(name, part, model_parts, sharded_parts, staged, loaded, strict, streamed)
    for optimizer, steps in zip(training.optimizers, counters["optimizer_steps"]):
        optimizer.num_steps_taken = steps
    _load_rng_state(directory, manifest, loaded.get(rng_file))
    training.gradient_accumulation_steps = global_batch.accumulation
    if global_batch.message is not None and state.is_main_process:
        logger.warning(global_batch.message)
    state.wait_for_everyone()
    logger.info("loaded the training state from %s", directory)
    return micro_step


def _model_keys(
    model_parts: dict[str, tuple[torch.nn.Module, Any]], sharded_parts: set[str]
) -> dict[str, frozenset[str]]:
    """Part name -> the keys its model has on any process, for the models of a sharded layout (a pipeline
    stage holds only its own keys; a strict load checks the checkpoint's against all of them). Collective:
    `sharded_parts` is the same on every process."""
    names = sorted(name for name in sharded_parts if model_parts[name][1] is model_parts[name][0])
    if not names:
        return {}
    keys = _sharded().model_keys_everywhere([model_parts[name][0] for name in names])
    return dict(zip(names, keys))


def _load_rng_state(directory: Path, manifest: dict[str, Any], rng_state: dict[str, Any] | None) -> None:
    """Each process resumes its own random streams (`rng_state`, None where the saved run had no process
    of its rank). On another number of processes, the processes whose rank the saved run had (process 0
    among them, whose global RNG draws every shuffle: see data/torch_order.py) resume that rank's
    streams; the others keep theirs. That is said, not hidden."""
    state = PartialState()
    saved_world_size = manifest.get("metadata", {}).get("world_size")
    if saved_world_size != state.num_processes and state.is_main_process:
        resumed = min(int(saved_world_size or 1), state.num_processes)
        logger.warning(
            "checkpoint %s was saved by %s and is loaded by %s: models, optimizers, schedulers and data "
            "positions carry over, and %s the random streams of the saved process of the same rank (so the "
            "next shuffles are the saved run's); results stay within rounding of the original run, not "
            "bit-identical.",
            directory,
            _processes(saved_world_size),
            _processes(state.num_processes),
            "process 0 resumes" if resumed == 1 else f"processes 0 to {resumed - 1} resume",
        )
    if rng_state is not None:
        set_rng_state(rng_state)


def _processes(count: int | None) -> str:
    """ "1 process", "4 processes" ("? processes" when an old manifest did not record it)."""
    return f"{count} process" if count == 1 else f"{count if count is not None else '?'} processes"
