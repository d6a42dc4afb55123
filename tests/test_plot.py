"""`unison plot` and observing.plotting: runs logged by the real jsonl tracker, drawn, and the PNG read back
to check that each run's curve is drawn, in its colour, where its values are."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from launching import REPO_ROOT
from slowness import budget

from unison.commands.main import main
from unison.observing import plotting
from unison.observing.tracking import JSONLinesTracker

image = pytest.importorskip("matplotlib.image")
colors = pytest.importorskip("matplotlib.colors")

STEPS = list(range(0, 41, 4))


def log_run(project_dir: Path, losses: list[float], val_every: int = 8, run_name: str = "gpt") -> Path:
    """A run as the GPT example logs it: a config line, loss/lr at each step, val_loss every val_every."""
    tracker = JSONLinesTracker(run_name, project_dir)
    tracker.start()
    tracker.store_init_configuration({"lr": 3e-3, "note": "text"})
    for step, loss in zip(STEPS, losses):
        tracker.log({"loss": loss, "lr": 1e-3, "phase": "train"}, step=step)
        if step % val_every == 0:
            tracker.log({"val_loss": loss + 0.25}, step=step)
    tracker.finish()
    return tracker.path


def ddp_and_zero3(tmp_path: Path) -> list[plotting.Run]:
    log_run(tmp_path / "ddp", [4.0 - 0.05 * step for step in STEPS])
    log_run(tmp_path / "zero3", [3.0 + 0.02 * step for step in STEPS])
    return plotting.load_runs([tmp_path / "ddp", tmp_path / "zero3"])


def colour_near(pixels: np.ndarray, x: float, y: float, rgb: tuple[float, ...], reach: int = 2) -> bool:
    """Whether a pixel within `reach` of display point (x, y) (origin bottom left) has colour `rgb`."""
    row, column = round(pixels.shape[0] - y), round(x)
    patch = pixels[row - reach : row + reach + 1, column - reach : column + reach + 1, :3]
    return bool((np.abs(patch - np.array(rgb)).max(axis=-1) < 0.12).any())


def test_two_runs_are_overlaid_each_curve_drawn_in_its_colour_where_its_values_are(tmp_path):
    runs = ddp_and_zero3(tmp_path)
    # same folder name "gpt" under two project dirs: named by both, so the legend tells them apart
    assert [run.name for run in runs] == ["ddp/gpt", "zero3/gpt"]
    assert plotting.choose_metrics(runs, None) == ["loss", "lr", "val_loss"]  # no step/time/text
    metrics = ["loss", "val_loss"]
    figure = plotting.figure(runs, metrics)
    out = tmp_path / "plot.png"
    figure.savefig(out)  # as draw() does; drawing fixes the layout the checks below read
    pixels = image.imread(out)
    assert pixels.shape[:2] == (figure.bbox.height, figure.bbox.width)
    for ax, metric in zip(figure.axes, metrics):
        assert ax.get_ylabel() == metric
        for index, run in enumerate(runs):
            rgb = colors.to_rgb(f"C{index}")
            steps, values = run.curve(metric)
            assert steps == (STEPS if metric == "loss" else [0, 8, 16, 24, 32, 40])
            # the middle of every segment between two logged points is drawn in the run's colour
            points = ax.transData.transform(np.column_stack([steps, values]))
            middles = (points[1:] + points[:-1]) / 2
            assert all(colour_near(pixels, x, y, rgb) for x, y in middles), (metric, run.name)
            # and a point of the other run's curve is not (they cross once, away from these points)
            other = runs[1 - index].curve(metric)
            far = ax.transData.transform([[other[0][1], other[1][1]]])[0]
            assert not colour_near(pixels, *far, rgb, reach=1), (metric, run.name)
    legend = figure.axes[0].get_legend()
    assert [text.get_text() for text in legend.get_texts()] == ["ddp/gpt", "zero3/gpt"]

    written = plotting.draw(runs, ["loss"], tmp_path / "sub" / "loss.png")
    assert written == tmp_path / "sub" / "loss.png" and image.imread(written).std() > 0.05  # not blank


def test_reading_skips_config_and_text_keeps_a_re_logged_steps_last_value_and_a_cut_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"config": {"lr": 1}},
        {"step": 1, "time": 5.0, "loss": 3.0, "tag": "a", "ok": True},
        {"step": 2, "time": 6.0, "loss": 2.0},
        {"step": 2, "time": 9.0, "loss": 2.5},  # a resumed run logged step 2 again: this one counts
        {"time": 10.0, "loss": 1.5},  # no step: after the previous line's
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 4, "lo')
    run = plotting.read_run(path)
    assert run.name == tmp_path.name and list(run.series) == ["loss"]
    assert run.curve("loss") == ([1, 2, 3], [3.0, 2.5, 1.5])
    path.write_text(path.read_text() + "\n" + json.dumps({"step": 5, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:6 is not a JSON line"):
        plotting.read_run(path)


def test_bad_input_says_what_is_wrong_and_what_exists(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"missing does not exist: give a metrics.jsonl file"):
        plotting.load_runs([tmp_path / "missing"])
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(
        FileNotFoundError, match=r"holds no metrics.jsonl, neither directly nor in a subfolder"
    ):
        plotting.load_runs([tmp_path / "empty"])
    runs = ddp_and_zero3(tmp_path)
    with pytest.raises(
        ValueError, match=r"'los' was not logged by ddp/gpt, zero3/gpt \(did you mean 'loss'\?\)"
    ):
        plotting.choose_metrics(runs, ["loss", "los"])
    with pytest.raises(ValueError, match=r"the metrics logged: loss, lr, val_loss\."):
        plotting.choose_metrics(runs, ["accuracy"])
    # without matplotlib (not installed): the error names the extra that installs it
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'unison\[plot\]'"):
        plotting.draw(runs, ["loss"], tmp_path / "never.png")
    assert main(["plot", str(tmp_path / "ddp")]) == 1
    assert not (tmp_path / "ddp" / "plot.png").exists()


def test_cli_plots_a_project_folder_of_two_runs_and_refuses_an_unknown_metric(tmp_path):
    log_run(tmp_path / "project", [4.0 - 0.05 * step for step in STEPS], run_name="ddp")
    log_run(tmp_path / "project", [3.0 + 0.02 * step for step in STEPS], run_name="zero3")

    def plot(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "unison", "plot", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=budget(120),
        )

    project = tmp_path / "project"
    result = plot(str(project), "--metric", "val_loss")
    assert result.returncode == 0, result.stderr
    # a folder of two runs: both plotted, and the output says which were found and where it wrote
    assert f"runs found: {project / 'ddp' / 'metrics.jsonl'}, {project / 'zero3' / 'metrics.jsonl'}" in (
        result.stdout
    )
    assert f"wrote {project / 'plot.png'}: val_loss of ddp, zero3" in result.stdout
    assert image.imread(project / "plot.png").shape[2] == 4

    result = plot(str(project / "ddp" / "metrics.jsonl"), "--metric", "loss", "--metric", "accuracy")
    assert result.returncode == 1 and result.stdout == ""
    assert "unison plot: error: metric 'accuracy' was not logged by ddp; the metrics logged: loss, lr," in (
        result.stderr
    )
    with tempfile.TemporaryDirectory() as empty:
        result = plot(empty)
        assert result.returncode == 1 and "holds no metrics.jsonl" in result.stderr
