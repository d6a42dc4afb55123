"""The tiny GPT of examples/gpt/model.py that several launched workers train, loaded and configured once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_GPT_MODEL = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "model.py"
_spec = importlib.util.spec_from_file_location("tiny_gpt_model", _GPT_MODEL)
gpt_model = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(gpt_model)


def make_tiny_gpt(seed: int, block_size: int) -> torch.nn.Module:
    """2 layers x 32 wide, vocabulary 32: the same weights for a given seed on every process."""
    torch.manual_seed(seed)
    config = gpt_model.GPTConfig(block_size=block_size, vocab_size=32, n_layer=2, n_head=2, n_embd=32)
    return gpt_model.GPT(config)
