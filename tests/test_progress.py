"""accelerator.progress(): a tqdm bar on a terminal, plain lines elsewhere, nothing on other processes."""

from __future__ import annotations

import io

import pytest

from unison import Accelerator
from unison.observing.progress import progress

pytestmark = pytest.mark.usefixtures("fresh_state")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_show_count_rate_time_left_and_the_last_logged_values(capsys):
    accelerator = Accelerator(cpu=True)
    seen = []
    for step in accelerator.progress(range(4), desc="train", interval=0):
        seen.append(step)
        accelerator.log({"loss": 2.0 / (step + 1), "lr": 3e-4})
    assert seen == [0, 1, 2, 3]  # the items, unchanged
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4  # interval 0: a line per step (stderr is no terminal under pytest)
    assert lines[0].startswith("train: 1/4 (25%) | ") and "it/s" in lines[0] and "left" in lines[0]
    assert lines[0].endswith("loss 2, lr 0.0003") and lines[-1].startswith("train: 4/4 (100%)")
    assert lines[-1].endswith("loss 0.5, lr 0.0003")


def test_lines_wait_for_the_interval_but_the_last_step_is_always_shown(capsys):
    accelerator = Accelerator(cpu=True)
    assert list(accelerator.progress(total=50)) == list(range(50))  # total alone counts
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith("50/50 (100%) | ")  # default: every 30 s


def test_a_terminal_gets_a_tqdm_bar_with_the_logged_values_as_postfix():
    pytest.importorskip("tqdm")
    terminal, logged = Terminal(), [{}]
    for _ in progress(range(3), None, "fit", True, lambda: logged[-1], stream=terminal):
        logged.append({"loss": 1.23456})  # what accelerator.log() does: a new dict per call
    text = terminal.getvalue()
    assert "fit" in text and "3/3" in text and "loss=1.235" in text


def test_other_processes_iterate_the_iterable_itself_and_bad_input_is_named():
    loader = [1, 2, 3]
    assert progress(loader, None, None, False, dict) is loader
    with pytest.raises(ValueError, match="needs an iterable or a total=N"):
        progress(None, None, None, True, dict)
    with pytest.raises(ValueError, match=r"interval=-1: seconds between progress lines"):
        progress(loader, None, None, True, dict, interval=-1)
