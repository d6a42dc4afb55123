"""Consolidated model weights for use without unison: one safetensors file (or torch.save as fallback)."""

from __future__ import annotations

from pathlib import Path

import torch

SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"


def save_model_weights(model: torch.nn.Module, directory: Path, safe_serialization: bool = True) -> Path:
    """Write `model`'s weights into `directory`; returns the file written.

    safetensors stores tensors only (nothing to execute on load) and keeps tied weights once;
    `safetensors.torch.load_model(model, path)` reads them back into a freshly built model.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if not safe_serialization:
        path = directory / TORCH_FILE
        torch.save(model.state_dict(), path)
        return path
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise ImportError(
            "save_model writes safetensors files, but the safetensors package is not installed: "
            "`pip install safetensors` (or `pip install unison[safetensors]`), or pass "
            "safe_serialization=False for a torch.save file."
        ) from None
    path = directory / SAFETENSORS_FILE
    save_model(model, str(path))
    return path
