"""A Llama-style decoder in plain torch, with Hugging Face Llama's module names, and sizes to plan with.

The architecture of Llama 2/3: RMSNorm before attention and MLP, rotary positions, grouped-query
attention (several query heads share one key/value head), a SwiGLU MLP, an untied output layer. The
module names are Hugging Face's (`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`, `lm_head`), so
unison's built-in tensor-parallel plan for Llama applies, as it does to `transformers` models.

The factories below build published sizes for `unison plan` and `unison estimate-memory`, which call
them on the meta device (shapes only: a 405B model costs nothing to build there):

    unison estimate-memory examples/llama/model.py:llama_3_1_8b --devices 8
    unison plan examples/llama/model.py:llama_3_1_405b --devices 512 --nodes 64 --device-memory 80GB
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    intermediate_size: int = 14336
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary position embedding of x (batch, time, heads, head_dim)."""
    seq, dim = x.size(1), x.size(-1)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=x.device), inv_freq)[None, :, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x1 * angles.sin() + x2 * angles.cos()], -1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.rope_theta = config.rope_theta
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # view(B, T, -1, head_dim): under tensor parallelism a rank holds a share of the heads
        q = rotary(self.q_proj(x).view(B, T, -1, self.head_dim), self.rope_theta).transpose(1, 2)
        k = rotary(self.k_proj(x).view(B, T, -1, self.head_dim), self.rope_theta).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        repeat = q.size(1) // k.size(1)  # query heads per key/value head: the same on every TP rank
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Token ids (batch, time) -> (logits, mean cross-entropy over `targets`, or None without them)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def llama_3_1_8b() -> LlamaForCausalLM:
    """Llama 3.1 8B's shapes: 8.03B parameters."""
    return LlamaForCausalLM(LlamaConfig(vocab_size=128256))


def llama_3_1_70b() -> LlamaForCausalLM:
    """Llama 3.1 70B's shapes: 70.6B parameters."""
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128256,
            hidden_size=8192,
            num_hidden_layers=80,
            num_attention_heads=64,
            intermediate_size=28672,
        )
    )


def llama_3_1_405b() -> LlamaForCausalLM:
    """Llama 3.1 405B's shapes: 405.9B parameters."""
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128256,
            hidden_size=16384,
            num_hidden_layers=126,
            num_attention_heads=128,
            intermediate_size=53248,
        )
    )
