"""torch.compile at prepare() (unison.parallel.compiling): each block compiled in place, every layout.

One launch of tests/workers/compile_worker.py on 2 processes trains a tiny GPT eager and compiled with the
"aot_eager" backend under DDP, ZeRO-1/2/3, TP 2, PP 2, bf16 with checkpointed blocks, and a model without
blocks;
the checks below read its report. The single process, the argument checks and the launch flags are
tested in-process.

Tolerance: aot_eager runs the very aten kernels eager runs, in the same order, so compiled and eager
parameters are expected bit-identical (measured: 0.0 in every run, fp32 and bf16); 1e-6 leaves room for
a torch that reorders a reduction, and is still far below what a wrong gradient (~1e-2 after 3 SGD steps
at lr 0.5) would give.
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import WORKERS, launch_ok
from tiny_gpt import make_optimizer, make_tiny_gpt

from unison import Accelerator
from unison.launching.options import LaunchError, LaunchOptions, compile_variables
from unison.utils import TorchDynamoPlugin

TOLERANCE = 1e-6
NPROC = 2
RUNS = {  # run of the worker: the modules compiled, block calls per run (3 steps x 2 blocks, x 2 micro-steps)
    "ddp_acc2": (["transformer.h.0", "transformer.h.1"], 12),
    "ddp_static_graph": (["transformer.h.0", "transformer.h.1"], 6),
    "zero1": (["transformer.h.0", "transformer.h.1"], 6),
    "zero2": (["transformer.h.0", "transformer.h.1"], 6),
    "zero3": (["transformer.h.0", "transformer.h.1"], 6),
    "tp2": (["model.layers.0", "model.layers.1"], 6),
    "zero3_bf16_checkpointed": (["transformer.h.0", "transformer.h.1"], 6),
    "pp2": (["transformer.h.0"], None),  # process 0's stage holds block 0; its calls depend on the schedule
    "ddp_no_blocks": ([""], 3),  # the whole model: its forward, once a step
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "report.json"
    launch_ok(WORKERS / "compile_worker.py", NPROC, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("run", list(RUNS))
def test_compiled_blocks_train_to_the_eager_parameters_in_every_layout(report, run):
    result = report["runs"][run]
    units, calls = RUNS[run]
    assert result["max_abs_diff"] <= TOLERANCE, result
    assert result["compiled_units"] == units, result
    assert result["calls_compiled"] == calls or (calls is None and result["calls_compiled"] >= 6), result
    assert result["eager_calls_compiled"] == 0, result


@pytest.mark.parametrize("run", list(RUNS))
def test_the_prepared_model_keeps_the_users_class_and_names(report, run):
    """unwrap_model gives the user's module (FSDP2's subclass of it under ZeRO-2/3); no key, no byte of a
    save_state checkpoint says _orig_mod; the checkpoint loads strictly into the eager model."""
    result = report["runs"][run]
    classes = {"ddp_no_blocks": "MLP", "tp2": "LlamaForCausalLM", "pp2": "PipelineModel"}  # PP: the stages
    user_class = classes.get(run, "GPT")
    assert user_class in result["unwrapped_class_mro"], result
    assert not result["orig_mod_in_keys"] and not result["orig_mod_in_files"], result
    assert result["files"] > 0 and result["checkpoint_roundtrip_diff"] == 0.0, result


def _train(accelerator: Accelerator, steps: int = 3) -> torch.nn.Module:
    model = make_tiny_gpt(1, 16)
    model, optimizer = accelerator.prepare(model, make_optimizer("sgd", model.parameters()))
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, 32, (4, 17), generator=generator)
        accelerator.backward(model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())[1])
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_one_process_compiles_each_block_in_place(fresh_state):
    eager = _train(Accelerator(cpu=True))
    accelerator = Accelerator(cpu=True, dynamo_backend="aot_eager")
    compiled = _train(accelerator)
    assert accelerator.unwrap_model(compiled) is compiled  # nothing wraps it: the user's GPT itself
    compiled_units = [n for n, m in compiled.named_modules() if m._compiled_call_impl is not None]
    assert compiled_units == ["transformer.h.0", "transformer.h.1"]
    eager_state, compiled_state = eager.state_dict(), compiled.state_dict()
    assert list(compiled_state) == list(eager_state)
    assert max((eager_state[k] - compiled_state[k]).abs().max().item() for k in eager_state) <= TOLERANCE


def test_a_model_compiled_whole_trains_under_mixed_precision(fresh_state):
    """bf16 autocast enters and leaves through the prepared model's hooks; compiled whole (Accelerate's
    default, and torch.compile of the prepared model) dynamo traced them, and the first forward failed
    with "'autocast' object has no attribute 'prev'" (found on an H100, 2026-11-26)."""
    eager = _train(Accelerator(cpu=True, mixed_precision="bf16")).state_dict()
    whole = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=False)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", dynamo_plugin=whole)
    compiled = _train(accelerator)
    assert compiled._compiled_call_impl is not None  # the whole model, not its blocks
    by_the_user = torch.compile(Accelerator(cpu=True, mixed_precision="bf16").prepare(make_tiny_gpt(1, 16)))
    assert by_the_user(torch.zeros(2, 16, dtype=torch.long))[0].dtype == torch.float32  # left autocast
    assert max((eager[k] - v).abs().max().item() for k, v in compiled.state_dict().items()) <= 1e-3


def test_backend_names_are_checked_before_any_work(fresh_state, monkeypatch):
    with pytest.raises(ValueError, match=r"dynamo_backend='inductr'.*'inductor'"):
        Accelerator(cpu=True, dynamo_backend="inductr")
    with pytest.raises(TypeError, match="backend name"):
        Accelerator(cpu=True, dynamo_backend=3)
    with pytest.raises(ValueError, match="both given"):
        Accelerator(cpu=True, dynamo_backend="inductor", dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    with pytest.raises(ValueError, match="mode='fast'"):
        TorchDynamoPlugin(backend="inductor", mode="fast")
    assert Accelerator(cpu=True, dynamo_backend="no").dynamo_plugin is None  # Accelerate's "off"
    assert Accelerator(cpu=True).dynamo_plugin is None
    assert TorchDynamoPlugin(backend="INDUCTOR").backend == "inductor"  # Accelerate's enum is upper case
    assert (
        Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="inductor", disable=True)).dynamo_plugin
        is None
    )
    monkeypatch.setenv("UNISON_DYNAMO_BACKEND", "aot_eager")  # what --dynamo-backend exports
    monkeypatch.setenv("UNISON_DYNAMO_MODE", "max-autotune")
    plugin = Accelerator(cpu=True).dynamo_plugin
    assert (plugin.backend, plugin.mode) == ("aot_eager", "max-autotune")


def test_a_model_compiled_by_the_user_is_not_compiled_again(fresh_state):
    model = make_tiny_gpt(1, 16)
    model.compile(backend="aot_eager")
    with pytest.raises(ValueError, match="already compiled"):
        Accelerator(cpu=True, dynamo_backend="aot_eager").prepare(model)


def test_launch_flags_export_the_backend_and_refuse_a_wrong_one(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    options = LaunchOptions(script=str(script), dynamo_backend="Inductor", dynamo_mode="max-autotune")
    assert compile_variables(options) == {
        "UNISON_DYNAMO_BACKEND": "inductor",
        "UNISON_DYNAMO_MODE": "max-autotune",
    }
    with pytest.raises(LaunchError, match="--dynamo-backend.*'inductr'"):
        compile_variables(LaunchOptions(script=str(script), dynamo_backend="inductr"))
