"""Pipelines (and the built-in tensor-parallel plan, and ZeRO-3) for a Hugging Face decoder:
`transformers.LlamaForCausalLM`, built from a config (no download; transformers is a test extra).

Llama hands the rotary tables, the causal mask and the position ids it computes before its first layer
to every layer by keyword; each pipeline stage recomputes them from its micro-batch's inputs
(unison.parallel.pipeline_split). Two launches of tests/workers/hf_llama_worker.py train it against one
process with SGD+momentum and accumulation: 2 processes (pp_size=2, tp_size=2 with the built-in plan,
zero3) and 4 processes (pp_size=2 x dp_shard_size=2, pp_size=2 x tp_size=2). The in-process tests chain
the stages by hand against the plain model (1F1B, interleaved and 4-stage splits).
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import WORKERS, launch_ok

transformers = pytest.importorskip("transformers")

from hf_llama_worker import make_llama  # noqa: E402  (needs transformers)

from unison.checkpoint.export import export_checkpoint  # noqa: E402
from unison.parallel.pipeline import split_model  # noqa: E402
from unison.parallel.tensor import tensor_parallel_plan  # noqa: E402

LAYOUTS = {
    2: ["pp_size=2", "tp_size=2", "zero3"],
    4: ["pp_size=2,dp_shard_size=2", "pp_size=2,tp_size=2"],
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    found = {}
    for world, layouts in LAYOUTS.items():
        out = tmp_path_factory.mktemp(f"llama{world}") / "report.json"
        launch_ok(WORKERS / "hf_llama_worker.py", world, out, *layouts, timeout=600)
        found.update(json.loads(out.read_text())["layouts"])
        for layout in layouts:  # where the worker saved each run (hf_llama_worker's docstring)
            found[layout]["saved"] = out.parent / layout.replace(",", "+").replace("=", "")
    return found


@pytest.mark.parametrize("layout", [layout for layouts in LAYOUTS.values() for layout in layouts])
def test_llama_trains_to_the_single_process_parameters(reports, layout):
    run = reports[layout]
    assert run["keys_match"] and run["steps"] == 3, run
    assert run["max_abs_diff"] < 1e-5, run  # SGD+momentum, 3 steps, accumulation 2
    assert run["loss_diff"] < 1e-5 and run["eval_loss_diff"] < 1e-5, run
    assert (run["engine"] == "PipelineModel") == ("pp_size" in layout), run


@pytest.mark.parametrize("layout", [layout for layouts in LAYOUTS.values() for layout in layouts])
def test_an_exported_checkpoint_loads_in_transformers_with_the_trained_logits(reports, layout, tmp_path):
    """`unison export` on one process, from each layout's save_state: from_pretrained(OUT_DIR) builds the
    model (config.json written beside the weights), with the logits of the weights the run trained."""
    saved = reports[layout]["saved"]
    result = export_checkpoint(saved / "checkpoint", tmp_path, max_shard_size="200KB")
    # about 0.6 MB of fp32 weights: shards of at most 200 KB and their index, as Hugging Face writes them
    assert result.weights == tmp_path / "model.safetensors.index.json", result
    assert len(set(json.loads(result.weights.read_text())["weight_map"].values())) >= 3
    assert result.config == tmp_path / "config.json"
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(exported).__name__ == "LlamaForCausalLM"
    trained = make_llama()
    trained.load_state_dict(torch.load(saved / "trained.pt"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    untrained = make_llama()
    with torch.no_grad():  # and the run did train: not the weights of a fresh build
        assert not torch.allclose(exported(ids).logits, untrained(ids).logits)


def chained(model, pp_size, schedule, inputs):
    """The stages' forward chained by hand, as the schedule runs them; returns the last stage's output."""
    stages = sorted(
        (pair for rank in range(pp_size) for pair in split_model(model, rank, pp_size, schedule=schedule)),
        key=lambda pair: pair[0],
    )
    sent = ()
    for _, stage in stages:
        sent = stage(*(sent if isinstance(sent, tuple) else (sent,)), inputs=inputs)
    return stages, stages[-1][1].rebuild_output(sent)


@pytest.mark.parametrize(("pp_size", "schedule"), [(2, "1f1b"), (2, "interleaved"), (4, "gpipe")])
def test_stages_chained_compute_llamas_forward_and_backward(pp_size, schedule):
    model = make_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0  # padding: the mask every stage builds must be this micro-batch's
    expected = model(ids, mask).logits
    expected.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    stages, output = chained(model, pp_size, schedule, (ids, mask))
    assert type(output).__name__ == "CausalLMOutputWithPast"
    assert torch.allclose(output.logits, expected, atol=1e-6)
    output.logits.sum().backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name], atol=1e-6), name


def test_llama_stages_hold_their_own_modules_and_the_shared_stateless_ones():
    model = make_llama()
    (_, first), (_, last) = (split_model(model, rank, 2)[0] for rank in range(2))
    assert first.model.layers[0] is model.model.layers[0] and last.lm_head is model.lm_head
    # the rotary embedding holds no state: every stage has it, and recomputes the tables
    assert first.model.rotary_emb is last.model.rotary_emb is model.model.rotary_emb
    # another stage's modules are stand-in functions: not modules of this stage, no state
    assert "model.embed_tokens" not in dict(last.named_modules())
    assert "lm_head" not in dict(first.named_modules()) and "model.norm" not in dict(first.named_modules())
    assert set(first.state_dict()).isdisjoint(last.state_dict())
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())
    # the built-in tensor-parallel plan sees each stage's own modules only
    first_plan, last_plan = tensor_parallel_plan(first), tensor_parallel_plan(last)
    assert "model.embed_tokens" in first_plan and "lm_head" not in first_plan
    assert "lm_head" in last_plan and "model.embed_tokens" not in last_plan


SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4
)
OTHERS = {  # Hugging Face decoders built like Llama, and GPT-2, whose blocks take Nones positionally
    "Mistral": {**SMALL, "num_key_value_heads": 2},
    "Qwen2": {**SMALL, "num_key_value_heads": 2},
    "Gemma2": {**SMALL, "num_key_value_heads": 2, "head_dim": 16},  # sliding-window layers, softcapping
    "GPTNeoX": SMALL,
    "GPT2": dict(vocab_size=128, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0),
}


@pytest.mark.parametrize("name", OTHERS)
def test_stages_of_other_hugging_face_decoders_compute_their_forward(name):
    config = getattr(transformers, f"{name}Config")(**OTHERS[name], use_cache=False)
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}LMHeadModel" if name == "GPT2" else f"{name}ForCausalLM")(config)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = (ids,) if name == "GPT2" else (ids, torch.ones_like(ids))  # GPT-2: past_key_values second
    _, output = chained(model.eval(), 2, "1f1b", inputs)
    assert torch.allclose(output.logits, model(*inputs).logits, atol=1e-6)


def test_a_module_with_weights_registered_before_the_blocks_but_called_after_is_refused():
    """OPT registers its final layer norm before its layers: the first stage would own it."""
    config = transformers.OPTConfig(**{**SMALL, "ffn_dim": 128}, word_embed_proj_dim=64, use_cache=False)
    model = transformers.OPTForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    with pytest.raises(RuntimeError, match="final_layer_norm holds weights and is registered before"):
        chained(model, 2, "1f1b", (ids,))
