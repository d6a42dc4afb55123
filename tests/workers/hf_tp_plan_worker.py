"""Launched worker: Hugging Face decoders under tensor parallelism from the plan each carries
(`model.tp_plan`, translated by unison.parallel.transformers_plans), against one process.

Each family is built from a tiny config (no download) and trained STEPS SGD+momentum steps with 2
accumulation micro-steps, gradient clipping and a scheduler that changes the rate every step, under
the layout (no plan passed: the model's own is used); the same model trains in process 0 (whose
report is written), plain torch, on each step's whole batch. The layout is argv[2] (tp_size=2, or
tp_size=2 beside dp_shard_size=2 on 4 processes: ZeRO-3 over the tensor-parallel shards). What each
family's plan exercises:

- qwen3: per-head q_norm / k_norm after column-split projections (replicated_with_grad_allreduce);
- phi3: a packed q|k|v and a packed gate|up gathered whole (colwise_gather_output), split again for
  the row-parallel projection (rowwise_split_input);
- olmo2: q_norm / k_norm over the whole gathered projections, a column-split MLP.

argv[1]: JSON report path (written by process 0); argv[2]: the layout; argv[3:]: families.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from hf_fidelity import ACCUMULATION, DECODER, SEED, SEQ, STEPS, VOCAB, make_optimizer, plain_step
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState

BATCH = 4
SHAPE = dict(**DECODER, intermediate_size=96)
FAMILIES = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=16)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**SHAPE, pad_token_id=0)),
    "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SHAPE, pad_token_id=0)),
}


def make(family: str) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return FAMILIES[family]()


def make_dataset() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def loss_of(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())


def reference(family: str) -> tuple[dict, list[float]]:
    model = make(family)
    optimizer, scheduler = make_optimizer(model)
    ids, targets = make_dataset().tensors
    losses = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        losses.append(plain_step(loss_of(model, ids[rows], targets[rows]), model, optimizer, scheduler))
    return model.state_dict(), losses


def train(family: str, layout: str) -> dict:
    accelerator = Accelerator(cpu=True, parallelism=layout, gradient_accumulation_steps=ACCUMULATION)
    model = make(family)
    optimizer, scheduler = make_optimizer(model)
    dp = accelerator.parallelism.dp_size  # the ranks of one TP group see the same batch
    loader = DataLoader(make_dataset(), batch_size=BATCH // (ACCUMULATION * dp))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, window = [], []
    for ids, targets in loader:
        with accelerator.accumulate(model):
            loss = loss_of(model, ids, targets)
            accelerator.backward(loss)
            window.append(accelerator.reduce(loss.detach(), "mean").item())  # over the data-parallel ranks
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if len(window) == ACCUMULATION:
            losses.append(sum(window) / ACCUMULATION)
            window = []
    full = accelerator.get_state_dict(model)
    result: dict = {"steps": len(losses)}
    sharded = [
        name for name, p in accelerator.unwrap_model(model).named_parameters() if hasattr(p, "placements")
    ]
    result["sharded_parameters"] = len(sharded)
    if accelerator.is_main_process:  # the report is process 0's: the others need no reference
        expected, expected_losses = reference(family)
        result["loss_diff"] = max(abs(a - b) for a, b in zip(losses, expected_losses))
        result["keys_match"] = sorted(full) == sorted(expected)
        result["max_abs_diff"] = max((full[k] - v).abs().max().item() for k, v in expected.items())
    return result


def main() -> None:
    out, layout, families = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    state = PartialState(cpu=True)
    report = {family: train(family, layout) for family in families}
    if state.is_main_process:
        out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
