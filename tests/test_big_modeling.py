"""Models bigger than one device: built on the meta device, materialised shard by shard at prepare().

In one process: init_empty_weights, the model's own init on a meta-built model, what it refuses. In two
launched processes (tests/workers/meta_worker.py): ZeRO-3, TP 2, PP 2 and DDP train a meta-built model
to the parameters of the same model built normally, and each rank's peak memory stays near its shard;
the model's own init, replayed, gives the very parameters of the model built normally in one process,
at 2 and at 4 processes.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from launching import WORKERS, launch_ok

from unison import Accelerator, init_empty_weights
from unison.parallel.materialize import _ALL_META, _NO_META, _SOME_META, _source

# In-process tests build their own Accelerator: each starts from no process state (conftest).
pytestmark = pytest.mark.usefixtures("fresh_state")


class Scaled(torch.nn.Module):
    """A Linear, a LayerNorm, a parameter no reset_parameters covers, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x) @ self.mask) * self.scale


class WithInit(Scaled):
    def init_weights(self) -> None:  # torchtitan's convention: the whole model's init, buffers too
        torch.nn.init.normal_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)
        self.norm.reset_parameters()
        self.scale.fill_(2.0)
        self.mask.copy_(torch.tril(torch.ones(4, 4)))


def test_init_empty_weights_builds_on_meta_and_refuses_real_buffers():
    with init_empty_weights():
        model = Scaled()
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with pytest.raises(ValueError, match="include_buffers=False"):
        with init_empty_weights(include_buffers=False):
            pass


def test_one_process_runs_the_models_own_init_and_keeps_ties_and_the_optimizer():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    with init_empty_weights():
        model = WithInit()
        tied = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    tied[1].weight = tied[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(model.scale, torch.full((4,), 2.0))
    assert torch.equal(model.mask, torch.tril(torch.ones(4, 4)))
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    tied = accelerator.prepare(tied)
    assert tied[1].weight is tied[0].weight and torch.isfinite(tied[0].weight).all()


def plain_model(keep_first: bool = True) -> torch.nn.Module:
    """Modules whose own reset_parameters() is the whole init, and a tied weight: the first module's
    (kept_first), or the last one's as GPT ties them (the first tensor built is then dropped)."""
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 10)
    )
    if keep_first:
        model[3].weight = model[0].weight
    else:
        model[0].weight = model[3].weight
    return model


def test_the_replayed_init_is_the_normal_builds_and_leaves_the_generator_where_it_was():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(3)
    expected = plain_model().state_dict()
    torch.manual_seed(3)
    with init_empty_weights():
        model = plain_model()
    torch.manual_seed(4)  # the script's generator, elsewhere by prepare(): the init starts where it was
    before = torch.get_rng_state()
    model = accelerator.prepare(model)
    assert torch.equal(torch.get_rng_state(), before)
    assert model[3].weight is model[0].weight
    assert not any(vars(p) for p in model.parameters())  # init_empty_weights()'s notes are dropped
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_models_built_one_after_the_other_in_one_block_start_where_the_previous_init_ended(caplog):
    accelerator = Accelerator(cpu=True)
    for keep_first in (True, False):
        torch.manual_seed(5)
        expected = [plain_model(keep_first).state_dict() for _ in range(2)]
        torch.manual_seed(5)
        with init_empty_weights():  # no seed between: each starts where the previous one's init ended
            models = [plain_model(keep_first) for _ in range(2)]
        with caplog.at_level(logging.WARNING, logger="unison"):
            first, second = accelerator.prepare(models[0]), accelerator.prepare(models[1])
        assert not caplog.text, caplog.text
        for model, reference in ((first, expected[0]), (second, expected[1])):
            for name, tensor in model.state_dict().items():
                assert torch.equal(tensor, reference[name]), (keep_first, name)
    torch.manual_seed(5)
    with init_empty_weights():
        models = [plain_model() for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="unison"):
        accelerator.prepare(models[1])  # before the model built ahead of it: where it starts is unknown
    assert "prepare the models in the order they were built" in caplog.text, caplog.text


class BuiltOutOfOrder(torch.nn.Module):
    """`body` is built before `head` but registered after it: its init draws first."""

    def __init__(self) -> None:
        super().__init__()
        body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
        self.head = torch.nn.Embedding(10, 8)
        self.body = body


def test_the_replay_follows_the_order_modules_were_built_in_not_registered_in():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(6)
    expected = BuiltOutOfOrder().state_dict()
    torch.manual_seed(6)
    with init_empty_weights():
        model = BuiltOutOfOrder()
    for name, tensor in accelerator.prepare(model).state_dict().items():
        assert torch.equal(tensor, expected[name]), name


class NewStorage(torch.nn.Module):
    """An init that gives its parameter new storage (`weight.data = ...`) instead of filling it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.weight = torch.nn.Parameter(torch.empty(4, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.weight.data = torch.randn(4, 4)


def test_an_init_that_replaces_a_parameters_storage_gives_the_normal_builds_values():
    accelerator = Accelerator(cpu=True)  # one process: the replay runs in place, on the model's own tensors
    torch.manual_seed(7)
    expected = NewStorage().state_dict()
    torch.manual_seed(7)
    with init_empty_weights():
        model = NewStorage()
    for name, tensor in accelerator.prepare(model).state_dict().items():
        assert torch.equal(tensor, expected[name]), name


class ResetsItsChild(torch.nn.Module):
    """An init that reaches another module's tensors: not replayable one module at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.linear.weight)


