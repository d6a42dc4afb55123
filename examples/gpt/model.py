"""A small GPT, in the spirit of nanoGPT's model: read it top to bottom.

Nothing here knows about processes or devices: unison wraps this module for whatever layout the run
uses. Two choices keep later sharding possible without touching this file:

- the blocks live in `self.transformer.h` (an nn.ModuleList), where per-block wrapping finds them;
- attention splits heads with `view(B, T, -1, head_dim)` and splits q/k/v with `chunk(3, dim=-1)`,
  never with `n_head` or `n_embd`, so a tensor-parallel rank that holds only its own n_head/tp heads
  (a slice of c_attn's output) runs the very same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 128  # the longest context the model sees
    vocab_size: int = 96  # characters in the tokenizer
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2
    n_experts: int = 0  # > 0: each block's MLP is a mixture of this many experts (MoE below)
    experts_per_token: int = 2  # the experts each token is computed by, in a mixture


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(
                f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}: every head gets "
                "n_embd / n_head channels. Pick n_embd as a multiple of n_head."
            )
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        # query, key and value for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_PROJECTION = True  # scaled init, see GPT._init_weights
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # (B, T, heads, head_dim) -> (B, heads, T, head_dim); "-1" heads: all of them, or this rank's share
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_PROJECTION = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Experts(nn.Module):
    """Every expert's MLP in one weight tensor per layer ([experts, out, in]), each run on its tokens.

    The forward takes transformers' experts arguments (the tokens, each token's chosen experts and their
    weights), which unison's expert parallelism recognises: under `ep_size` each process runs this very
    code on its own experts and the tokens sent to them (docs/expert-parallel.md).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Parameter(torch.empty(config.n_experts, 4 * config.n_embd, config.n_embd))
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Parameter(torch.empty(config.n_experts, config.n_embd, 4 * config.n_embd))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.c_fc.shape[0]):
            token, slot = torch.where(top_k_index == expert)
            hidden = self.gelu(F.linear(hidden_states[token], self.c_fc[expert]))
            computed = F.linear(hidden, self.c_proj[expert]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, computed.to(out.dtype))
        return out


class MoE(nn.Module):
    """A mixture of experts in the MLP's place: a router scores each token against every expert, and the
    token is computed by its `experts_per_token` best, their outputs weighted by the router's scores."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.top_k = config.experts_per_token
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = F.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(tokens, chosen, weights).reshape(x.shape)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if config.n_experts else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding
                wpe=nn.Embedding(config.block_size, config.n_embd),  # position embedding
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the same matrix reads tokens in and scores them out
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, 0.02), and residual projections scaled by 1/sqrt(2 * n_layer).

        Each block adds two projections onto the residual stream; the scaling keeps the stream's
        variance from growing with depth.
        """
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_PROJECTION", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, Experts):  # the residual projection scaled as the dense MLP's
            nn.init.normal_(module.c_fc, mean=0.0, std=0.02)
            nn.init.normal_(module.c_proj, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_parameters(self) -> int:
        """Parameter count, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) token ids. Returns logits (B, T, vocab) and the mean cross-entropy or None."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(
                f"a sequence of {T} tokens is longer than block_size={self.config.block_size}: the model "
                "has no position embedding beyond it. Crop the input or build the model with a larger "
                "block_size."
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens, feeding each prediction back in."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth_best] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_token), dim=1)
        return idx


def gpt2_124m() -> GPT:
    """This model at GPT-2 small's size (12 layers, 12 heads, 768 wide, 1,024 tokens, GPT-2's 50,257-token
    vocabulary): 124M parameters. A target for `unison plan` and `unison estimate-memory`, e.g.
    `unison plan examples/gpt/model.py:gpt2_124m --devices 8`."""
    return GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768))
