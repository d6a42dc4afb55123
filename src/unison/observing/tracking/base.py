"""The tracker interface (Accelerate's `GeneralTracker`), the names trackers go by, and the one place
that turns `log_with=` into tracker objects.

A tracker writes what `Accelerator.log` hands it. Built-in ones need nothing beyond the standard
library; the others wrap a real library, imported only when the tracker is asked for, so a missing
package is an error that names the extra to install.
"""

from __future__ import annotations

import enum
import importlib
import os
from collections.abc import Mapping
from typing import Any

import torch


class LoggerType(str, enum.Enum):
    """Tracker names, as `log_with=` takes them (Accelerate's names, plus unison's built-in files)."""

    ALL = "all"
    JSONL = "jsonl"
    CSV = "csv"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class GeneralTracker:
    """Base class of every tracker; subclass it to add your own and pass an instance to `log_with=`.

    A subclass sets `name` (what get_tracker finds it by) and `requires_logging_directory`, and
    implements `tracker` (the underlying run or writer), `store_init_configuration`, `log` and, where
    something must be closed, `finish`. `main_process_only=False` runs it on every process.
    """

    name: str
    requires_logging_directory: bool
    main_process_only: bool = True

    def start(self) -> None:
        """Open files or runs: called by init_trackers, so constructing a tracker has no side effects."""

    @property
    def tracker(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not expose an underlying tracker object.")

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record `values` (str -> number or str), at `step` if given."""

    def finish(self) -> None:
        """Flush and close whatever start() opened."""


_TRACKERS = {
    LoggerType.JSONL: ("unison.observing.tracking.files", "JSONLinesTracker", None),
    LoggerType.CSV: ("unison.observing.tracking.files", "CSVTracker", None),
    LoggerType.TENSORBOARD: ("unison.observing.tracking.tensorboard", "TensorBoardTracker", "tensorboard"),
    LoggerType.MLFLOW: ("unison.observing.tracking.mlflow", "MLflowTracker", "mlflow"),
    LoggerType.WANDB: ("unison.observing.tracking.wandb", "WandBTracker", "wandb"),
}
"""name -> (module, class, the extra that installs its library, None: nothing to install)."""


def tracker_class(name: LoggerType) -> type[GeneralTracker]:
    """The class behind a tracker name, imported on first use."""
    if name not in _TRACKERS:
        available = ", ".join(repr(n.value) for n in _TRACKERS)
        raise ValueError(
            f"log_with={name.value!r}: unison does not provide this tracker yet. Use one of {available}, "
            "or pass an instance of your own unison.observing.tracking.GeneralTracker subclass."
        )
    module, cls, extra = _TRACKERS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as error:
        raise ImportError(
            f"log_with={name.value!r} needs the {extra} package ({error}): `pip install 'unison[{extra}]'`."
        ) from None


def _available() -> list[LoggerType]:
    """What log_with="all" means: every tracker unison provides whose library is installed."""
    available = []
    for name in _TRACKERS:
        try:
            tracker_class(name)
        except ImportError:
            continue
        available.append(name)
    return available


def resolve_log_with(log_with: Any) -> list[LoggerType | GeneralTracker]:
    """`log_with` (a name, a LoggerType, a tracker object, or a list of them; "all": every built-in
    and installed one) as a list without repeats, checked before the run starts."""
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    resolved: list[LoggerType | GeneralTracker] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            resolved.append(item)
            continue
        try:
            name = LoggerType(item.value if isinstance(item, enum.Enum) else str(item).lower())
        except ValueError:
            choices = ", ".join(repr(n.value) for n in LoggerType)
            raise ValueError(
                f"log_with={item!r} is not a tracker: pass one of {choices}, or a GeneralTracker instance."
            ) from None
        names = _available() if name is LoggerType.ALL else [name]
        for one in names:
            tracker_class(one)  # unknown or not installed: said now, not after the first epoch
            if one not in resolved:
                resolved.append(one)
    return resolved


def build_trackers(
    log_with: list[LoggerType | GeneralTracker],
    project_name: str,
    logging_dir: str | os.PathLike | None,
    init_kwargs: Mapping[str, Mapping[str, Any]],
) -> list[GeneralTracker]:
    """Instantiate the named trackers for `project_name` (their files under `logging_dir`)."""
    trackers = []
    for item in log_with:
        if isinstance(item, GeneralTracker):
            trackers.append(item)
            continue
        cls = tracker_class(item)
        options = dict(init_kwargs.get(item.value, {}))
        if cls.requires_logging_directory:
            if logging_dir is None:
                raise ValueError(
                    f"log_with={item.value!r} writes files, but the Accelerator has no logging directory: "
                    "pass project_dir='runs/x' (or ProjectConfiguration(logging_dir=...))."
                )
            trackers.append(cls(project_name, logging_dir, **options))
        else:
            trackers.append(cls(project_name, **options))
    return trackers


def on_host(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with 0-d tensors as Python numbers, copied to the host in one transfer per log call
    (one device sync, not one per value)."""
    tensors = {key: value for key, value in values.items() if isinstance(value, torch.Tensor)}
    for key, value in tensors.items():
        if value.numel() != 1:
            raise ValueError(
                f"log({key!r}: a tensor of shape {tuple(value.shape)}): a logged value is one number; "
                f"log value.mean() or each element under its own name."
            )
    if not tensors:
        return dict(values)
    numbers = torch.stack([value.detach().reshape(()).float() for value in tensors.values()]).tolist()
    return {**values, **dict(zip(tensors, numbers))}
