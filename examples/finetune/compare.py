"""How far apart two runs' weights ended: the largest |difference| of any parameter.

    python examples/finetune/compare.py runs/finetune runs/finetune-1proc

Each argument is a --project-dir (its newest checkpoint is read) or one checkpoint directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from unison.checkpoint import load_object, newest_checkpoint


def model_weights(path: str) -> tuple[Path, dict]:
    """The newest checkpoint under `path` (or `path` itself) and its model's state dict."""
    checkpoint = (
        Path(path)
        if (Path(path) / "manifest.json").is_file()
        else newest_checkpoint(Path(path) / "checkpoints")
    )
    if checkpoint is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint nor a project directory with checkpoints/.")
    return checkpoint, load_object(checkpoint / "model_0.pt", map_location="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args()
    (first, a), (second, b) = model_weights(args.first), model_weights(args.second)
    if a.keys() != b.keys() or any(a[key].shape != b[key].shape for key in a):
        raise ValueError(f"{first} and {second} hold different models: compare runs of the same GPT.")
    name = max(a, key=lambda key: (a[key] - b[key]).abs().max().item())
    print(f"{first} vs {second}: max |difference| {(a[name] - b[name]).abs().max().item():.2e} (in {name})")


if __name__ == "__main__":
    main()
