"""Trackers with Accelerate's API: what log() is given is what the files hold, read back."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from unison import Accelerator
from unison.tracking import GeneralTracker, LoggerType

pytestmark = pytest.mark.usefixtures("fresh_state")


class Recorder(GeneralTracker):
    """A user's own tracker: keeps what it is given."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @property
    def tracker(self) -> list:
        return self.calls

    def start(self) -> None:
        self.calls.append(("start",))

    def store_init_configuration(self, values: dict) -> None:
        self.calls.append(("config", values))

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.calls.append(("log", values, step, kwargs))

    def finish(self) -> None:
        self.calls.append(("finish",))


def test_jsonl_and_csv_hold_what_was_logged(tmp_path):
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with=["jsonl", LoggerType.CSV, recorder])
    accelerator.init_trackers("exp", config={"lr": 0.5, "layers": 4})
    accelerator.log({"loss": torch.tensor(1.25), "lr": 0.5}, step=1)
    accelerator.log({"accuracy": torch.tensor([0.75])}, step=2, log_kwargs={"recorder": {"commit": True}})
    accelerator.log({"note": "done"})
    assert accelerator.get_tracker("recorder", unwrap=True) is recorder.calls
    assert accelerator.get_tracker("jsonl").path == tmp_path / "exp" / "metrics.jsonl"
    assert accelerator.logging_dir == accelerator.project_dir == str(tmp_path)
    accelerator.end_training()

    lines = [json.loads(line) for line in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"config": {"lr": 0.5, "layers": 4}}
    assert [
        (line["step"], line.get("loss"), line.get("accuracy"), line.get("note")) for line in lines[1:]
    ] == [
        (1, 1.25, None, None),
        (2, None, 0.75, None),
        (None, None, None, "done"),
    ]
    assert all(isinstance(line["time"], float) for line in lines[1:])
    with open(tmp_path / "exp" / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(row["step"], row["name"], row["value"]) for row in rows] == [
        ("1", "loss", "1.25"),
        ("1", "lr", "0.5"),
        ("2", "accuracy", "0.75"),
        ("", "note", "done"),
    ]
    assert json.loads((tmp_path / "exp" / "config.json").read_text()) == {"lr": 0.5, "layers": 4}
    assert [call[0] for call in recorder.calls] == ["start", "config", "log", "log", "log", "finish"]
    assert recorder.calls[3] == ("log", {"accuracy": torch.tensor([0.75])}, 2, {"commit": True})
    assert accelerator.trackers == []  # end_training closed them


def test_all_means_every_available_tracker_and_bad_names_fail_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="all")
    every = [LoggerType.JSONL, LoggerType.CSV, LoggerType.TENSORBOARD, LoggerType.MLFLOW]
    assert accelerator.log_with == every
    with pytest.raises(ValueError, match=r"log_with='tensorbored' is not a tracker"):
        Accelerator(cpu=True, log_with="tensorbored")
    with pytest.raises(ValueError, match=r"log_with='aim': unison does not provide this tracker yet"):
        Accelerator(cpu=True, log_with=["jsonl", "aim"])
    no_directory = Accelerator(cpu=True, log_with="jsonl")
    with pytest.raises(ValueError, match=r"has no logging directory: pass project_dir"):
        no_directory.init_trackers("exp")
    accelerator.init_trackers("exp")
    with pytest.raises(ValueError, match=r"a logged value is one number"):
        accelerator.log({"weights": torch.ones(3)})
    with pytest.raises(ValueError, match=r"get_tracker\('wandb'\): no such tracker was started"):
        accelerator.get_tracker("wandb")
    accelerator.end_training()


def test_tensorboard_event_files_hold_the_scalars_text_and_hyperparameters(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="tensorboard")
    accelerator.init_trackers("exp", config={"lr": 0.5, "optimizer": "adamw"})
    for step in range(3):
        accelerator.log({"loss": torch.tensor(2.0 - step), "note": f"step {step}"}, step=step)
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    assert writer.log_dir == str(tmp_path / "exp")
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "exp"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 2.0), (1, 1.0), (2, 0.0)]
    assert "note/text_summary" in events.Tags()["tensors"]
    session = events.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    hparams = plugin_data_pb2.HParamsPluginData.FromString(session).session_start_info.hparams
    assert (hparams["lr"].number_value, hparams["optimizer"].string_value) == (0.5, "adamw")


def test_a_tracker_whose_library_is_missing_names_the_extra(tmp_path, monkeypatch):
    import sys

    for name in ("tensorboard", "mlflow"):
        monkeypatch.setitem(sys.modules, f"unison.tracking.{name}", None)  # as if not installed
        with pytest.raises(ImportError, match=rf"pip install 'unison\[{name}\]'"):
            Accelerator(cpu=True, project_dir=tmp_path, log_with=name)
    assert Accelerator(cpu=True, log_with="all").log_with == [LoggerType.JSONL, LoggerType.CSV]


def test_mlflow_run_holds_the_metrics_tags_and_parameters(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()  # a local store; MLflow 3 asks to opt into the file backend
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    accelerator = Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers(
        "exp", config={"lr": 0.5, "layers": 4}, init_kwargs={"mlflow": {"run_name": "r1"}}
    )
    for step in range(3):
        accelerator.log({"loss": torch.tensor(2.0 - step), "phase": f"epoch {step}"}, step=step)
    run_id = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    accelerator.end_training()
    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [
        (0, 2.0),
        (1, 1.0),
        (2, 0.0),
    ]
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.5", "layers": "4"}
    assert run.data.tags["phase"] == "epoch 2" and run.info.run_name == "r1"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
