"""Launched worker: LoRA adapters on a tiny Hugging Face Llama (built from a config, no download) trained
under ZeRO-3 on 2 processes and saved with save_state, for tests/test_export_adapters.py's
`unison export --merge-adapters / --adapter-only`.

One run prepares three models, each with its AdamW:
- model 0: `peft.get_peft_model(llama, LoraConfig(r=4, q_proj and v_proj))`, the adapter "default";
- model 1: a plain `torch.nn.Linear`, no adapters (what the flags must refuse);
- model 2: a second Llama with two LoRA adapters: "first" (r=2 on every attention and MLP projection,
  the lm_head trained whole through `modules_to_save`) and "second" (r=4 on k_proj, added after), the
  active and trained one being "first".
STEPS AdamW steps on random tokens, then `save_state(OUT/checkpoint)` and, on process 0, the full
trained state dicts (`get_state_dict`, PeftModel names) in OUT/trained_N.pt.

argv[1]: OUT folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import peft
import torch
import transformers

from unison import Accelerator

STEPS = 3
SEQ = 12
VOCAB = 96
SEED = 4321


def make_llama() -> torch.nn.Module:
    """2 layers, 64 wide, 4 query heads sharing 2 key/value heads: the same weights for the same seed."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=24,
        use_cache=False,
    )
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config)


def lora_model() -> torch.nn.Module:
    """Model 0: one LoRA adapter, "default" (its B starts at zero, as PEFT initialises it)."""
    return peft.get_peft_model(
        make_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )


def two_adapter_model() -> torch.nn.Module:
    """Model 2: adapters "first" (active, trained) and "second"; "second"'s B made nonzero so that
    merging it by mistake would show."""
    first = peft.LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        modules_to_save=["lm_head"],
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(make_llama(), first, adapter_name="first")
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["k_proj"], lora_dropout=0.0))
    torch.manual_seed(SEED + 1)
    for name, param in model.named_parameters():
        if "lora_B.second" in name:
            param.data.normal_(0, 0.1)
    model.set_adapter("first")
    return model


def batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, 4, SEQ + 1), generator=torch.Generator().manual_seed(7))


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True, parallelism="zero3")
    models = [lora_model(), torch.nn.Linear(8, 8), two_adapter_model()]
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    prepared = accelerator.prepare(*models, *optimizers)
    models, optimizers = prepared[: len(models)], prepared[len(models) :]
    rank = accelerator.process_index
    for tokens in batches():
        mine = tokens[2 * rank : 2 * rank + 2]
        loss = sum(model(input_ids=mine[:, :-1], labels=mine[:, 1:]).loss for model in (models[0], models[2]))
        loss = loss + models[1](torch.ones(2, 8)).square().mean()
        accelerator.backward(loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state(out / "checkpoint")
    full = [accelerator.get_state_dict(model) for model in models]
    if accelerator.is_main_process:
        for index, state in enumerate(full):
            torch.save(state, out / f"trained_{index}.pt")


if __name__ == "__main__":
    main()
