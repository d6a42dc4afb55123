"""The same numbers on any number of processes, and losses normalised by the global item count.

tests/workers/fidelity_worker.py trains a tiny GPT on 1, 2 and 4 real processes with the same samples
per optimizer step (num_processes x gradient_accumulation_steps = 4, shuffled loader); these tests
compare the saved parameters across the splits and, for the masked-token loss with num_items, with a
plain-torch single-process reference that averages over all valid tokens of each step at once.
The in-process tests check backward(num_items=...)'s contract: fp16 scaling, refused mixes, bad counts.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from launching import WORKERS, launch_ok
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, GradScalerKwargs

_spec = importlib.util.spec_from_file_location("fidelity_worker", WORKERS / "fidelity_worker.py")
worker = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SPLITS = (1, 2, 4)  # processes; accumulation steps 4, 2, 1


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: intra-op threads only cost here (a reference run takes 15 ms on one
    thread and 1-5 s on two while other processes load the two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[int, Path]:
    """One launch per process count; each writes <run>.pt and <run>.json for its three trainings."""
    out = {}
    for nproc in SPLITS:
        out[nproc] = tmp_path_factory.mktemp(f"fidelity_n{nproc}")
        launch_ok(WORKERS / "fidelity_worker.py", nproc, out[nproc])
    return out


def load(trained: dict[int, Path], run: str) -> tuple[dict[int, dict], dict[int, dict]]:
    states = {n: torch.load(trained[n] / f"{run}.pt", weights_only=True) for n in SPLITS}
    records = {n: json.loads((trained[n] / f"{run}.json").read_text()) for n in SPLITS}
    return states, records


def test_every_split_consumes_the_same_shuffled_samples_per_step(trained):
    for run in ("mean_sgd", "mean_adamw", "items_sgd"):
        _, records = load(trained, run)
        steps = records[1]["step_ids"]
        assert len(steps) == worker.STEPS
        assert all(records[n]["step_ids"] == steps for n in SPLITS), run
        assert sorted(sum(steps, [])) == list(range(worker.STEPS * 8))  # each sample once
        assert steps[0] != list(range(8)), "the loader did not shuffle"


@pytest.mark.parametrize("run, tolerance", [("mean_sgd", 1e-5), ("mean_adamw", 1e-4)])
def test_mean_loss_parameters_agree_across_splits(trained, run, tolerance):
    # measured: SGD 3e-8 (N=2) / 6e-8 (N=4); AdamW 5.2e-5 / 3.3e-5 (Adam amplifies rounding noise)
    states, records = load(trained, run)
    for n in (2, 4):
        assert max_diff(states[n], states[1]) < tolerance, (run, n)
        assert records[n]["grad_norms"] == pytest.approx(records[1]["grad_norms"], rel=1e-4)


def test_num_items_gives_the_global_token_mean_on_every_split(trained):
    """backward(loss_sum, num_items=valid) = one process averaging over all valid tokens of the step."""
    states, records = load(trained, "items_sgd")
    reference, reference_norms = worker.reference_items(records[1]["step_ids"], micro_batch=8)
    # the clip threshold clips some steps and not others, so a wrong gradient scale shows
    assert min(reference_norms) < worker.MAX_NORM < max(reference_norms)
    for n in SPLITS:  # measured: 7.5e-8, 7.8e-8, 8.9e-8
        assert max_diff(states[n], reference) < 1e-5, n
        # clip_grad_norm_ on the sync step saw the normalised gradients
        assert records[n]["grad_norms"] == pytest.approx(reference_norms, rel=1e-5), n


def test_naive_per_micro_batch_mean_depends_on_the_split(trained):
    """The contrast: averaging each micro-batch's own token mean weights short sequences up."""
    _, records = load(trained, "items_sgd")
    steps = records[1]["step_ids"]
    global_mean, _ = worker.reference_items(steps, micro_batch=8)
    global_mean_in_pieces, _ = worker.reference_items(steps, micro_batch=2)
    naive_pieces, _ = worker.reference_items(steps, micro_batch=2, normalisation="per_micro_batch")
    assert max_diff(global_mean_in_pieces, global_mean) < 1e-5
    assert max_diff(naive_pieces, global_mean) > 1e-2  # measured: 0.16


# -- in-process: the contract of backward(num_items=...) --------------------------------------------
FEATURES, CLASSES = 8, 5


