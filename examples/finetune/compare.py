"""How far apart two fine-tuning runs' weights ended, against how far fine-tuning moved them.

    python examples/finetune/compare.py runs/finetune runs/finetune-1proc

Prints ||first - second|| as a share of ||first - base|| (base: the GPT both started from, --base), and
the largest |difference| of any weight. The share is the fair measure: with AdamW, weights whose true
gradient is zero (the key part of each c_attn bias: softmax ignores a constant added to every score)
move by rounding noise, which AdamW scales up to lr-sized steps, so the largest difference alone
overstates how far two runs of the same computation drift apart.
Each argument is a --project-dir (its newest checkpoint is read) or one checkpoint directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

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
    parser.add_argument(
        "--base", default="runs/gpt", help="the GPT both runs started from (default: runs/gpt)"
    )
    args = parser.parse_args()
    (first, a), (second, b), (_, base) = map(model_weights, (args.first, args.second, args.base))
    if any(a.keys() != other.keys() or any(a[k].shape != other[k].shape for k in a) for other in (b, base)):
        raise ValueError(f"{first}, {second} and {args.base} hold different models: compare runs of one GPT.")
    keys = [key for key in a if key != "lm_head.weight"]  # tied to transformer.wte.weight: counted once

    def flat(weights: dict, minus: dict) -> torch.Tensor:
        return torch.cat([(weights[key] - minus[key]).flatten() for key in keys])

    difference, update = flat(a, b), flat(a, base)
    name = max(keys, key=lambda key: (a[key] - b[key]).abs().max().item())
    print(
        f"{first} vs {second}: they differ by {difference.norm() / update.norm():.2%} of the fine-tuning "
        f"update; max |difference| {difference.abs().max():.2e} (in {name})"
    )


if __name__ == "__main__":
    main()
