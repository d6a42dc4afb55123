"""The Accelerator's checkpoint methods: save_state, load_state, save_model, get_state_dict and friends.

A mixin, so that accelerator.py stays the façade it is meant to be: these methods read the prepared
objects the Accelerator keeps (`_models`, `_optimizers`, `_custom_objects`, `project_configuration`)
and hand the work to training_state.py (the whole training state, given those objects as a
`TrainingParts`, so that it needs no Accelerator) and weights.py (consolidated weights).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..ops import broadcast_object_list
from ..parallel.ddp import wrapper_prefix
from .accelerate_folders import is_accelerate_folder, load_accelerate_folder
from .storage import checkpoint_path, list_checkpoints, newest_checkpoint, prune_checkpoints
from .training_state import TrainingParts, load_training_state, optimizer_steps, save_training_state
from .weights import consolidated_state_dict, save_consolidated_weights, save_on_main_process
from .writing import AsyncCheckpointWriter


class CheckpointMethods:
    """save_state / load_state / checkpoints / get_state_dict / save_model / register_for_checkpointing."""

    @property
    def optimizer_steps(self) -> int:
        """Real optimizer steps taken so far (micro-steps and fp16-skipped steps not counted)."""
        return optimizer_steps(self._optimizers)

    @property
    def save_iteration(self) -> int:
        """The number the next save_state() without a directory puts in its name: checkpoint_<n>.

        Accelerate counts save_state calls (ProjectConfiguration.iteration); unison names checkpoints by
        optimizer step, so a resumed run names its saves on from the step it loaded, and this is
        `optimizer_steps`. Unlike Accelerate's, checkpoint_<save_iteration - 1> is not the last save:
        save_state() returns that one's path, and checkpoints()[-1] is the newest.
        """
        return self.optimizer_steps

    @property
    def should_save_model(self) -> bool:
        """True on every process, as Accelerate 1.15 answers in every layout: save_model and get_state_dict
        are collective (every process takes part, the main process writes), so every process calls them."""
        return True

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include `objects` (anything with state_dict/load_state_dict) in save_state/load_state."""
        for obj in objects:
            if not all(callable(getattr(obj, name, None)) for name in ("state_dict", "load_state_dict")):
                raise TypeError(
                    f"register_for_checkpointing got a {type(obj).__qualname__}, which has no state_dict() "
                    "and load_state_dict(): checkpoints save objects through those two methods. Add them, "
                    "or keep the object out of the checkpoint."
                )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[[list, list, str], None]) -> RemovableHandle:
        """Call `hook(models, weights, output_dir)` at every save_state, before anything is saved.

        As in Accelerate: `weights` holds each model's state dict; a hook that saves a model its own way
        (e.g. `save_pretrained(os.path.join(output_dir, "unet"))`) removes its entry, and that model is
        then left out of the checkpoint. output_dir is the checkpoint's temporary directory, renamed into
        place with everything else once the save is complete. Returns a handle: `handle.remove()`.
        """
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[[list, str], None]) -> RemovableHandle:
        """Call `hook(models, input_dir)` at every load_state, before anything is loaded: a hook that
        loads a model its own way removes it from `models`, and load_state then leaves it alone."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    def _training_parts(self) -> TrainingParts:
        """What save_state / load_state save and restore, as training_state takes it."""
        return TrainingParts(
            models=list(self._models),
            optimizers=list(self._optimizers),
            schedulers=list(self._schedulers),
            dataloaders=list(self._dataloaders),
            custom_objects=list(self._custom_objects),
            scaler=self.scaler,
            step=self.step,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            split_batches=self.split_batches,
            device=self.device,
            save_hooks=list(self._save_state_pre_hooks.values()),
            load_hooks=list(self._load_state_pre_hooks.values()),
        )

    def _checkpoints_dir(self, action: str) -> Path:
        if self.project_configuration.project_dir is None:
            raise ValueError(
                f"{action}() was given no directory and this Accelerator has no project directory: pass one, "
                "e.g. accelerator.save_state('ckpt/'), or create the Accelerator with "
                "project_config=ProjectConfiguration(project_dir='runs/x') so checkpoints go to "
                "runs/x/checkpoints/checkpoint_<step>."
            )
        return self.project_configuration.checkpoints_dir

    def save_state(
        self, output_dir: str | os.PathLike | None = None, *, async_save: bool | None = None
    ) -> Path:
        """Save the whole training state (call on every process, at the end of an optimizer step).

        Without output_dir it goes to project_dir/checkpoints/checkpoint_<optimizer steps>, and the
        oldest checkpoints beyond ProjectConfiguration.total_limit are removed once it is complete.

        async_save (default: ProjectConfiguration.async_save): return once the state is copied to host
        memory; the files, their checksums, the manifest and the rename happen in the background while
        training goes on. The directory appears complete or not at all, as with a synchronous save; at
        most one save is in flight (the next save, a load_state or end_training waits for it, and so does
        the interpreter's exit). `wait_for_checkpoint()` waits explicitly. Returns the checkpoint's path
        (which exists once it is complete).
        """
        if async_save is None:
            async_save = self.project_configuration.async_save
        automatic = output_dir is None
        if automatic:
            output_dir = checkpoint_path(self._checkpoints_dir("save_state"), self.optimizer_steps)
        limit = self.project_configuration.total_limit if automatic else None
        writer = self._checkpoint_writer() if async_save else None
        if writer is None:
            self.wait_for_checkpoint()  # a synchronous save after an asynchronous one: in order
        directory = Path(output_dir)
        prune = None if limit is None else (lambda: prune_checkpoints(directory.parent, limit))
        return save_training_state(self._training_parts(), directory, writer, on_complete=prune)

    @property
    def checkpoint_in_flight(self) -> Path | None:
        """The checkpoint an asynchronous save_state is still writing in the background, or None."""
        writer = getattr(self, "_async_writer", None)
        return None if writer is None else writer.in_flight

    def wait_for_checkpoint(self) -> Path | None:
        """Wait until no asynchronous save_state is in flight; returns the checkpoint it completed (None if
        there was none), or raises, on every process, what made it fail (nothing was renamed into place)."""
        writer = getattr(self, "_async_writer", None)
        return None if writer is None else writer.wait()

    def _checkpoint_writer(self) -> AsyncCheckpointWriter:
        if getattr(self, "_async_writer", None) is None:
            self._async_writer = AsyncCheckpointWriter()
        return self._async_writer

    def load_state(
        self, input_dir: str | os.PathLike | None = None, *, missing_ok: bool = False, strict: bool = True
    ) -> Path | None:
        """Restore the training state saved by save_state; prepared loaders continue mid-epoch.

        Without input_dir the newest complete checkpoint under project_dir/checkpoints is loaded. If
        there is none, missing_ok=True returns None (start fresh); otherwise FileNotFoundError.
        strict (Accelerate's load_state(..., strict=...), torch's load_state_dict meaning): each model's
        saved keys must be exactly its own, else a CheckpointError names the keys before anything is
        applied; strict=False loads the weights both have and leaves the model's others as they are (e.g. a
        head added since the save), in every layout, sharded ones included. It concerns the models: as in
        Accelerate, optimizer state still has to match its optimizer's parameters.
        A folder Accelerate's save_state wrote loads too (a run started under Accelerate continues here;
        checkpoint/accelerate_folders.py), and one line says so.
        The saved global batch per optimizer step wins over this run's gradient_accumulation_steps: on
        another number of processes (or batch size) the accumulation that keeps it is set and said in one
        line, or the checkpoint is refused before anything is applied (checkpoint/global_batch.py).
        """
        self.wait_for_checkpoint()  # an asynchronous save in flight is the newest checkpoint
        checkpoints = self._checkpoints_dir("load_state") if input_dir is None else None
        # The main process looks at the file system and every process follows its answer: a node whose
        # view of a shared directory lags (NFS attribute caching) must not start fresh while the others
        # enter the collective load, nor pick another checkpoint.
        found = [None, False, False]
        if self.is_main_process:
            directory = Path(input_dir) if input_dir is not None else newest_checkpoint(checkpoints)
            exists = directory is not None and directory.exists()
            found = [directory, exists, exists and is_accelerate_folder(directory)]
        directory, exists, from_accelerate = broadcast_object_list(found, from_process=0)
        if not exists and missing_ok:
            return None
        if directory is None:
            raise FileNotFoundError(
                f"load_state() found no complete checkpoint in {checkpoints}: save one with save_state() "
                "first, or pass missing_ok=True to start fresh when there is nothing to resume."
            )
        training = self._training_parts()
        if from_accelerate:  # a run started under Accelerate (checkpoint/accelerate_folders.py)
            self.step = load_accelerate_folder(training, directory, strict, self._numerics.accelerate)
            return directory
        self.step = load_training_state(training, directory, strict=strict)
        self._resume_accumulation(training.gradient_accumulation_steps)
        return directory

    def _resume_accumulation(self, steps: int) -> None:
        """Run on with the accumulation load_state chose to keep the saved global batch per optimizer step
        (checkpoint/global_batch.py): the Accelerator's, its shared GradientState's and the window's."""
        self.gradient_accumulation_steps = steps
        self.gradient_state.num_steps = steps
        self._window_micro_steps = steps

    def checkpoints(self) -> list[Path]:
        """The complete checkpoints under project_dir/checkpoints, oldest first."""
        return list_checkpoints(self._checkpoints_dir("checkpoints"))

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The consolidated, unsharded state dict of `model` with the user's keys, from any layout.

        Collective under sharded layouts: call it on every process. The main process receives the
        full tensors on CPU; the others get an empty dict (Accelerate's behaviour for FSDP). With
        unwrap=False the keys are those of the wrapper unison put around the model (DDP's "module."),
        as its own state_dict() names them.
        """
        state = consolidated_state_dict(model)
        if unwrap:
            return state
        prefix = wrapper_prefix(model)  # unwrap=False: the keys of the wrapper's own state_dict()
        return {prefix + key: value for key, value in state.items()}

    def save(
        self,
        obj: Any,
        f: str | os.PathLike,
        safe_serialization: bool = False,
        save_on_each_node: bool = False,
    ) -> None:
        """torch.save in place: the main process writes `obj` to `f` (Accelerate's `accelerator.save`).

        Not collective. safe_serialization=True writes a dict of tensors as a safetensors file;
        save_on_each_node=True has each node's local main process write (no shared filesystem).
        """
        save_on_main_process(obj, f, safe_serialization, save_on_each_node)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> Path:
        """Consolidated weights of `model` from any layout, loadable without unison: model.safetensors
        (or pytorch_model.bin), or above `max_shard_size` shards with an index, as Hugging Face saves
        models. Collective: call it on every process; the main process writes. Returns the file (or
        index) path."""
        return save_consolidated_weights(model, Path(save_directory), safe_serialization, max_shard_size)
