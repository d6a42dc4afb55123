"""Pipeline parallelism (unison.parallel.pipeline): fidelity to a single-process reference.

Two launches of tests/workers/pipeline_worker.py: 2 processes (GPipe, 1F1B with 1/2/4 micro-batches,
interleaved 2 ranks x 2 stages, explicit and balanced splits, accumulation, DCP both ways, errors) and
4 processes (pp=4 1F1B; pp=2 x dp=2 with FSDP2 on each stage). The split itself needs no processes:
its stage modules are chained by hand in-process against the plain model.
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
import torch.nn as nn
from launching import WORKERS, launch_ok
from tiny_gpt import gpt_model, make_tiny_gpt

from unison.parallel.blocks import find_blocks
from unison.parallel.pipeline import pipeline_bubble_fraction, split_model

SGD_RUNS = {
    "gpipe_m2_sgd": "ScheduleGPipe",
    "1f1b_m1_sgd": "ScheduleGPipe",  # one micro-batch: naive model parallelism, 1F1B's fill-drain
    "1f1b_m2_sgd": "Schedule1F1B",
    "1f1b_m4_sgd": "Schedule1F1B",
    "1f1b_m2_sgd_acc2": "Schedule1F1B",
    "interleaved_m2_sgd": "ScheduleInterleaved1F1B",
    "split_h3_sgd": "Schedule1F1B",
    "balanced_4layer_sgd": "Schedule1F1B",
}
ADAMW_RUNS = ("1f1b_m4_adamw", "gpipe_m2_adamw_acc2", "interleaved_m4_adamw")


@pytest.fixture(scope="module")
def pp_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline") / "report.json"
    launch_ok(WORKERS / "pipeline_worker.py", 2, out, "pp")
    return json.loads(out.read_text())["ranks"]


@pytest.fixture(scope="module")
def mesh_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_mesh") / "report.json"
    launch_ok(WORKERS / "pipeline_worker.py", 4, out, "mesh")
    return json.loads(out.read_text())["ranks"]


def check_run(ranks: list[dict], name: str, tolerance: float) -> None:
    for rank, runs in enumerate(ranks):
        run = runs[name]
        assert run["max_abs_diff"] < tolerance, (name, rank, run)
        assert run["loss_diff"] < 1e-5, (name, rank, run)  # step() returns the batch loss on every rank
        assert run["grad_norm_diff"] < 1e-5, (name, rank, run)  # norm_parameters count each weight once
        assert run["tied_copies_diff"] == 0.0, (name, rank, run)  # wte and lm_head copies identical
        assert run["eval_loss_diff"] is None or run["eval_loss_diff"] < 1e-5, (name, rank, run)


@pytest.mark.parametrize("name", SGD_RUNS)
def test_sgd_momentum_matches_single_process_reference(pp_report, name):
    check_run(pp_report, name, 1e-5)
    assert {runs[name]["schedule_class"] for runs in pp_report} == {SGD_RUNS[name]}


@pytest.mark.parametrize("name", ADAMW_RUNS)
def test_adamw_matches_single_process_reference(pp_report, name):
    check_run(pp_report, name, 1e-4)


@pytest.mark.parametrize("name", [*SGD_RUNS, *ADAMW_RUNS])
def test_stage_state_dicts_partition_the_full_model_under_original_names(pp_report, name):
    keys = [set(runs[name]["keys"]) for runs in pp_report]
    assert keys[0].isdisjoint(keys[1])
    assert keys[0] | keys[1] == set(pp_report[0][name]["full_keys"])


def test_interleaved_places_stage_s_on_rank_s_mod_pp(pp_report):
    assert [runs["interleaved_m2_sgd"]["stage_indices"] for runs in pp_report] == [[0, 2], [1, 3]]
    assert "transformer.h.2.attn.c_attn.weight" in pp_report[0]["interleaved_m2_sgd"]["keys"]


def test_explicit_split_points_and_parameter_balance(pp_report):
    def blocks(run):
        return sorted({k.split(".")[2] for k in run["keys"] if k.startswith("transformer.h.")})

    assert [blocks(runs["split_h3_sgd"]) for runs in pp_report] == [["0", "1", "2"], ["3"]]
    # the embeddings weigh on stage 0 and the head on stage 1 alike: two blocks each
    assert [blocks(runs["balanced_4layer_sgd"]) for runs in pp_report] == [["0", "1"], ["2", "3"]]


def test_dcp_checkpoints_move_between_pipeline_and_plain_model(pp_report):
    for runs in pp_report:
        assert runs["dcp"]["into_plain"] < 1e-5  # trained under PP, loaded by the plain GPT
        assert runs["dcp"]["into_pp"] == 0.0  # saved by the plain GPT, loaded into the stages


def test_errors_are_raised_on_every_rank_before_work(pp_report):
    for runs in pp_report:
        errors = runs["errors"]
        assert "batch size 7, not divisible into 2 micro-batches" in errors["indivisible"]
        assert (
            "in more than the batch size" in errors["shape_change"]
            and "pad sequences" in errors["shape_change"]
        )
        assert "cannot be called directly" in errors["direct_call"] and "model.step(" in errors["direct_call"]
        assert "microbatches=5 must be a multiple of 2" in errors["interleaved_microbatches"]


def test_pp4_and_pp2_x_fsdp2(mesh_report):
    check_run(mesh_report, "pp4_1f1b_m4_sgd", 1e-5)  # tied weight summed over ranks 0 and 3 only
    assert [runs["pp4_1f1b_m4_sgd"]["stage_indices"] for runs in mesh_report] == [[0], [1], [2], [3]]
    check_run(mesh_report, "pp2_fsdp2_sgd", 1e-5)
    check_run(mesh_report, "pp2_fsdp2_adamw", 1e-4)
    for runs in mesh_report:
        assert "fully_shard" in runs["ddp_refused"]


# --- in-process: the split, chained by hand ---


def make_gpt(n_layer: int) -> nn.Module:
    torch.manual_seed(0)
    config = gpt_model.GPTConfig(block_size=16, vocab_size=32, n_layer=n_layer, n_head=2, n_embd=32)
    return gpt_model.GPT(config)


@pytest.mark.parametrize(
    ("n_layer", "pp_size", "schedule", "split_points"),
    [
        (2, 2, "1f1b", None),
        (4, 2, "interleaved", None),
        (4, 4, "gpipe", None),
        (4, 2, "gpipe", ["transformer.h.3"]),
    ],
)
def test_stages_chained_compute_the_plain_forward_and_backward(n_layer, pp_size, schedule, split_points):
    model = make_gpt(n_layer)
    x = torch.randint(0, 32, (2, 16))
    expected_logits, _ = model(x)
    expected_logits.sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    stages = sorted(
        (
            pair
            for rank in range(pp_size)
            for pair in split_model(model, rank, pp_size, split_points, schedule)
        ),
        key=lambda pair: pair[0],
    )
    activation = ()
    for _, stage in stages:  # every stage gets the model's inputs; the later ones the activations too
        activation = stage(*(activation if isinstance(activation, tuple) else (activation,)), inputs=(x,))
    logits, loss = stages[-1][1].rebuild_output(activation)
    assert loss is None and torch.allclose(logits, expected_logits, atol=1e-6)
    logits.sum().backward()  # the stages are the model's own modules: gradients land on them
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected_grads[name], atol=1e-6), name


def test_stage_modules_are_the_original_modules_under_original_names():
    model = make_tiny_gpt(0, 16)
    ((_, first),) = split_model(model, 0, 2)
    ((_, last),) = split_model(model, 1, 2)
    assert first.transformer.h[0] is model.transformer.h[0]  # real Blocks: TP / fully_shard apply
    assert last.lm_head is model.lm_head
    # blocks keep their names, not their positions: stage 1's list holds block "1" only
    assert isinstance(last.get_submodule("transformer.h.1.attn.c_attn"), nn.Linear)
    assert find_blocks(last)[0] == "transformer.h" and list(find_blocks(last)[1]) == [model.transformer.h[1]]
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())
    assert set(first.tied) == {"transformer.wte.weight"}
    assert set(last.tied) == {"lm_head.weight"} and last.tied["lm_head.weight"].stages == (0, 1)


class ScaledInTraining(nn.Module):
    """A model whose own forward (above its blocks) branches on self.training."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) * (100.0 if self.training else 1.0)


