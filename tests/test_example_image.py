"""The image example (examples/image): its data split, then real runs on 2 processes and on one.

The 2-process run is checked against numbers computed here: the accuracy it prints must count each of
the 360 test images once (not the 384 that two processes' padded batches of 64 hold) and must equal a
one-process evaluation of the weights it saved; its metrics file must hold each step once (the main
process's) with the learning rate of a one-cycle schedule stepped once per optimizer step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from launching import REPO_ROOT, launch_ok
from slowness import budget

EXAMPLE = REPO_ROOT / "examples" / "image"
ACCURACY_LINE = re.compile(r"^\[rank0\]: epoch (\d+) \| test accuracy (\d+\.\d\d)% \((\d+) of (\d+)\)", re.M)


def _load(name: str):
    """Import examples/image/NAME.py under a private name (the example is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"image_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


data_lib = _load("data")
model_lib = _load("model")


def test_the_split_is_fixed_disjoint_and_leaves_a_ragged_last_round_of_test_batches():
    train, test = data_lib.load_digits_split(seed=0)
    assert (len(train), len(test)) == (1437, 360)
    again_train, again_test = data_lib.load_digits_split(seed=0)
    assert torch.equal(train.tensors[0], again_train.tensors[0]) and torch.equal(
        test.tensors[1], again_test.tensors[1]
    )
    # together, exactly the 1,797 images of the data set: each in one of the two sets
    from sklearn.datasets import load_digits

    everything = torch.tensor(load_digits().data, dtype=torch.float32) / 16
    both = torch.cat([train.tensors[0], test.tensors[0]]).flatten(1)
    for mine, theirs in zip(
        torch.unique(both, dim=0, return_counts=True), torch.unique(everything, dim=0, return_counts=True)
    ):
        assert torch.equal(mine, theirs)
    assert both.min() == 0 and both.max() == 1
    assert sorted(test.tensors[1].unique().tolist()) == list(range(10))
    assert len(test) % (2 * 64) != 0  # the default eval batches on 2 processes end in a padded round
    with pytest.raises(ValueError, match=r"test_size=1797: .* from 1 to 1796"):
        data_lib.load_digits_split(test_size=1797)


def test_without_scikit_learn_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # what an environment without it imports
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"scikit-learn is not installed.*pip install 'unison\[examples\]'"):
        data_lib.load_digits_split()


def _evaluate_alone(weights_file, channels: int) -> int:
    """Correct predictions of the saved weights on the test set, in this one process, in one batch."""
    model = model_lib.DigitsCNN(channels)
    model.load_state_dict(torch.load(weights_file, weights_only=True))
    _, test = data_lib.load_digits_split(seed=0)
    images, labels = test.tensors
    with torch.no_grad():
        return (model(images).argmax(-1) == labels).sum().item()