def token_batches(micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """8 rows of features and class targets, some targets masked out (IGNORE), in micro-batches."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (8,), generator=generator)
    y[[1, 2, 3, 6]] = worker.IGNORE  # micro-batches of 2 hold 1, 0, 2 and 1 valid rows
    return list(zip(x.split(micro_batch), y.split(micro_batch)))


def summed_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss = nn.functional.cross_entropy(model(x), y, ignore_index=worker.IGNORE, reduction="sum")
    return loss, (y != worker.IGNORE).sum()


def reference_grads(model: nn.Module) -> list[torch.Tensor]:
    """Gradients of the mean over all valid rows, in one plain fp32 backward."""
    reference = nn.Linear(FEATURES, CLASSES).to(next(model.parameters()).device)
    reference.load_state_dict(model.state_dict())
    (x, y), *_ = token_batches(8)
    x, y = x.to(reference.weight.device), y.to(reference.weight.device)
    nn.functional.cross_entropy(reference(x), y, ignore_index=worker.IGNORE).backward()
    return [p.grad for p in reference.parameters()]


@pytest.mark.parametrize(
    "cpu",
    [
        True,
        pytest.param(
            False, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        ),
    ],
)
def test_num_items_with_fp16_keeps_the_loss_scale_until_unscaling(fresh_state, cpu):
    # A summed loss has gradients `items` times a mean's: the default initial scale 2**16 overflows
    # here (the scaler would skip steps and halve it until they fit); start lower, as the docs say.
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision="fp16",
        gradient_accumulation_steps=4,
        kwargs_handlers=[GradScalerKwargs(init_scale=2.0**10)],
    )
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    expected = reference_grads(model)
    scale = accelerator.scaler.get_scale()
    for x, y in token_batches(2):
        with accelerator.accumulate(model):
            accelerator.backward(*summed_loss(model, *accelerator.send_to_device((x, y))))
            if accelerator.sync_gradients:
                scaled = [p.grad.clone() for p in model.parameters()]
                accelerator.clip_grad_norm_(model.parameters(), 1e9)  # unscales
                unscaled = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
    for got_scaled, got, want in zip(scaled, unscaled, expected):
        torch.testing.assert_close(got_scaled / scale, want, rtol=1e-2, atol=1e-4)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-4)
    assert not accelerator.optimizer_step_was_skipped


def test_a_short_last_window_is_divided_by_its_own_items(fresh_state):
    """4 micro-batches with accumulation 3: the loader's end closes a second window of one micro-batch."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = nn.Linear(FEATURES, CLASSES)
    x, y = (torch.cat(parts) for parts in zip(*token_batches(2)))
    model, loader = accelerator.prepare(model, DataLoader(TensorDataset(x, y), batch_size=2))
    windows = []
    for xb, yb in loader:
        with accelerator.accumulate(model):
            accelerator.backward(*summed_loss(model, xb, yb))
            if accelerator.sync_gradients:
                windows.append([p.grad.clone() for p in model.parameters()])
                model.zero_grad()
    assert len(windows) == 2
    for got, rows in zip(windows, (slice(0, 6), slice(6, 8))):
        nn.functional.cross_entropy(model(x[rows]), y[rows], ignore_index=worker.IGNORE).backward()
        for g, p in zip(got, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
        model.zero_grad()


def test_mixing_backward_with_and_without_num_items_in_one_window_is_refused(fresh_state):
    (x0, y0), (x1, y1), *_ = token_batches(2)
    for first, second in ((True, False), (False, True)):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = accelerator.prepare(nn.Linear(FEATURES, CLASSES))
        with accelerator.accumulate(model):
            loss, valid = summed_loss(model, x0, y0)
            accelerator.backward(loss, num_items=valid if first else None)
        grads = [p.grad.clone() for p in model.parameters()]
        with accelerator.accumulate(model), pytest.raises(ValueError, match="same accumulation window"):
            loss, valid = summed_loss(model, x1, y1)
            accelerator.backward(loss, num_items=valid if second else None)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # refused before


def test_each_window_chooses_its_own_normalisation(fresh_state):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = accelerator.prepare(nn.Linear(FEATURES, CLASSES))
    batches = token_batches(2) + token_batches(2)[:2]
    for (x, y), use_items in zip(batches, (True, True, False, False, True, True)):
        with accelerator.accumulate(model):
            loss, valid = summed_loss(model, x, y)
            accelerator.backward(loss, num_items=valid if use_items else None)
            if accelerator.sync_gradients:
                model.zero_grad()


@pytest.mark.parametrize(
    "num_items, error",
    [(-1, ValueError), (float("nan"), ValueError), (True, TypeError), ("3", TypeError),
     (torch.ones(2), ValueError), (torch.tensor(True), ValueError)],
)  # fmt: skip
def test_bad_num_items_are_refused(fresh_state, num_items, error):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Linear(FEATURES, CLASSES))
    loss, _ = summed_loss(model, *token_batches(2)[0])
    with pytest.raises(error, match="num_items"):
        accelerator.backward(loss, num_items=num_items)
    assert all(p.grad is None for p in model.parameters())


def test_a_window_without_items_keeps_zero_gradients(fresh_state):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Linear(FEATURES, CLASSES))
    x, y = token_batches(2)[1]  # both rows masked out
    loss, valid = summed_loss(model, x, y)
    assert valid == 0
    accelerator.backward(loss, num_items=valid)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