def test_eval_and_train_reach_the_models_own_forward_in_every_stage():
    torch.manual_seed(0)
    model = ScaledInTraining()
    ((_, last),) = split_model(model, 1, 2, ["blocks.1"], "gpipe")
    x = torch.randn(3, 4)
    hidden = model.blocks[0](x).detach()
    last.eval()
    assert torch.allclose(last(hidden, inputs=(x,)), model.eval()(x))
    last.train()
    assert torch.allclose(last(hidden, inputs=(x,)), model.train()(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pp_size=2, split_points=["transformer.h.7"]), "split point 'transformer.h.7' is not a block"),
        (dict(pp_size=2, split_points=["transformer.h.0"]), "always starts stage 0"),
        (dict(pp_size=2, split_points=["transformer.h.1", "transformer.h.1"]), "schedule='interleaved'"),
        (dict(pp_size=3), "3 pipeline stages but the model has 2 blocks"),
        (dict(pp_size=2, schedule="interleaved"), "4 pipeline stages but the model has 2 blocks"),
        (dict(pp_size=2, schedule="interleaved", num_stages=3), "must be a multiple of pp_size"),
        (dict(pp_size=2, num_stages=4), "one stage per rank"),
        (dict(pp_size=2, schedule="zero-bubble"), "'zero-bubble' is unknown"),
        (dict(pp_size=2, pp_rank=2), "pp_rank=2 is outside 0..1"),
    ],
)
def test_split_errors_name_the_value_and_the_fix(kwargs, message):
    kwargs = {"pp_rank": 0, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_model(make_tiny_gpt(0, 16), **kwargs)


def test_split_points_out_of_order_and_models_without_blocks_are_refused():
    with pytest.raises(ValueError, match="not in model order"):
        split_model(make_gpt(4), 0, 3, ["transformer.h.3", "transformer.h.1"], "gpipe")
    with pytest.raises(ValueError, match="no block list"):
        split_model(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 0, 2)


class _ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale):
        return self.fc(x) * scale


