"""What the transformers fidelity workers share (hf_tp_plan_worker.py, hf_ep_worker.py): the run's
length and shape, the tiny decoder's sizes, and the optimizer that shows gradient differences."""

from __future__ import annotations

import torch

STEPS = 3
ACCUMULATION = 2
SEQ = 12
VOCAB = 96
SEED = 4321
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2 * SEQ,
    use_cache=False,
)
"""The sizes of every tiny decoder config, no download: 2 layers, 4 query and 2 key/value heads."""


def make_optimizer(model: torch.nn.Module):
    """SGD with momentum, and a rate that changes every step. Its update is proportional to the gradient,
    so the parameters' distance from one process shows how far the gradients are (AdamW divides tiny
    gradients by their own size)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


def plain_step(loss: torch.Tensor, model: torch.nn.Module, optimizer, scheduler) -> float:
    """One optimizer step of the one-process reference, as the launched loop takes it: backward,
    clipping to 0.5, the step, the rate; returns the loss."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()
