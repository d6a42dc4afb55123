"""Llama 3.1 70B's shapes as a Hugging Face transformers model, trained whole or with LoRA adapters:
targets for `unison plan` and `unison estimate-memory`, which call them on the meta device (shapes only,
nothing is allocated or downloaded; the adapters are made there too).

    unison plan examples/llama/lora.py:llama_70b --devices 8 --device h100
    unison plan examples/llama/lora.py:llama_70b_lora --devices 8 --device h100

`llama_70b_lora` is what a fine-tuning script builds: `peft.get_peft_model` freezes every weight of the
base model (requires_grad=False) and adds rank-16 adapters beside the attention projections, 65.5M
trainable parameters of 70.6B. The planner and the memory estimator count gradients and Adam state for
those only (docs/planner.md, "Fine-tuning with frozen weights or adapters").
"""

from __future__ import annotations

import transformers

LLAMA_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def llama_70b() -> transformers.LlamaForCausalLM:
    """Llama 3.1 70B's shapes, every parameter trained: 70.6B parameters."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_70B))


def llama_70b_lora():
    """The same model frozen, with LoRA of rank 16 on q_proj, k_proj, v_proj and o_proj (65.5M trainable).
    Needs peft (`pip install unison[peft]`)."""
    import peft

    return peft.get_peft_model(llama_70b(), peft.LoraConfig(r=16, target_modules=LORA_TARGETS))
