"""Launched worker: every causal language model transformers ships with a tensor-parallel plan, from a
tiny config, under tp_size=2 with its own plan, against one process (one forward and backward).

For each config class whose `base_model_tp_plan` is set: a config of TINY's sizes (the fields the class
has), the model from `AutoModelForCausalLM.from_config`, seeded alike on every process. Outcomes:
- "not built": the class has no causal-LM model (a vision or audio part, an encoder), its tiny config
  is refused or does not run on one process, or it still has more than MAX_PARAMETERS parameters
  (defaults TINY does not reach);
- "refused": unison refused the plan before any communication (the styles it could not apply);
- "failed": the run under tp_size=2 raised (the error's first line);
- "equal": the loss and every gradient within TOLERANCE (relative to the largest gradient) of one
  process; "differs" otherwise (the distance).
argv[1]: JSON report path (written by process 0): {config class: [outcome, detail]}. Before the survey,
the same launch may train hf_tp_plan_worker.py's families (its report's path, the layout and the
families follow as argv[2], argv[3], argv[4:]: that worker's arguments), the Accelerator's state reset
after them.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
import re
import sys
import warnings
from pathlib import Path

import torch
import transformers
import transformers.models
from torch.distributed.tensor import DTensor

from unison import Accelerator, PartialState
from unison.state import AcceleratorState, GradientState

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    use_cache=False,
)
MAX_PARAMETERS = 3_000_000
TOLERANCE = 1e-4
SEQ = 8


def config_classes() -> list[type]:
    found = {}
    for info in pkgutil.iter_modules(transformers.models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}.configuration_{info.name}")
        except Exception:
            continue
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, transformers.PretrainedConfig)
                and getattr(value, "base_model_tp_plan", None)
            ):
                found[value.__name__] = value
    return [found[name] for name in sorted(found)]


def tiny_config(cls: type):
    """TINY's sizes, no dropout (the ranks of a tensor-parallel group draw other masks), and a Mamba
    layer's scan in chunks of SEQ tokens (Bamba, FalconH1, GraniteMoeHybrid: their default 256 pads each
    sequence 32-fold, 13 times the time for the same loss and gradients)."""
    try:
        config = cls(**TINY)
    except Exception:
        config = cls()
        for key, value in TINY.items():
            _set(config, key, value)
    _set(config, "mamba_chunk_size", SEQ)
    for key, value in list(config.to_dict().items()):
        if "dropout" in key and isinstance(value, float):
            _set(config, key, 0.0)
    return config


def _set(config, key: str, value) -> None:
    try:
        if hasattr(config, key):
            setattr(config, key, value)
    except Exception:
        pass  # a field the config computes, or refuses globally (per-layer configs)


def build(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            grad = parameter.grad
            grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return loss.item(), grads


def survey_one(cls: type, accelerator_state: PartialState) -> list:
    try:
        config = tiny_config(cls)
        with torch.device("meta"):
            size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return ["not built", f"{size} parameters at the tiny sizes"]
        ids = torch.randint(3, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
        expected_loss, expected = loss_and_grads(build(config), ids)  # the model runs at all
    except Exception as error:
        return ["not built", f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"]
    accelerator = Accelerator(cpu=True, parallelism="tp_size=2")
    try:
        model = accelerator.prepare(build(config))
    except ValueError as error:
        styles = sorted(set(re.findall(r"': '([a-z_]+)'", str(error))))
        return ["refused", ", ".join(styles) or str(error).splitlines()[0][:160]]
    try:
        loss, grads = loss_and_grads(model, ids)
    except Exception as error:
        return ["failed", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"]
    scale = max(g.abs().max().item() for g in expected.values())
    distance = max((grads[name] - grad).abs().max().item() for name, grad in expected.items()) / scale
    distance = max(distance, abs(loss - expected_loss) / abs(expected_loss))
    return ["equal" if distance < TOLERANCE else "differs", f"{distance:.1e}"]


def main() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    state = PartialState(cpu=True)
    if len(sys.argv) > 2:
        import hf_tp_plan_worker

        trained_out, layout, families = Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
        trained = {family: hf_tp_plan_worker.train(family, layout) for family in families}
        if state.is_main_process:
            trained_out.write_text(json.dumps(trained))
        AcceleratorState._reset_state()
        GradientState._reset_state()
    report = {cls.__name__: survey_one(cls, state) for cls in config_classes()}
    if state.is_main_process:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
