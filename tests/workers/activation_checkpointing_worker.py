"""Launched worker (2 processes): activation checkpointing in every layout, against the same layout without.

For each layout (DDP, ZeRO-2, ZeRO-3, TP 2, PP 2) and each mode (none, full, selective op-level,
selective:2) one forward/backward of a 4-block tiny GPT (examples/gpt/model.py) through
`Accelerator.forward_backward`; recorded per run, on every rank:
- the full gradient of every parameter this rank holds, by name (DTensor shards gathered), compared
  here with the same layout's run without checkpointing;
- the parameter names and state-dict keys (must be the user's: no wrapper prefix);
- how many block forwards ran (a global forward pre-hook): recomputation in backward shows as extra
  calls, so a mode that was silently not applied fails the test.
Then dropout 0.1 (ZeRO-3): full checkpointing must give the same gradients as none, since the
recomputation restores the RNG state. The pipeline's layout is chosen through the launch flag
(UNISON_ACTIVATION_CHECKPOINTING, exported by the test) for one extra run, to cover env precedence.

argv[1]: JSON report path (process 0 writes {"ranks": [...]}).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_gpt import gpt_model
from torch.distributed.tensor import DTensor

from unison import Accelerator

BLOCK, BATCH, SEED = 16, 8, 1234
MODES = {  # every layout with full; op-level and every-2nd block spread over them (a run costs seconds here)
    "ddp": (None, "full", "selective:2"),
    "zero2": (None, "full"),
    "zero3": (None, "full", "selective", "selective:2"),
    "tp_size=2": (None, "full", "selective"),
    "pp_size=2": (None, "full", "selective"),
}

block_calls = 0


def count_block(module: torch.nn.Module, args) -> None:
    global block_calls
    if isinstance(module, gpt_model.Block):
        block_calls += 1


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def run(layout: str, mode: str | None, dropout: float = 0.0) -> dict:
    global block_calls
    accelerator = Accelerator(cpu=True, parallelism=layout, activation_checkpointing=mode)
    torch.manual_seed(SEED)
    config = gpt_model.GPTConfig(block_size=BLOCK, vocab_size=32, n_layer=4, n_head=2, n_embd=32)
    config.dropout = dropout
    model = gpt_model.GPT(config)
    user_names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    model = accelerator.prepare(model)
    tokens = torch.randint(0, 32, (BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(5))
    dp_size, dp_rank = accelerator.parallelism.dp_size, accelerator.data_parallel_index
    share = BATCH // dp_size
    batch = tokens[dp_rank * share : (dp_rank + 1) * share]
    torch.manual_seed(SEED + 1)  # dropout masks: the same in both runs
    block_calls = 0
    accelerator.forward_backward(model, batch[:, :-1], batch[:, 1:], loss_fn)
    calls = block_calls
    inner = accelerator.unwrap_model(model)
    grads = {}
    for name, parameter in inner.named_parameters():
        grad = parameter.grad
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).flatten().tolist()
    names = [name for name, _ in inner.named_parameters()]
    keys = list(inner.state_dict())
    accelerator.end_training()
    return {
        "grads": grads,
        "names_are_users": set(names) <= set(user_names) and all("_checkpoint" not in k for k in keys),
        "keys": keys,
        "block_calls": calls,
        "describe": accelerator.parallelism.describe(),
    }


def compare(runs: dict, name: str, reference: str) -> dict:
    base, other = runs[reference], runs[name]
    diff = max(
        max(abs(a - b) for a, b in zip(base["grads"][k], other["grads"][k], strict=True))
        for k in base["grads"]
    )
    return {
        "max_grad_diff": diff,
        "same_params": sorted(base["grads"]) == sorted(other["grads"]),
        "same_keys": base["keys"] == other["keys"],
        "names_are_users": other["names_are_users"],
        "call_ratio": other["block_calls"] / base["block_calls"],
        "describe": other["describe"],
    }


def main() -> None:
    exported = os.environ.pop("UNISON_ACTIVATION_CHECKPOINTING")  # for the last run only
    torch.nn.modules.module.register_module_forward_pre_hook(count_block)
    runs, report = {}, {}
    for layout, modes in MODES.items():
        for mode in modes:
            runs[(layout, mode)] = run(layout, mode)
            if mode is not None:
                report[f"{layout}|{mode}"] = compare(runs, (layout, mode), (layout, None))
    runs[("zero3", "dropout")] = run("zero3", None, dropout=0.1)
    runs[("zero3", "dropout-full")] = run("zero3", "full", dropout=0.1)
    report["zero3|dropout-full"] = compare(runs, ("zero3", "dropout-full"), ("zero3", "dropout"))
    os.environ["UNISON_ACTIVATION_CHECKPOINTING"] = exported
    runs[("pp_size=2", "env")] = run("pp_size=2", None)
    report[f"pp_size=2|env={exported}"] = compare(runs, ("pp_size=2", "env"), ("pp_size=2", None))
    runs[("ddp", "code-wins")] = run("ddp", "none")  # the argument in code beats the exported flag
    report["ddp|code-none-beats-env"] = compare(runs, ("ddp", "code-wins"), ("ddp", None))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, report)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as file:
            json.dump({"ranks": everyone}, file)


if __name__ == "__main__":
    main()
