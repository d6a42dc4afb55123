"""numerics="accelerate" / UNISON_NUMERICS=accelerate: Accelerate's numbers where unison deliberately differs
(a short accumulation window, a prepared scheduler on several processes), and the one line unison's
default says the first time each difference changes a number (src/unison/numerics.py).

The loop is tests/workers/numerics_worker.py's nlp_example-style script; each run is compared with a plain
PyTorch loop on one process applying one convention's rules to the same samples.
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import WORKERS, describe, launch, launch_ok
from numerics_worker import order_reference, reference, shuffled_batches, train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator

# AdamW over 39 steps: one process against itself is exact up to summation order; 2 processes (DDP's
# all-reduce) measured 1.9e-7 (2-core CPU VM, 2026-11-26). The references are 3.6e-2 / 0.20 apart.
TOLERANCE = 1e-5


def _kinds(lines: list[str]) -> list[str]:
    kinds = []
    for line in lines:
        assert "UNISON_NUMERICS=accelerate" in line, line
        kinds.append(
            "window" if "accumulation window" in line else "scheduler" if "scheduler" in line else line
        )
    return kinds


def test_the_conventions_differ_visibly():
    """The check below could not pass by accident: the two references are far apart."""
    for num_processes in (1, 2):
        unison_model, unison_lr = reference("unison", num_processes)
        accelerate_model, accelerate_lr = reference("accelerate", num_processes)
        gap = max(
            (p - q).abs().max().item()
            for p, q in zip(unison_model.parameters(), accelerate_model.parameters())
        )
        assert gap > 100 * TOLERANCE, (num_processes, gap)
    assert accelerate_lr == pytest.approx(0.0, abs=1e-12) and unison_lr > 1e-2


def test_one_process_default_and_switch(fresh_state):
    """Default: unison's rules, one line for the short window (once in 3 epochs), none for the scheduler
    on one process. numerics="accelerate": Accelerate's rules, no line."""
    default = train()
    model, lr = reference("unison", 1)
    assert (
        max((p - q).abs().max().item() for p, q in zip(default["model"].parameters(), model.parameters()))
        <= TOLERANCE
    )
    assert default["lr"] == pytest.approx(lr, abs=1e-12)
    assert default["numerics"] == "unison"
    assert _kinds(default["lines"]) == ["window"], default["lines"]
    assert "after 1 of 2 micro-batches" in default["lines"][0]

    chosen = train(numerics="unison")  # a script that chose unison's rules is told nothing
    assert chosen["numerics"] == "unison" and chosen["lines"] == [], chosen["lines"]
    assert "For scripts written for Hugging Face Accelerate: " in default["lines"][0]
    assert "numerics='unison' to keep these and silence this note" in default["lines"][0]

    switched = train(numerics="accelerate")
    model, lr = reference("accelerate", 1)
    assert (
        max((p - q).abs().max().item() for p, q in zip(switched["model"].parameters(), model.parameters()))
        <= TOLERANCE
    )
    assert switched["lr"] == pytest.approx(lr, abs=1e-12)
    assert switched["lines"] == []


def _quiet_loop(batches: int, accumulation: int, caplog) -> list[str]:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    data = TensorDataset(torch.randn(2 * batches, 3), torch.randn(2 * batches, 1))
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=2), scheduler
    )
    caplog.clear()
    for _epoch in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return [r.getMessage() for r in caplog.records if r.name == "unison"]


def test_no_line_when_nothing_differs(fresh_state, caplog):
    """A loader whose length the accumulation divides, or no accumulation, on one process: silent."""
    caplog.set_level("WARNING", logger="unison")
    assert _quiet_loop(batches=4, accumulation=2, caplog=caplog) == []
    assert _quiet_loop(batches=5, accumulation=1, caplog=caplog) == []


@pytest.mark.parametrize("bad", ["acclerate", "Accelerate-1", 1])
def test_a_bad_value_is_refused(fresh_state, bad):
    with pytest.raises(ValueError, match=r"numerics=.*choose 'unison'.*'accelerate'"):
        Accelerator(cpu=True, numerics=bad)