def test_an_init_that_cannot_be_replayed_runs_on_the_shards_with_a_warning(caplog):
    accelerator = Accelerator(cpu=True)
    for build, why in (
        (ResetsItsChild, "reaches other modules' tensors"),
        (WithInit, "its own init_weights()"),
    ):
        with init_empty_weights():
            model = build()
        with caplog.at_level(logging.WARNING, logger="unison"):
            model = accelerator.prepare(model)
        assert why in caplog.text and "depend on the layout" in caplog.text, caplog.text
        assert all(torch.isfinite(p).all() for p in model.parameters())
        caplog.clear()


def test_a_tensor_no_init_reaches_is_refused_by_name_and_real_buffers_are_kept():
    accelerator = Accelerator(cpu=True)
    with init_empty_weights():
        model = Scaled()  # `scale` has no reset_parameters, and the model no init_weights
    with pytest.raises(ValueError, match=r"left 2 tensor\(s\) unset: scale, mask"):
        accelerator.prepare(model)
    with init_empty_weights():
        model = Scaled()
    model.scale = torch.nn.Parameter(torch.empty(4, device="meta"))
    model.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)  # built for real: kept
    with pytest.raises(ValueError, match=r"left 1 tensor\(s\) unset: scale$|unset: scale\. "):
        accelerator.prepare(model)


def test_the_source_of_the_values_is_agreed_from_every_process():
    model = Scaled()
    assert _source([_NO_META, _NO_META], model) is None
    assert _source([_ALL_META, _ALL_META], model) == "init"
    assert _source([_NO_META, _ALL_META, _ALL_META], model) == "rank0"
    with pytest.raises(
        ValueError, match=r"some parameters on the meta device and others not \(on process\(es\) \[1\]\)"
    ):
        _source([_NO_META, _SOME_META], model)
    with pytest.raises(ValueError, match=r"real weights on process\(es\) \[1\]"):
        _source([_ALL_META, _NO_META], model)


def test_meta_built_models_train_like_normal_ones_and_hold_their_shard_only(tmp_path):
    out = tmp_path / "report.json"
    # glibc's allocator then maps every allocation of 1 MB or more on its own and unmaps it when freed,
    # so the resident peak follows the live tensors instead of how its heap happened to be reused
    launch_ok(WORKERS / "meta_worker.py", 2, out, env={"MALLOC_MMAP_THRESHOLD_": str(2**20)})
    report = json.loads(out.read_text())
    for layout, run in report["layouts"].items():
        assert run["keys_match"], layout
        assert run["max_abs_diff"] < 1e-6, (layout, run["max_abs_diff"])
        assert run["init_finite"] and run["init_deterministic"] and run["init_differs_from_zero"], layout
        assert run["init_tied_copies_equal"], layout
    assert report["resumed_from_ddp"] == {"zero3": 0.0, "tp_size=2": 0.0, "pp_size=2": 0.0}, report
    memory = report["memory"]
    size = memory["model_bytes"]
    # today's path holds the whole model (and FSDP2's copy of the shard): the measurement sees it
    assert min(memory["built_normally"]) > 0.9 * size, memory
    # built on meta: the shard (half the model) plus what is in flight, on every rank
    assert max(memory["meta_init"]) < 0.75 * size, memory
    assert memory["meta_broadcast"][1] < 0.75 * size, memory  # process 0 holds the weights it sends
    # resuming a DDP checkpoint (model + momentum files, 2x the model) into ZeRO-3: the parameter shards
    # exist before the load; it adds the momentum shards (0.5x) and the zero gradient shards torch's
    # set_optimizer_state_dict steps with (0.5x), and receives the files one tensor at a time. Every
    # process reading both whole files measured 3.07x here.
    assert memory["resume_ddp_into_zero3"][1] < 1.15 * size, memory
    assert memory["resume_max_abs_diff"] == 0.0
    for kind, layouts in report["own_init"].items():  # the tiny GPT, and its plain init
        for layout, run in layouts.items():
            assert run["keys_match"] and run["init"] == 0.0, (kind, layout, run)
            assert run["trained"] < 1e-6, (kind, layout, run)
            # under TP the meta-built embedding's gradient was full size (Replicate): the same numbers
            assert run["grads_not_in_parameter_layout"] == [], (kind, layout, run)
    errors = report["errors"]
    assert all("some parameters on the meta device" in found["partial"] for found in errors), errors
    assert all("real weights on process(es) [1]" in found["real_off_zero"] for found in errors), errors
    assert all("left 1 tensor(s) unset: lm_head.extra." in found["unset_on_one_stage"] for found in errors)


def test_the_models_own_init_is_the_normal_builds_at_four_processes(tmp_path):
    out = tmp_path / "report.json"
    launch_ok(WORKERS / "meta_worker.py", 4, out, "--own-init-only")
    full = json.loads(out.read_text())
    report = full["own_init"]
    assert sorted(report) == ["gpt", "plain"] and all(len(runs) == 4 for runs in report.values()), report
    for kind, layouts in report.items():  # zero3 over 4, tp 2 x dp 2, pp 2 x dp 2, pp 2 x tp 2
        for layout, run in layouts.items():
            assert run["keys_match"] and run["init"] == 0.0, (kind, layout, run)
            assert run["trained"] < 1e-6, (kind, layout, run)
            # materialising must keep TP's gradient layout: a meta-built embedding's gradient was full
            # size (Replicate), and under PP x TP the tied copies' all-reduce then mismatched in size
            assert run["grads_not_in_parameter_layout"] == [], (kind, layout, run)
    from_process_0 = full["from_process_0"]  # pp 2 x tp 2, the weights broadcast from process 0
    assert from_process_0["keys_match"] and from_process_0["max_abs_diff"] < 1e-6, from_process_0
