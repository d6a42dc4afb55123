"""The tiny GPT of examples/gpt/model.py that several launched workers train, loaded and configured once,
with the optimizers they train it with and the byte counts they measure; and the example Llama model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch.distributed.tensor import DTensor

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load_example(name: str) -> ModuleType:
    """examples/NAME/model.py as the module NAME_model (examples/ is no package: users run its files)."""
    spec = importlib.util.spec_from_file_location(f"{name}_model", _EXAMPLES / name / "model.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


gpt_model = _load_example("gpt")
llama_model = _load_example("llama")


def make_tiny_gpt(seed: int, block_size: int) -> torch.nn.Module:
    """2 layers x 32 wide, vocabulary 32: the same weights for a given seed on every process."""
    torch.manual_seed(seed)
    config = gpt_model.GPTConfig(block_size=block_size, vocab_size=32, n_layer=2, n_head=2, n_embd=32)
    return gpt_model.GPT(config)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """ "sgd": SGD with momentum (tight comparisons, 1e-5); otherwise AdamW (1e-4, see engine notes)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def local_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes this process holds of `tensor`: its local shard for a DTensor."""
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def unique_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters, a tied weight once."""
    return list({id(p): p for p in model.parameters()}.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state this rank holds: the moments, not the step counters (the formulas'
    8 bytes per parameter for Adam). Sees through unison's AcceleratedOptimizer and, for ZeRO-1, takes
    ZeroRedundancyOptimizer's local share."""
    inner = getattr(optimizer, "optimizer", optimizer)
    inner = getattr(inner, "optim", inner)
    return sum(
        local_bytes(value)
        for state in inner.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def tiny_gpt_16() -> torch.nn.Module:
    """make_tiny_gpt(0, 16) with no arguments: a TARGET for `unison plan` in the tests."""
    return make_tiny_gpt(0, 16)
