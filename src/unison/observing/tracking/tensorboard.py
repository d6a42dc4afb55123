"""TensorBoard, through torch's own writer (torch.utils.tensorboard), under `logging_dir/project_name`:
numbers as scalars, strings as text, the configuration as hyperparameters. Needs the `tensorboard`
package: `pip install 'unison[tensorboard]'`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from .base import GeneralTracker, on_host


class TensorBoardTracker(GeneralTracker):
    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **writer_options: Any):
        self.directory = Path(logging_dir) / run_name
        self.writer_options = writer_options
        self.writer: SummaryWriter | None = None

    def start(self) -> None:
        self.writer = SummaryWriter(str(self.directory), **self.writer_options)

    @property
    def tracker(self) -> SummaryWriter | None:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """The configuration as TensorBoard's hyperparameters of this run, in the run's own event file:
        `add_hparams` would open a second writer (a second event file, or another run's folder)."""
        plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
        for summary in hparams(plain, metric_dict={}):  # the experiment, session start and end
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for name, value in on_host(values).items():
            if isinstance(value, str):
                self.writer.add_text(name, value, global_step=step, **kwargs)
            else:
                self.writer.add_scalar(name, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
