"""Trackers with Accelerate's API: what log() is given is what the files hold, read back."""

from __future__ import annotations

import csv
import json
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch

from unison import Accelerator
from unison.observing.tracking import GeneralTracker, LoggerType

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


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B as a machine without network runs it: offline, its run directory and its own files
    (settings, logs) under tmp_path, nothing printed, no console capture (it would wrap pytest's)."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": tmp_path,
        "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
        "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
    }.items():
        monkeypatch.setenv(name, str(value))
    yield
    if "wandb" in sys.modules:  # wandb reads these once per process: the next test's are read afresh
        sys.modules["wandb"].teardown()


def test_all_means_every_available_tracker_and_bad_names_fail_before_the_run(
    tmp_path, monkeypatch, wandb_offline
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with="all")
    every = [LoggerType.JSONL, LoggerType.CSV, LoggerType.TENSORBOARD, LoggerType.MLFLOW, LoggerType.WANDB]
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
    with pytest.raises(ValueError, match=r"get_tracker\('aim'\): no such tracker was started"):
        accelerator.get_tracker("aim")
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
    assert len(list((tmp_path / "exp").iterdir())) == 1  # one event file: one writer, one run


def test_a_tracker_whose_library_is_missing_names_the_extra(tmp_path, monkeypatch):
    for name in ("tensorboard", "mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, f"unison.observing.tracking.{name}", None)  # as if not installed
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


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (`run-<id>.wandb`), in order.

    wandb 0.31 ships no Python reader of this file (wandb-core, in Go, reads it for `wandb sync`), so
    this reads its framing itself: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB's log
    format (32 KiB blocks; each chunk: CRC-32 over its type byte and data, length, type FULL/FIRST/
    MIDDLE/LAST). Each record is a protobuf from wandb.proto.wandb_internal_pb2, the package's own
    (internal by name) message definitions: the one private wandb module used here.
    """
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:header] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), data[:header]
    records, position, pending = [], header, b""
    while position + header <= len(data):
        if block - position % block < header:  # the rest of a block too short for a chunk: zeros
            position += block - position % block
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, position)
        chunk = data[position + header : position + header + length]
        assert checksum == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"corrupt chunk at {position}"
        position += header + length
        pending += chunk
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def test_wandb_offline_run_holds_the_history_and_config(tmp_path, wandb_offline):
    wandb = pytest.importorskip("wandb")

    def items(entries) -> dict:
        return {e.key or ".".join(e.nested_key): json.loads(e.value_json) for e in entries}

    accelerator = Accelerator(cpu=True, log_with="wandb")
    accelerator.init_trackers(
        "exp",
        config={"lr": 0.5, "layers": 4},
        init_kwargs={"wandb": {"name": "r1", "tags": ["smoke"], "config": {"lr": 0.1}}},
    )
    for step in range(3):
        accelerator.log({"loss": torch.tensor(2.0 - step), "phase": f"epoch {step}"}, step=step)
    # No step: W&B adds to the open row (step 2); commit=True (run.log's) closes it, so lr starts step 3.
    accelerator.log({"accuracy": 0.75}, log_kwargs={"wandb": {"commit": True}})
    accelerator.log({"lr": 0.25})
    run = accelerator.get_tracker("wandb", unwrap=True)
    assert (run.project, run.name, run.tags) == ("exp", "r1", ("smoke",))
    directory = Path(run.dir).parent
    accelerator.end_training()
    assert accelerator.trackers == []
    # Offline, run.finish() returns before wandb-core has written the log (seen with 0.31: no file yet,
    # about 1 run in 10 on a loaded machine); teardown waits for wandb-core to finish every run.
    wandb.teardown()

    [log] = directory.glob("run-*.wandb")
    assert directory.parent == tmp_path / "wandb" and log.name == f"run-{run.id}.wandb"
    records = wandb_records(log)
    kinds = [record.WhichOneof("record_type") for record in records]
    [started] = [record.run for record in records if record.HasField("run")]
    assert (started.project, started.display_name, list(started.tags)) == ("exp", "r1", ["smoke"])
    config = items(started.config.update)  # wandb.init's config=, then what init_trackers stored
    for record in records:
        if record.HasField("config"):
            config.update(items(record.config.update))
    assert {key: config[key] for key in ("lr", "layers")} == {"lr": 0.5, "layers": 4}
    rows = [items(record.history.item) for record in records if record.HasField("history")]
    assert [{k: v for k, v in row.items() if not k.startswith("_") or k == "_step"} for row in rows] == [
        {"_step": 0, "loss": 2.0, "phase": "epoch 0"},
        {"_step": 1, "loss": 1.0, "phase": "epoch 1"},
        {"_step": 2, "loss": 0.0, "phase": "epoch 2", "accuracy": 0.75},
        {"_step": 3, "lr": 0.25},
    ]
    assert kinds[-1] == "exit"  # finish() closed the run
