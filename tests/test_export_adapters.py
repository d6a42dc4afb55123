"""`unison export` of a PEFT model (issue 40): what users load, never PEFT's names under a base config.

One launch of tests/workers/export_adapters_worker.py trains, under ZeRO-3 on 2 processes, a tiny Llama
with one LoRA adapter (model 0), a plain Linear (model 1) and a Llama with two LoRA adapters, the active
one with the lm_head trained whole (model 2), and saves them (DCP directories). From that checkpoint:
`--merge-adapters` loads with `AutoModelForCausalLM.from_pretrained` (no missing or unexpected key) with
the trained PeftModel's logits within fp32 rounding, its tensors exactly those of PEFT's own
merge_and_unload of the trained model; `--adapter-only` loads with `PeftModel.from_pretrained` on the base
model with exactly the trained logits; a plain export, and either flag on the Linear, are refused. The
in-process tests cover a plain one-process checkpoint (model_0.pt), prefix tuning (nothing to merge),
adapters a transformers model holds itself, and the other refusals.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import sys

import pytest
import torch
from launching import WORKERS, launch_ok

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from export_adapters_worker import VOCAB, lora_model, make_llama, two_adapter_model  # noqa: E402

from unison.checkpoint import CheckpointError, export_adapters  # noqa: E402
from unison.checkpoint.export import describe_models, export_checkpoint  # noqa: E402
from unison.commands.main import main  # noqa: E402

IDS = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
MERGE_ROUNDING = 1e-5  # merged fp32 weights against the adapter's two matmuls: measured 2e-7 to 4e-7


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    launch_ok(WORKERS / "export_adapters_worker.py", 2, out, timeout=240)
    return out


def trained(run, index: int, make) -> torch.nn.Module:
    """The PeftModel the run trained (its full state dict gathered by get_state_dict), in eval mode."""
    model = make()
    model.load_state_dict(torch.load(run / f"trained_{index}.pt"))
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def export(capsys, *argv) -> tuple[int, str, str]:
    """`unison export ARGV` in this process: exit code, stdout, stderr."""
    with cli_logging():
        code = main(["export", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@contextlib.contextmanager
def cli_logging():
    """The command's main() gives the "unison" logger a handler on sys.stderr, here capsys's stream, closed
    after the test: put the logger back as it was."""
    unison_logger = logging.getLogger("unison")
    saved = list(unison_logger.handlers), unison_logger.level
    try:
        yield
    finally:
        unison_logger.handlers[:], unison_logger.level = saved


def check_merged(out, model: torch.nn.Module) -> float:
    """`out` loads as the base class with the merged weights PEFT computes from `model`; the largest
    logit distance to `model`."""
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()  # PEFT's arithmetic, bit for bit
    exported = loaded.state_dict()
    assert sorted(exported) == sorted(peft_merged)
    assert all(torch.equal(exported[name], tensor) for name, tensor in peft_merged.items())
    distance = (logits(loaded.eval()) - logits(model)).abs().max().item()
    assert distance <= MERGE_ROUNDING, distance
    assert not torch.allclose(logits(loaded), logits(make_llama().eval()), atol=1e-3)  # the run trained
    return distance


def test_merge_adapters_loads_in_transformers_with_the_trained_logits(run, tmp_path, capsys):
    manifest = json.loads((run / "checkpoint" / "manifest.json").read_text())
    recorded = manifest["metadata"]["models"]
    assert recorded[0]["peft"]["class"] == "PeftModel" and recorded[0]["peft"]["active"] == ["default"]
    assert recorded[0]["config"]["architectures"] == ["LlamaForCausalLM"]  # the base's, not FSDP's class
    assert recorded[1].get("peft") is None

    code, out, err = export(capsys, run / "checkpoint", tmp_path / "one", "--merge-adapters")
    assert code == 0, err
    assert "merged adapter(s) 'default'" in out
    print(f"model 0 merged: {check_merged(tmp_path / 'one', trained(run, 0, lora_model)):.3g}")

    # two adapters: the active one merged (with its own lm_head, modules_to_save), the other left out
    code, out, err = export(capsys, run / "checkpoint", tmp_path / "two", "--merge-adapters", "--model", 2)
    assert code == 0, err
    assert "merged adapter(s) 'first'" in out and "second" not in out
    print(f"model 2 merged: {check_merged(tmp_path / 'two', trained(run, 2, two_adapter_model)):.3g}")


def test_adapter_only_writes_peft_folders_that_load_with_the_trained_logits(run, tmp_path, capsys):
    code, out, err = export(capsys, run / "checkpoint", tmp_path / "one", "--adapter-only")
    assert code == 0, err
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (tmp_path / "one").iterdir()
    }
    assert not (tmp_path / "one" / "config.json").exists()
    loaded = peft.PeftModel.from_pretrained(make_llama(), tmp_path / "one").eval()
    assert torch.equal(logits(loaded), logits(trained(run, 0, lora_model)))

    code, out, err = export(capsys, run / "checkpoint", tmp_path / "two", "--adapter-only", "--model", 2)
    assert code == 0, err  # adapters not named "default" go into a folder each, as PEFT writes them
    assert f"wrote adapter 'second' in {tmp_path / 'two' / 'second'}" in out
    loaded = peft.PeftModel.from_pretrained(make_llama(), tmp_path / "two" / "first", adapter_name="first")
    loaded.load_adapter(tmp_path / "two" / "second", adapter_name="second")
    original = trained(run, 2, two_adapter_model)
    for adapter in ("first", "second"):
        loaded.set_adapter(adapter)
        original.set_adapter(adapter)
        assert torch.equal(logits(loaded.eval()), logits(original.eval())), adapter


def test_a_peft_checkpoint_without_a_flag_and_a_flag_without_peft_are_refused(run, tmp_path, capsys):
    code, out, err = export(capsys, run / "checkpoint", tmp_path / "plain")
    assert code == 1 and not (tmp_path / "plain").exists()
    assert "model 0 is a PeftModel: LORA adapter 'default' (active) on a LlamaForCausalLM" in err
    assert "from_pretrained does not load" in err and "--merge-adapters" in err and "--adapter-only" in err
    for flag in ("--merge-adapters", "--adapter-only"):
        code, out, err = export(capsys, run / "checkpoint", tmp_path / "linear", "--model", 1, flag)
        assert code == 1 and not (tmp_path / "linear").exists()
        assert f"{flag} exports a PEFT model, and" in err and "model 1 is a model without adapters" in err
    with pytest.raises(SystemExit), cli_logging():  # one folder holds one of the two
        main(
            ["export", str(run / "checkpoint"), str(tmp_path / "both"), "--merge-adapters", "--adapter-only"]
        )


# -- in process, without a launch ------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_state")
def test_a_one_process_checkpoint_exports_both_ways(tmp_path):
    """A plain model_0.pt (one process, DDP) instead of DCP shards."""
    from unison import Accelerator

    accelerator = Accelerator(cpu=True)
    model = lora_model()
    with torch.no_grad():  # as if trained: B is zero at initialisation
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    model = accelerator.prepare(model)
    accelerator.save_state(tmp_path / "checkpoint")
    assert (tmp_path / "checkpoint" / "model_0.pt").is_file()
    model.eval()
    export_checkpoint(tmp_path / "checkpoint", tmp_path / "merged", merge_adapters=True)
    check_merged(tmp_path / "merged", model)
    result = export_checkpoint(tmp_path / "checkpoint", tmp_path / "adapter", adapter_only=True)
    assert result.adapters == ("default",) and result.tensors == 8  # A and B of q and v in 2 layers
    assert result.weights == tmp_path / "adapter" / "adapter_model.safetensors"
    loaded = peft.PeftModel.from_pretrained(make_llama(), tmp_path / "adapter").eval()
    assert torch.equal(logits(loaded), logits(model))


def prefix_tuned() -> torch.nn.Module:
    model = peft.get_peft_model(
        make_llama(), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    )
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.normal_(generator=torch.Generator().manual_seed(3))
    return model.eval()


def test_prefix_tuning_has_nothing_to_merge_and_exports_as_its_adapter(tmp_path):
    model = prefix_tuned()
    info = describe_models([model])[0]
    with pytest.raises(CheckpointError, match="PREFIX_TUNING has no weights to merge.*--adapter-only"):
        export_adapters.merged_state(info, dict(model.state_dict()))
    export_adapters.save_adapters(info, dict(model.state_dict()), tmp_path, None, True)
    loaded = peft.PeftModel.from_pretrained(make_llama(), tmp_path).eval()
    assert torch.equal(logits(loaded), logits(model))


def test_tensors_the_rebuilt_model_lacks_are_named(tmp_path):
    model = lora_model()
    info = describe_models([model])[0]
    state = {**model.state_dict(), "base_model.model.model.layers.0.mlp.gate_proj.lora_A.default.weight": IDS}
    with pytest.raises(CheckpointError, match=r"holds 1 the rebuilt model has not \(base_model.*gate_proj"):
        export_adapters.rebuild(info, state)
    state = {
        name: t for name, t in model.state_dict().items() if "layers.1.self_attn.v_proj.lora_B" not in name
    }
    with pytest.raises(
        CheckpointError, match=r"lacks 1 the rebuilt model has \(.*layers.1.self_attn.v_proj.lora_B"
    ):
        export_adapters.rebuild(info, state)


def test_without_peft_the_flags_name_what_to_install(monkeypatch):
    info = describe_models([lora_model()])[0]
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ImportError, match="peft is not installed: pip install peft transformers"):
        export_adapters.rebuild(info, {})


def test_a_checkpoint_of_peft_names_without_a_record_is_refused(tmp_path):
    """Saved before unison recorded PEFT models: exported as they are, from_pretrained would load none."""
    with pytest.raises(CheckpointError, match="tensors under PEFT's names .* records no PEFT model"):
        export_adapters.refuse_unrecorded_peft(tmp_path, 0, lora_model().state_dict())


def test_adapters_a_transformers_model_holds_itself_export_both_ways(tmp_path, monkeypatch):
    """transformers' own add_adapter puts PEFT's layers in the model (names without base_model.model.): as
    it does (inject_adapter_in_model, peft_config, _hf_peft_config_loaded), since transformers 5 asks
    peft >= 0.22 for it."""
    import transformers.integrations.peft as integration

    monkeypatch.setattr(integration, "check_peft_version", lambda **kwargs: None)
    model = make_llama()
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    peft.inject_adapter_in_model(config, model, "default")
    model.peft_config, model._hf_peft_config_loaded = {"default": config}, True
    model.eval()
    info = describe_models([model])[0]
    assert info["peft"]["injected"] and info["peft"]["active"] == ["default"]
    assert export_adapters.describe_what(info).startswith("a LlamaForCausalLM holding LORA adapter 'default'")
    copied = {name: tensor.clone() for name, tensor in model.state_dict().items()}  # merged in place
    merged, names = export_adapters.merged_state(info, copied)
    base = make_llama().eval()
    assert str(base.load_state_dict(merged)) == "<All keys matched successfully>" and names == ["default"]
    assert (logits(base) - logits(model)).abs().max().item() <= MERGE_ROUNDING
    export_adapters.save_adapters(info, dict(model.state_dict()), tmp_path, None, True)
    loaded = peft.PeftModel.from_pretrained(make_llama(), tmp_path).eval()
    assert torch.equal(logits(loaded), logits(model))


def test_the_recorded_config_names_the_class_trained():
    """As save_pretrained writes it: not a config's null (built in the script) nor the class of the
    checkpoint a model of another head was loaded from."""
    assert describe_models([make_llama()])[0]["config"]["architectures"] == ["LlamaForCausalLM"]
    config = make_llama().config
    config.architectures, config.num_labels = ["LlamaForCausalLM"], 3
    classifier = transformers.LlamaForSequenceClassification(config)
    assert describe_models([classifier])[0]["config"]["architectures"] == ["LlamaForSequenceClassification"]
