"""A user tensor-parallel plan under pipeline x tensor parallelism (pp=2 x tp=2) on 4 processes: run by
tests/workers/tensor_parallel_worker.py's 4-process launch after its own runs (`run(OUT_DIR)`), or
launched alone. The plan names modules of both stages, each key one stage's block; each stage takes
the keys that are its own.

Usage: tp_plan_pipeline_worker.py OUT_DIR. Each rank writes OUT_DIR/rank{R}.json with the first
step's loss and the loss of the same step on one process with the whole model.
"""

import json
import sys
from pathlib import Path

import torch
from tiny_gpt import make_tiny_gpt
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from unison import Accelerator, ParallelismConfig


def run(out: Path) -> None:
    """Inside a function, so every prepared model is freed before the interpreter's teardown: one left
    in a global can abort the process after its work is done (docs/failures.md)."""
    plan = {  # block 0 is the first stage's, block 1 the second's: each key names one stage's module
        f"transformer.h.{block}.mlp.{name}": style
        for block in (0, 1)
        for name, style in (("c_fc", ColwiseParallel()), ("c_proj", RowwiseParallel()))
    }
    accelerator = Accelerator(cpu=True, parallelism=ParallelismConfig(pp_size=2, tp_size=2, tp_plan=plan))
    model = accelerator.prepare(make_tiny_gpt(0, 16))
    x = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)

    def loss_fn(output, target):
        logits = output[0] if isinstance(output, tuple) else output  # GPT returns (logits, loss)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    loss = accelerator.forward_backward(model, x, y, loss_fn)
    reference = make_tiny_gpt(0, 16)
    record = {"loss": loss.item(), "reference": loss_fn(reference(x), y).item()}
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run(Path(sys.argv[1]))
