"""Launched worker: Hugging Face mixtures of experts under expert parallelism (unison.parallel.experts),
against one process.

Each family is built from a tiny config (no download; 4 experts, 2 per token) and trained STEPS
SGD+momentum steps with 2 accumulation micro-steps, gradient clipping and a scheduler that changes the
rate every step, under the layout (argv[2]: ep_size=2 on 2 processes; ep_size=2 beside dp_shard_size=4
on 4: two EP groups replicating each other, the rest ZeRO-3 over all 4); the same model trains in this
process, plain torch, on each step's whole batch. What each family's experts exercise:

- mixtral: gate|up fused in one [experts, 2 x inner, hidden] tensor, the router's weights renormalised;
- qwen2_moe: beside a shared expert with its own sigmoid gate (dense, left to ZeRO);
- olmoe: q_norm / k_norm in attention, router weights not renormalised.

argv[1]: JSON report path (written by process 0); argv[2]: the layout; argv[3:]: families.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState

STEPS = 3
BATCH = 8
ACCUMULATION = 2
SEQ = 12
VOCAB = 96
SEED = 4321
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2 * SEQ,
    use_cache=False,
    num_experts_per_tok=2,
)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SHAPE, intermediate_size=48, num_local_experts=4)
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **SHAPE, num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=32
        )
    ),
    "olmoe": lambda: transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(**SHAPE, intermediate_size=48, num_experts=4, pad_token_id=0)
    ),
}


def make(family: str) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return FAMILIES[family]()


def make_optimizer(model: torch.nn.Module):
    # SGD with momentum: its update is proportional to the gradient, so the parameters' distance from one
    # process shows how far the gradients are (AdamW divides tiny gradients by their own size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


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
        loss = loss_of(model, ids[rows], targets[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses


def train(family: str, layout: str) -> dict:
    accelerator = Accelerator(cpu=True, parallelism=layout, gradient_accumulation_steps=ACCUMULATION)
    model = make(family)
    optimizer, scheduler = make_optimizer(model)
    dp = accelerator.parallelism.dp_size
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
    expected, expected_losses = reference(family)
    result = {"loss_diff": max(abs(a - b) for a, b in zip(losses, expected_losses)), "steps": len(losses)}
    sharded = [
        name for name, p in accelerator.unwrap_model(model).named_parameters() if hasattr(p, "placements")
    ]
    result["sharded_parameters"] = len(sharded)
    result["expert_shapes"] = sorted(
        {
            str(tuple(p.to_local().shape))
            for n, p in accelerator.unwrap_model(model).named_parameters()
            if ".experts." in n
        }
    )
    if accelerator.is_main_process:
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
