"""Reading DCP directories without executing code: what a checkpoint's sharded parts are read through.

DCP's own reader unpickles `.metadata` and non-tensor values with plain pickle, which runs whatever a
crafted file asks. `SafeFileSystemReader` reads `.metadata` with an unpickler that builds DCP's metadata
types only; `SafeLoadPlanner` reads non-tensor values with torch.load(weights_only=True), and checks the
keys (a missing or unexpected one is an error naming it). `read_full_model_state` reads a part whole on
one process, without a model or a process group (`unison export`).
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from .errors import CheckpointError, describe_keys

DCP_METADATA = ".metadata"
"""The one metadata file of a DCP directory (unison writes no per-rank metadata files)."""

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's metadata is made of: its dataclasses, torch.Size, dtypes, layouts, paths."""

    def find_class(self, module: str, name: str) -> Any:
        # Only modules known to hold metadata types are imported at all, and no `module.attr.attr` paths.
        known = module in _METADATA_MODULES or module == "torch" or (module, name) in _METADATA_GLOBALS
        found = super().find_class(module, name) if known and "." not in name else None
        allowed = found is not None and (
            (module, name) in _METADATA_GLOBALS
            or (module in _METADATA_MODULES and isinstance(found, type) and found.__module__ == module)
            or (module == "torch" and isinstance(found, torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of a DCP checkpoint's metadata: refused, since loading a "
                "checkpoint must not build arbitrary objects."
            )
        return found


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` with an unpickler that cannot run code."""

    def read_metadata(self, *args: Any) -> Metadata:
        # The one metadata file unison writes (no per-rank metadata files), at the path DCP names it.
        path = self.fs.concat_path(self.path, DCP_METADATA)
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with non-tensor values read by torch.load(weights_only=True).

    `optional_prefix`: keys under it may be absent from the checkpoint as a whole (an optimizer saved
    before its first step has hyper-parameters but no state); `found_optional` says whether any was
    there. Any other key missing from the checkpoint is an error naming it, unless strict=False
    (load_state(strict=False)): then the keys are left out of the load, as DCP's allow_partial_load does,
    and listed in `missing`. `model_keys`, with strict: the keys the model has on any process; a saved
    key outside them is an error too, as in torch's load_state_dict(strict=True) (DCP itself reads
    only the keys asked for, and would ignore it).
    """

    def __init__(
        self,
        optional_prefix: str | None = None,
        strict: bool = True,
        model_keys: frozenset[str] | None = None,
    ) -> None:
        # unison's state dicts are flat (name -> value): no flattening, so self.state_dict is the caller's
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.optional_prefix = optional_prefix
        self.strict = strict
        self.model_keys = model_keys
        self.found_optional = False
        self.missing: list[str] = []

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = metadata.state_dict_metadata
        prefix = self.optional_prefix
        self.found_optional = prefix is not None and any(key.startswith(prefix) for key in saved)
        self.missing = [key for key in self.state_dict if key not in saved]
        if self.strict:
            required = [
                key
                for key in self.missing
                if prefix is None or self.found_optional or not key.startswith(prefix)
            ]
            unexpected = [] if self.model_keys is None else sorted(set(saved) - self.model_keys)
            if required or unexpected:
                advice = (
                    "another model (pass load_state(..., strict=False) to load the weights both have)"
                    if self.model_keys is not None
                    else "a model or optimizer with other parameter names (another model, or an optimizer of "
                    "another type)"
                )
                raise KeyError(f"{describe_keys(required, unexpected)}: it was saved from {advice}")
        self.allow_partial_load = bool(self.missing)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def dcp_error(directory: Path, error: BaseException) -> CheckpointError:
    """One readable error from DCP's per-rank CheckpointException (or any other failure)."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(sorted(error.failures.items())))
        detail = f"{type(cause).__name__} on process {rank}: {cause}"
    else:
        detail = f"{type(error).__name__}: {error}"
    return CheckpointError(
        f"cannot load the sharded checkpoint part {directory} ({detail}). Load it into the model and "
        "optimizer of the run that saved it (the same classes and parameter names; the layout and the number "
        "of processes may differ)."
    )


def dcp_load(state: dict[str, Any], directory: Path, planner: SafeLoadPlanner) -> None:
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(directory), planner=planner)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        raise dcp_error(directory, error) from None


def read_full_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP model part, whole, on this one process: no process group and no model (the
    sizes and dtypes come from the part's metadata). What `unison export` writes out."""
    metadata = SafeFileSystemReader(directory).read_metadata()
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    reader, planner = SafeFileSystemReader(directory), SafeLoadPlanner()
    try:
        with warnings.catch_warnings():  # no_dist=True says so; torch warns that it assumes it all the same
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        raise dcp_error(directory, error) from None
    return state
