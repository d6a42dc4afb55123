"""Time one candidate layout's training step on this machine, for `unison plan --measure`.

Run under `unison launch` (one process per device), as `python -m unison.commands.measure_step TARGET ...`: it
builds the real model from TARGET, prepares it with the layout given as JSON, and runs warm-up steps then
timed optimizer steps of the planned shape (micro-batches of random token ids, next-token loss, AdamW),
each of `--micro-steps` micro-batches. The slowest process's median step is the measurement: every rank
waits for it. Process 0 writes `{"step_seconds": ..., "steps": [...]}` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .. import Accelerator
from ..parallel.config import ParallelismConfig
from ..planning.memory import inspect_model, load_factory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", help="module:factory returning the model (as for unison plan)")
    parser.add_argument("--layout", required=True, help="the ParallelismConfig's fields as JSON")
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--micro-steps", type=int, required=True, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--out", required=True, help="JSON file process 0 writes")
    return parser.parse_args(argv)


def next_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (a tensor, the first of a tuple, or `.logits`) against `target`."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = ParallelismConfig(**json.loads(args.layout))
    pipeline = (config.pp_size or 1) > 1
    accelerator = Accelerator(
        parallelism=config,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=1 if pipeline else args.micro_steps,
    )
    torch.manual_seed(0)
    model = load_factory(args.target)()
    vocab = inspect_model(model).vocab
    if vocab is None:
        raise ValueError(f"TARGET {args.target!r}: no token embedding found, so no token ids to feed it.")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    # a pipeline takes the step's micro-batches in one call and splits them itself
    rows = args.micro_batch_size * (args.micro_steps if pipeline else 1)
    generator = torch.Generator().manual_seed(1 + accelerator.process_index)
    tokens = torch.randint(0, vocab, (rows, args.seq_len + 1), generator=generator).to(accelerator.device)
    inputs, target = tokens[:, :-1], tokens[:, 1:]
    seconds = []
    for step in range(args.warmup + args.steps):
        began = time.perf_counter()
        for _ in range(1 if pipeline else args.micro_steps):
            with accelerator.accumulate(model):
                accelerator.forward_backward(model, inputs, target, next_token_loss)
                optimizer.step()
                optimizer.zero_grad()
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize(accelerator.device)
        if step >= args.warmup:
            seconds.append(time.perf_counter() - began)
    slowest = accelerator.reduce(torch.tensor(statistics.median(seconds), device=accelerator.device), "max")
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({"step_seconds": slowest.item(), "steps": seconds}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
