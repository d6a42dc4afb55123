"""Checkpoints: atomic, verified directories on disk (storage, their manifest of checksums in manifest),
the training state in them (training_state; written now or in the background by writing; sharded layouts
through DCP in sharded, read without executing code by dcp_reading, imported on first use), consolidated
weights for use without unison from any layout (weights), a checkpoint exported as a Hugging Face
folder on one process (export), and the folders Accelerate's save_state writes, read so that a run started
under Accelerate continues (accelerate_folders, chosen by load_state in methods)."""

from .errors import CheckpointError
from .manifest import MANIFEST_NAME, files_of_process, read_manifest, verify_checkpoint, verify_files
from .storage import (
    ProjectConfiguration,
    checkpoint_path,
    list_checkpoints,
    load_object,
    newest_checkpoint,
    prune_checkpoints,
    save_object,
    temporary_path,
    write_checkpoint,
)
from .training_state import TrainingParts, load_training_state, save_training_state
from .weights import (
    SAFETENSORS_FILE,
    TORCH_FILE,
    consolidated_state_dict,
    save_consolidated_weights,
    save_model_weights,
)

__all__ = [
    "MANIFEST_NAME",
    "SAFETENSORS_FILE",
    "TORCH_FILE",
    "CheckpointError",
    "ProjectConfiguration",
    "TrainingParts",
    "checkpoint_path",
    "consolidated_state_dict",
    "files_of_process",
    "list_checkpoints",
    "load_object",
    "load_training_state",
    "newest_checkpoint",
    "prune_checkpoints",
    "read_manifest",
    "save_consolidated_weights",
    "save_model_weights",
    "save_object",
    "save_training_state",
    "temporary_path",
    "verify_checkpoint",
    "verify_files",
    "write_checkpoint",
]
