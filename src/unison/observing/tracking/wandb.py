"""Weights & Biases, with Accelerate's WandBTracker arguments: one run in the W&B project named after
the project, where `init_kwargs={"wandb": {...}}` goes to `wandb.init` as it is (entity, name, dir,
mode="offline", tags, ...); the configuration is the run's config, `log` is `run.log`. Where the run
goes (online, offline, the server, the API key) is W&B's own settings (WANDB_MODE, WANDB_DIR, `wandb
login`). Needs the `wandb` package: `pip install 'unison[wandb]'`."""

from __future__ import annotations

from typing import Any

import wandb

from .base import GeneralTracker, on_host


class WandBTracker(GeneralTracker):
    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **init_kwargs: Any):
        """run_name: the W&B project (Accelerate's name for it); init_kwargs: wandb.init's options."""
        self.run_name = run_name
        self.init_kwargs = init_kwargs
        self.run: wandb.Run | None = None

    def start(self) -> None:
        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> wandb.Run | None:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        # allow_val_change: init_kwargs may already have set a key (config=...) that this call restates.
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """kwargs go to run.log (commit=..., ...)."""
        self.run.log(on_host(values), step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
