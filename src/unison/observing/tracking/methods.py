"""The Accelerator's tracking methods (a mixin, as collectives.py is): init_trackers, log, get_tracker,
closing the trackers at end_training, and the progress display that shows the values last logged.
They read `log_with`, `trackers`, `project_configuration` and `is_main_process` from the Accelerator."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..progress import progress
from .base import GeneralTracker, build_trackers


class TrackingMethods:
    """init_trackers / log / get_tracker / finish_trackers / progress."""

    # the latest value of each name passed to log(), for progress(): an evaluation's val_loss logged at
    # its own call does not hide the training loss; a new dict per call (progress() compares identity)
    _last_logged: dict[str, Any] = {}

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the `log_with` trackers for a run named `project_name`, recording `config` (the
        hyperparameters). init_kwargs: tracker name -> options for that tracker's constructor. Trackers
        run on the main process only unless they set main_process_only=False; call it on every process."""
        trackers = build_trackers(
            self.log_with, project_name, self.project_configuration.logging_dir, init_kwargs or {}
        )
        self.trackers = [t for t in trackers if self.is_main_process or not t.main_process_only]
        for tracker in self.trackers:
            tracker.start()
            if config is not None:
                tracker.store_init_configuration(config)

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Record `values` (name -> number, 0-d tensor or str) in every started tracker of this process.

        Not collective: the values are this process's (reduce them first for a global metric).
        log_kwargs: tracker name -> options for that tracker's log().
        """
        self._last_logged = {**self._last_logged, **values}
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def progress(
        self,
        iterable: Iterable | None = None,
        total: int | None = None,
        desc: str | None = None,
        interval: float | None = None,
    ) -> Iterable:
        """`iterable` (or range(total)) with a progress display on the main process: a tqdm bar on a
        terminal (the `progress` extra), else a line every `interval` seconds (default 30); step/total,
        rate, time left, and the latest value of each name passed to `log()`. Other processes iterate
        it plainly.

            for batch in accelerator.progress(loader, desc="train"):
                ...
                accelerator.log({"loss": loss.item()}, step=step)
        """
        return progress(
            iterable, total, desc, self.is_main_process, lambda: self._last_logged, interval=interval
        )

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called `name` (unwrap=True: its underlying run or writer). On a process
        that runs no trackers (not the main one), a tracker that does nothing."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main_process:
            return GeneralTracker()
        started = ", ".join(repr(t.name) for t in self.trackers) or "none (call init_trackers first)"
        raise ValueError(f"get_tracker({name!r}): no such tracker was started; started: {started}.")

    def finish_trackers(self) -> None:
        """Flush and close every started tracker (end_training calls it)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
