"""The global batch per optimizer step is training state: a resume on another number of processes keeps it.

Issue 24, item 2: a run saved on 2 processes x accumulation 2 and restarted unchanged on 1 process (an
elastic shrink) kept accumulation 2, so 8 samples per optimizer step instead of 16. Three launches of
workers/global_batch_worker.py (SGD with momentum, so that two correct layouts agree to rounding, and a
StepLR scheduler, whose learning rate tells whether the optimizer steps kept their meaning), each resumed
run against the uninterrupted 2 x 2 run. Before the fix: 2 -> 1 took 21 steps and ended 7.9e-2 away,
1 -> 2 took 8 steps and ended 8.0e-2 away, and 2 x 1 -> 3 resumed silently at 12 samples per step (the
refusal is checked on 1 x 3 -> 2, the same rule on 2 processes: no whole accumulation makes the saved
12 samples of 8-sample micro-steps, and a third process count would cost a fourth launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launching import WORKERS, describe, launch_ok

WORKER = WORKERS / "global_batch_worker.py"
TOLERANCE = 1e-5  # SGD, fp32: layouts of one global batch differ by rounding only (measured 3.0e-8)


def result(out: Path, name: str, rank: int = 0) -> dict:
    return json.loads((out / f"{name}.{rank}.json").read_text())


def distance(a: dict, b: dict) -> float:
    return max(
        (torch.tensor(a["params"][k]) - torch.tensor(v)).abs().max().item() for k, v in b["params"].items()
    )


def test_a_resume_on_another_number_of_processes_keeps_the_global_batch(tmp_path):
    """2 x 2 saved at step 3 (mid-epoch) and restarted on 1 process with the script's accumulation 2 runs
    with 4; 1 x 4 restarted on 2 with the script's 4 runs with 2; a script that asks for a third value (3)
    is overruled by the saved global batch; split_batches keeps the accumulation (the per-process batch
    changes instead). Each takes the uninterrupted run's 12 optimizer steps, ends on its learning rate and
    within 1e-5 of its parameters, and the main process says what it changed in one line. 1 x 3 saved at
    step 6 (72 samples in: 9 micro-steps of 8, so the data position fits) and resumed on 2 processes (12
    samples per step, 8 per micro-step: no whole number of them) is refused on every process, nothing
    applied. Three launches: 1, 2, then 1 process."""
    launch_ok(WORKER, 1, tmp_path, "one:4:-", "one3:3:-")
    one = tmp_path / "one" / "ckpt_3"
    grown = launch_ok(
        WORKER,
        2,
        tmp_path,
        "two:2:-",
        "split:2:-:split",
        f"grown:4:{one}",
        f"told:3:{one}",
        f"refused:2:{tmp_path / 'one3' / 'ckpt_6'}",  # 72 samples: 9 micro-steps of 8
    )
    shrunk = launch_ok(
        WORKER,
        1,
        tmp_path,
        f"shrunk:2:{tmp_path / 'two' / 'ckpt_3'}",
        f"split1:2:{tmp_path / 'split' / 'ckpt_3'}:split",
    )

    reference = result(tmp_path, "two")
    assert reference["steps"] == 12 and reference["accumulation"] == 2
    for name, accumulation in [
        ("one", 4),
        ("split", 2),
        ("grown", 2),
        ("told", 2),
        ("shrunk", 4),
        ("split1", 2),
    ]:
        run = result(tmp_path, name)
        assert (run["accumulation"], run["steps"]) == (accumulation, 12), (
            name,
            run["accumulation"],
            run["steps"],
        )
        assert run["lr"] == reference["lr"], name
        assert distance(run, reference) < TOLERANCE, (name, distance(run, reference))

    said = "saved with world size {} x gradient_accumulation_steps {}, resumed with world size {}: "
    keeps = "gradient_accumulation_steps {} -> {} keeps its 16 samples per optimizer step"
    assert said.format(2, 2, 1) + keeps.format(2, 4) in shrunk.stderr, describe(shrunk)
    assert said.format(1, 4, 2) + keeps.format(4, 2) in grown.stderr, describe(grown)
    assert said.format(1, 4, 2) + keeps.format(3, 2) in grown.stderr, describe(grown)
    assert "gradient_accumulation_steps 2 -> 2" not in shrunk.stderr  # split1: nothing changed, nothing said
    assert "[rank1]: checkpoint" not in grown.stderr  # the main process alone says it

    for rank in range(2):
        refused = result(tmp_path, "refused", rank)
        assert refused.get("refused", "").startswith("CheckpointError: "), (rank, refused)
        assert "12 samples per optimizer step" in refused["refused"], refused
        assert "8 samples per micro-step" in refused["refused"], refused
        assert "Resume on 1 or 3 processes" in refused["refused"], refused
        assert refused["untouched"], f"process {rank} changed the model before the checkpoint was refused"


@pytest.mark.usefixtures("fresh_state")
def test_the_training_loader_is_the_one_iterated_at_the_save(tmp_path, caplog):
    """One process, a training loader (batch 2) and an evaluation loader (batch 4). Saved inside the loop
    over the training loader, a resume whose evaluation batch changed keeps the accumulation and one whose
    training batch halved doubles it, saying so. Saved outside any loop, a resume whose two loaders
    changed differently cannot tell which batch is the global one: refused, nothing applied."""
    from torch.utils.data import DataLoader, TensorDataset

    from unison import Accelerator, AcceleratorState, CheckpointError, GradientState, PartialState

    def prepared(train_batch: int = 2, eval_batch: int = 4):
        for state in (PartialState, AcceleratorState, GradientState):
            state._reset_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = torch.nn.Linear(2, 1)
        data = TensorDataset(torch.ones(16, 2))
        parts = (DataLoader(data, batch_size=train_batch), DataLoader(data, batch_size=eval_batch))
        return accelerator, *accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), *parts)

    accelerator, model, optimizer, train, _ = prepared()
    for _ in train:  # 4 optimizer steps of 2 micro-batches of 2
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(1, 2)).sum())
            optimizer.step()
        if accelerator.sync_gradients and accelerator.optimizer_steps == 1:
            inside = accelerator.save_state(tmp_path / "inside")
    outside = accelerator.save_state(tmp_path / "outside")

    accelerator, *_ = prepared(eval_batch=8)
    accelerator.load_state(inside)
    assert accelerator.gradient_accumulation_steps == 2
    with caplog.at_level("WARNING", logger="unison"):
        accelerator, *_ = prepared(train_batch=1)
        accelerator.load_state(inside)
    assert accelerator.gradient_accumulation_steps == 4
    assert "gradient_accumulation_steps 2 -> 4 keeps its 4 samples per optimizer step" in caplog.text

    accelerator, model, *_ = prepared(train_batch=1, eval_batch=8)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match="changed their batch sizes differently"):
        accelerator.load_state(outside)
    assert torch.equal(model.weight, before) and accelerator.gradient_accumulation_steps == 2
