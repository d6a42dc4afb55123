"""MLflow, with Accelerate's MLflowTracker arguments: the run goes to the experiment named after the
project, on the tracking server or store that MLflow itself is configured with (MLFLOW_TRACKING_URI);
numbers are metrics, strings tags (their latest value), the configuration parameters. Needs the
`mlflow` package (mlflow-skinny is enough): `pip install 'unison[mlflow]'`."""

from __future__ import annotations

import os
from typing import Any

import mlflow

from .base import GeneralTracker, on_host

_PARAMS_PER_CALL = 100  # MLflow's limit for one log_params call
_PARAM_VALUE_LENGTH = 6000  # and for one value


class MLflowTracker(GeneralTracker):
    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
    ):
        """logging_dir: where the experiment's artifacts go when it is created (MLflow's default else)."""
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.artifact_location = None if logging_dir is None else os.fspath(logging_dir)
        self.run_options = {
            "run_id": run_id,
            "tags": tags,
            "nested": nested_run,
            "run_name": run_name,
            "description": description,
        }
        self.active_run: mlflow.ActiveRun | None = None

    def start(self) -> None:
        found = mlflow.get_experiment_by_name(self.experiment_name)
        experiment_id = (
            found.experiment_id
            if found is not None
            else mlflow.create_experiment(self.experiment_name, artifact_location=self.artifact_location)
        )
        self.active_run = mlflow.start_run(experiment_id=experiment_id, **self.run_options)

    @property
    def tracker(self) -> mlflow.ActiveRun | None:
        return self.active_run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        params = [(name, str(value)[:_PARAM_VALUE_LENGTH]) for name, value in values.items()]
        for start in range(0, len(params), _PARAMS_PER_CALL):
            mlflow.log_params(dict(params[start : start + _PARAMS_PER_CALL]))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        values = on_host(values)
        texts = {name: value for name, value in values.items() if isinstance(value, str)}
        numbers = {name: float(value) for name, value in values.items() if name not in texts}
        if numbers:
            mlflow.log_metrics(numbers, step=step, **kwargs)
        if texts:
            mlflow.set_tags(texts)

    def finish(self) -> None:
        if self.active_run is not None:
            mlflow.end_run()
            self.active_run = None