def test_a_bad_variable_is_refused(fresh_state, monkeypatch):
    monkeypatch.setenv("UNISON_NUMERICS", "acelerate")
    with pytest.raises(ValueError, match=r"UNISON_NUMERICS='acelerate'.*export UNISON_NUMERICS=accelerate"):
        Accelerator(cpu=True)


def test_the_argument_wins_over_the_variable_and_says_so(fresh_state, monkeypatch, caplog):
    monkeypatch.setenv("UNISON_NUMERICS", " Accelerate ")
    assert Accelerator(cpu=True).numerics == "accelerate"
    caplog.set_level("WARNING", logger="unison")
    assert Accelerator(cpu=True, numerics="unison").numerics == "unison"
    assert any("overrides UNISON_NUMERICS=accelerate" in r.getMessage() for r in caplog.records)


def test_a_fixed_length_schedule_is_not_overrun_under_accelerate_numbers(fresh_state):
    """Accelerate skips a OneCycleLR step past its total_steps (a short last window adds one); unison's
    default steps it and torch refuses, as before."""
    for numerics, raises in (("accelerate", False), ("unison", True)):
        accelerator = Accelerator(cpu=True, numerics=numerics)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=3)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        steps = 0
        try:
            for steps in range(1, 6):  # noqa: B007 (read after the loop)
                optimizer.step()
                scheduler.step()
        except ValueError as error:
            assert raises and "total steps" in str(error), error
        else:
            assert not raises and scheduler.last_epoch == 3, (numerics, scheduler.last_epoch)
        assert steps == (4 if raises else 5)


def test_two_processes(tmp_path):
    """One launch: `unison launch --numerics accelerate` exports UNISON_NUMERICS=accelerate, under which the
    unchanged script computes Accelerate's numbers (the rate ends at 0); the default (unison's numbers,
    each line once, on rank 0 only); split_batches=True (no scheduler line)."""
    launch_ok(WORKERS / "numerics_worker.py", 2, tmp_path, launch_args=["--numerics", "accelerate"])
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, record in enumerate(ranks):
        assert record["exported"] == "accelerate"
        default, switched = record["default"], record["env_accelerate"]
        assert default["numerics"] == "unison" and switched["numerics"] == "accelerate"
        assert default["distance_to_unison"] <= TOLERANCE < default["distance_to_accelerate"], default
        assert switched["distance_to_accelerate"] <= TOLERANCE < switched["distance_to_unison"], switched
        assert default["lr"] == pytest.approx(default["reference_lr_unison"], abs=1e-12)
        assert switched["lr"] == pytest.approx(switched["reference_lr_accelerate"], abs=1e-12)
        assert switched["lr"] == pytest.approx(0.0, abs=1e-12) and default["lr"] > 1e-2
        assert switched["lines"] == []
        # a shuffled loader: Accelerate's order under the switch, PyTorch's by default (the two differ)
        accelerate_order, torch_order = (
            order_reference("accelerate", 2, rank),
            order_reference("unison", 2, rank),
        )
        assert accelerate_order["batches"] != torch_order["batches"]
        assert record["order_accelerate"] == accelerate_order, (record["order_accelerate"], accelerate_order)
        assert record["order_default"] == torch_order, (record["order_default"], torch_order)
        if rank == 0:
            assert sorted(_kinds(default["lines"])) == ["scheduler", "window"], default["lines"]
            assert _kinds(record["split_batches_lines"]) == ["window"], record["split_batches_lines"]
        else:
            assert default["lines"] == [] and record["split_batches_lines"] == []


def test_one_process_order_is_torch_s_under_both(fresh_state, monkeypatch):
    """On one process Accelerate leaves the shuffle as PyTorch's, so the switch changes no order."""
    assert shuffled_batches() == order_reference("unison", 1, 0)
    monkeypatch.setenv("UNISON_NUMERICS", "accelerate")
    assert shuffled_batches() == order_reference("accelerate", 1, 0) == order_reference("unison", 1, 0)


def test_the_launch_flag_refuses_a_bad_value_before_any_worker_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker started')\n")
    result = launch(script, 1, launch_args=["--numerics", "acclerate"], timeout=60)
    assert result.returncode == 2, describe(result)
    assert "--numerics='acclerate' is not a numerics convention" in result.stderr, describe(result)
    assert "a worker started" not in result.stderr + result.stdout