class _SharedScale(nn.Module):
    """Computes `scale` from the embedding's output and hands it to every block: a later stage, which
    recomputes what comes before the blocks from the inputs alone, cannot have it."""

    def __init__(self, keyword: bool):
        super().__init__()
        self.keyword = keyword
        self.emb = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([_ScaledBlock() for _ in range(3)])

    def forward(self, x):
        h = self.emb(x)
        scale = h.sigmoid()
        for block in self.blocks:
            h = block(h, scale=scale) if self.keyword else block(h, scale)
        return h


@pytest.mark.parametrize(
    ("keyword", "message"),
    [
        (False, "blocks.2 on pipeline stage 1 gets 'positional argument 1'"),
        (True, "blocks.1 .* gets 'scale'"),
    ],
)
def test_values_computed_from_an_earlier_stages_output_are_refused(keyword, message):
    model = _SharedScale(keyword)
    (_, first), (_, second) = (split_model(model, r, 2, ["blocks.1"], "gpipe")[0] for r in range(2))
    x = torch.ones(2, 4)
    sent = first(inputs=(x,))  # positional: (h, scale) travel; by keyword: h only
    with pytest.raises(ValueError, match=f"{message} computed before the model's blocks"):
        second(*(sent if isinstance(sent, tuple) else (sent,)), inputs=(x,))


class _Guarded(nn.Module):
    """A model whose forward catches Exception around each block (a fallback, as real code has)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            try:
                x = block(x)
            except Exception:  # the point of the test
                x = x * 0  # the fallback must never run: no block fails here
        return x


def test_a_models_own_except_exception_does_not_swallow_the_stage_boundary():
    model = _Guarded()
    x = torch.randn(2, 4)
    expected = model(x)
    (_, first), (_, second) = (split_model(model, r, 2, None, "gpipe")[0] for r in range(2))
    handed_over = first(inputs=(x,))
    assert torch.allclose(handed_over, model.blocks[1](model.blocks[0](x)))  # stage 0 stops at block 2
    assert torch.allclose(second.rebuild_output(second(handed_over, inputs=(x,))), expected)


def test_pipeline_bubble_fraction():
    assert pipeline_bubble_fraction(1, 4) == 0.0
    assert pipeline_bubble_fraction(2, 1) == 0.5
    assert pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_other_stages_weights_are_freed_once_the_model_is_dropped():
    model = make_gpt(4)
    head, last_block = weakref.ref(model.transformer.ln_f.weight), weakref.ref(model.transformer.h[3])
    ((_, first),) = split_model(model, 0, 2)
    del model
    gc.collect()
    # the stage's copy of the model holds containers, not the other stage's pieces
    assert head() is None and last_block() is None
    assert [name for name, _ in first.transformer.h.named_children()] == ["0", "1"]


def test_a_block_wrapped_after_the_split_runs_in_its_place():
    """Activation checkpointing (or compile) after the split replaces a block by name in the stage's list."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = make_gpt(2)
    x = torch.randint(0, 32, (2, 16))
    expected, _ = model(x)
    (_, first), (_, second) = (split_model(model, r, 2)[0] for r in range(2))
    sent = first(inputs=(x,))
    blocks = second.transformer.h
    for name, block in list(blocks.named_children()):
        blocks.register_module(name, checkpoint_wrapper(block))
    logits, _ = second.rebuild_output(second(sent, inputs=(x,)))
    assert torch.allclose(logits, expected, atol=1e-6)
    # indexed by original position
    assert isinstance(second.transformer.h[1], type(blocks.get_submodule("1")))


class _Indexed(nn.Module):
    """Calls its blocks by index, not by iterating the list: a stage cannot run it."""

    def __init__(self, sequential: bool):
        super().__init__()
        self.sequential = sequential
        layers = [nn.Linear(4, 4) for _ in range(4)]
        self.blocks = nn.Sequential(*layers) if sequential else nn.ModuleList(layers)

    def forward(self, x):
        if self.sequential:
            return self.blocks(x)  # nn.Sequential's own forward iterates: fine
        for i in range(len(self.blocks)):
            x = self.blocks[i](x)
        return x


def test_sequential_blocks_run_and_blocks_called_by_index_are_refused():
    x = torch.randn(2, 4)
    model = _Indexed(sequential=True)
    (_, first), (_, second) = (split_model(model, r, 2)[0] for r in range(2))
    assert torch.allclose(second.rebuild_output(second(first(inputs=(x,)), inputs=(x,))), model(x))
    model = _Indexed(sequential=False)
    (_, first), (_, second) = (split_model(model, r, 2)[0] for r in range(2))
    with pytest.raises(RuntimeError, match="must call its blocks by iterating the block list"):
        first(inputs=(x,))  # len(self.blocks) is this stage's count: the loop never reaches block 2
    with pytest.raises(IndexError, match=r"blocks\[0\] is not on this pipeline stage .* iterating its block"):
        second(x, inputs=(x,))