def test_two_processes_count_each_test_image_once_and_agree_with_a_one_process_evaluation(tmp_path):
    epochs, channels, lr = 2, 32, 3e-3
    result = launch_ok(
        EXAMPLE / "train.py",
        2,
        *("--epochs", epochs, "--channels", channels, "--lr", lr, "--project-dir", tmp_path),
        timeout=120,
    )
    assert "23 steps per epoch" in result.stdout  # 1,437 images / (32 x 2 processes), rounded up
    lines = ACCURACY_LINE.findall(result.stdout)
    assert [int(epoch) for epoch, *_ in lines] == [1, 2], result.stdout
    assert all(int(counted) == 360 for *_, counted in lines), lines  # not 384: the padding is dropped
    assert result.stdout.count("test accuracy") == 2  # and from the main process alone
    _, accuracy, correct, _ = lines[-1]
    assert int(correct) == _evaluate_alone(tmp_path / "model" / "pytorch_model.bin", channels)
    assert float(accuracy) == pytest.approx(100 * int(correct) / 360, abs=0.005)

    records = [json.loads(line) for line in (tmp_path / "digits" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["config"]["epochs"] == epochs
    steps = [r for r in records[1:] if "loss" in r]
    evals = [r for r in records[1:] if "test_accuracy" in r]
    assert len(records) == 1 + len(steps) + len(evals)
    # each step once: a second process writing too would repeat every step
    assert [r["step"] for r in steps] == list(range(1, 2 * 23 + 1))
    assert all(set(r) == {"step", "time", "loss", "lr"} for r in steps)
    assert [(r["step"], r["epoch"]) for r in evals] == [(23, 1), (46, 2)]
    assert [round(r["test_accuracy"], 2) for r in evals] == [float(a) for _, a, _, _ in lines]
    # the schedule steps once per optimizer step: OneCycleLR over 46 steps, stepped here by hand
    reference = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=lr, total_steps=46)
    expected = []
    for _ in range(46):
        reference.step()
        schedule.step()
        expected.append(schedule.get_last_lr()[0])
    assert [r["lr"] for r in steps] == pytest.approx(expected, rel=1e-6)
    assert steps[-1]["loss"] < steps[0]["loss"] / 2, (steps[0], steps[-1])


def test_resume_from_the_first_epochs_checkpoint_ends_as_the_uninterrupted_run(tmp_path):
    """One process: train 2 epochs, drop the second epoch's checkpoint, resume: epoch 2 again, the same."""
    args = ["--epochs", "2", "--channels", "8", "--project-dir", str(tmp_path)]

    def train(*extra: str) -> str:
        result = subprocess.run(
            [sys.executable, str(EXAMPLE / "train.py"), *args, *extra],
            cwd=REPO_ROOT,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
            },  # as launch() runs it: 2 threads on a busy machine crawl
            capture_output=True,
            text=True,
            timeout=budget(120),
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    first = train("--resume")
    assert f"--resume: no checkpoint in {tmp_path}/checkpoints, starting afresh" in first
    weights = tmp_path / "model" / "pytorch_model.bin"
    first_weights = torch.load(weights, weights_only=True)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_45", "checkpoint_90"]
    shutil.rmtree(checkpoints / "checkpoint_90")

    resumed = train("--resume")
    assert f"resumed from {checkpoints / 'checkpoint_45'} at epoch 1" in resumed
    assert "trained 45 steps (steps 46-90)" in resumed

    def epoch_2(out: str) -> str:
        return next(line for line in out.splitlines() if line.startswith("epoch 2 |")).rsplit(" | ", 1)[0]

    assert epoch_2(resumed) == epoch_2(first)
    for name, tensor in torch.load(weights, weights_only=True).items():
        assert torch.equal(tensor, first_weights[name]), name
    assert "nothing to train: the run is at epoch 2 of --epochs 2" in train("--resume")


def test_train_py_help_shows_every_default_and_a_zero_count_is_refused(monkeypatch, capsys):
    """In-process (a subprocess would spend its time importing torch): train.py's own parse_args()."""
    monkeypatch.setitem(sys.modules, "data", data_lib)  # train.py imports its neighbours by these names
    monkeypatch.setitem(sys.modules, "model", model_lib)
    train_lib = _load("train")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    defaults = vars(train_lib.parse_args())
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        train_lib.parse_args()
    assert stop.value.code == 0
    options = re.split(r"\n  (?=-)", capsys.readouterr().out.split("\noptions:\n", 1)[1])
    assert len(options) == len(defaults) + 1  # and -h, --help
    for option in options[1:]:
        text = " ".join(option.split())  # argparse wraps lines
        name = re.match(r"--([\w-]+)", text).group(1)
        default = defaults[name.replace("-", "_")]
        assert text.endswith(f"(default: {default})") if default is not False else "(default" not in text, (
            text
        )
    monkeypatch.setattr(sys, "argv", ["train.py", "--eval-batch-size", "0"])
    with pytest.raises(SystemExit) as stop:
        train_lib.parse_args()
    assert stop.value.code == 2
    assert "--eval-batch-size 0: a count, so 1 or more" in capsys.readouterr().err
