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


def test_all_means_every_available_tracker_and_bad_names_fail_before_the_run(tmp_path):
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="all")
    assert accelerator.log_with == [LoggerType.JSONL, LoggerType.CSV, LoggerType.TENSORBOARD]
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

    monkeypatch.setitem(sys.modules, "unison.tracking.tensorboard", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'unison\[tensorboard\]'"):
        Accelerator(cpu=True, project_dir=tmp_path, log_with="tensorboard")
    assert Accelerator(cpu=True, log_with="all").log_with == [LoggerType.JSONL, LoggerType.CSV]
