"""Launched worker: PEFT adapters on a Hugging Face Llama (tiny config, no download) under each layout,
against the same adapter trained in this process with plain torch.

Each case is ADAPTER/LAYOUT[/OPTION]:
- ADAPTER: `lora` (r=4 on q_proj, v_proj, o_proj and down_proj: column- and row-parallel bases under
  tensor parallelism), `dora` (LoRA with use_dora), `ia3`, `prefix` (prefix tuning, 4 virtual tokens),
  `gptlora` (LoRA on every projection of the GPT example's model instead of the Llama: its fused q|k|v,
  and sequence parallelism, which transformers' decoders do not take);
- LAYOUT: a `parallelism=` string (ddp, zero2, zero3, tp_size=2, pp_size=2);
- OPTION: `gc` (transformers' `gradient_checkpointing_enable()` before prepare), `dataset` (the batches
  from a `datasets.Dataset`), `iterable` (from a `datasets` IterableDataset), each of those two also
  saved after step 1 and resumed into a fresh Accelerator, model, optimizer and loader.

Every case trains STEPS SGD+momentum steps (2 accumulation micro-steps, clipping, a rate that changes
every step) through `accelerator.forward_backward`, and reports the distance of every loss and every
parameter (frozen and trained) from one process, how many parameters are trainable and how many are
split across processes (DTensors). A case whose prepare() refuses reports the message every rank got.

argv[1]: JSON report path (written by process 0); argv[2]: checkpoint folder; argv[3:]: cases.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import peft
import torch
import torch.nn.functional as F
import transformers
from hf_fidelity import ACCUMULATION, DECODER, SEED, SEQ, STEPS, make_optimizer, plain_step
from tiny_gpt import make_tiny_gpt
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, GradientState, PartialState

BATCH = 4  # sequences per optimizer step over all processes
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
ADAPTERS = {
    "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0),
    "dora": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "gptlora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"]),
}
GPT_VOCAB = 32


def make_model(adapter: str, gradient_checkpointing: bool) -> torch.nn.Module:
    if adapter == "gptlora":
        model = make_tiny_gpt(SEED, SEQ)
        torch.manual_seed(SEED)  # lora_A's start
        return peft.get_peft_model(model, ADAPTERS[adapter]())
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**DECODER, intermediate_size=96)
    model = transformers.LlamaForCausalLM(config)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    wrapped = peft.get_peft_model(model, ADAPTERS[adapter]())
    if adapter == "ia3":  # IA3 starts at the identity: a step away from it, so its gradients reach the base
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for parameter in wrapped.parameters():
                if parameter.requires_grad:
                    parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return wrapped


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids below the GPT's vocabulary too, so every model reads the same samples."""
    ids = torch.randint(0, GPT_VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def make_dataset(option: str):
    """The samples as a TensorDataset, or through Hugging Face `datasets` (map-style or iterable)."""
    inputs, targets = tokens()
    if option not in ("dataset", "iterable"):
        return TensorDataset(inputs, targets)
    table = datasets.Dataset.from_dict({"inputs": inputs.tolist(), "targets": targets.tolist()})
    table = table.with_format("torch")
    return table.to_iterable_dataset(num_shards=2) if option == "iterable" else table


def batch_tensors(batch) -> tuple[torch.Tensor, torch.Tensor]:
    return (batch["inputs"], batch["targets"]) if isinstance(batch, dict) else tuple(batch)


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output[0] if isinstance(output, tuple) else output.logits  # the GPT returns (logits, loss)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference(adapter: str) -> tuple[dict, list[float]]:
    model = make_model(adapter, gradient_checkpointing=False)
    optimizer, scheduler = make_optimizer(model)
    inputs, targets = tokens()
    losses = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = loss_fn(model(inputs[rows]), targets[rows])
        losses.append(plain_step(loss, model, optimizer, scheduler))
    return {name: value.detach().clone() for name, value in model.state_dict().items()}, losses


def new_run(adapter: str, layout: str, option: str):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, parallelism=layout, gradient_accumulation_steps=ACCUMULATION)
    model = make_model(adapter, gradient_checkpointing=option == "gc")
    optimizer, scheduler = make_optimizer(model)
    dp = accelerator.parallelism.dp_size  # the ranks of one tensor-parallel group see the same batch
    loader = DataLoader(make_dataset(option), batch_size=BATCH // (ACCUMULATION * dp))
    return accelerator, accelerator.prepare(model, optimizer, loader, scheduler)


def train(accelerator, model, optimizer, loader, scheduler, stop_after: int | None = None) -> list[float]:
    """The user's loop; the mean loss of each optimizer step (over the data-parallel ranks)."""
    losses, window = [], []
    for batch in loader:
        inputs, targets = batch_tensors(batch)
        with accelerator.accumulate(model):
            loss = accelerator.forward_backward(model, inputs, targets, loss_fn)
            window.append(accelerator.reduce(loss.detach(), "mean").item())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if len(window) == ACCUMULATION:
            losses.append(sum(window) / ACCUMULATION)
            window = []
            if len(losses) == stop_after:
                break
    return losses


def max_difference(state: dict, expected: dict, names: set[str]) -> float:
    return max((state[name] - expected[name]).abs().max().item() for name in names)


def run_case(case: str, checkpoints: Path, expected: dict) -> dict:
    adapter, layout, option = (case.split("/") + [""])[:3]
    print(f"case {case}", flush=True)  # where a crash happened
    try:
        accelerator, objects = new_run(adapter, layout, option)
    except (ValueError, TypeError, NotImplementedError) as error:
        message = f"{type(error).__name__}: {error}"
        everyone = [None] * PartialState().num_processes
        torch.distributed.all_gather_object(everyone, message)
        return {"refused": message, "same_on_every_rank": len(set(everyone)) == 1}
    if option in ("dataset", "iterable"):  # stop after step 1, save, resume in a fresh run
        losses = train(accelerator, *objects, stop_after=1)
        accelerator.save_state(checkpoints / case.replace("/", "@"))
        accelerator, objects = new_run(adapter, layout, option)
        accelerator.load_state(checkpoints / case.replace("/", "@"))
        losses += train(accelerator, *objects)
    else:
        losses = train(accelerator, *objects)
    model = objects[0]
    parameters = list(accelerator.unwrap_model(model).named_parameters())
    result = {
        "steps": len(losses),
        "split_parameters": sum(hasattr(p, "placements") and p.device_mesh.size() > 1 for _, p in parameters),
        "trainable": sum(p.requires_grad for _, p in parameters),
        "checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in model.modules()),
    }
    full = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        state, expected_losses = expected[adapter]
        start = make_model(adapter, gradient_checkpointing=False)
        trained = {name for name, p in start.named_parameters() if p.requires_grad}
        result["loss_diff"] = max(abs(a - b) for a, b in zip(losses, expected_losses))
        result["keys_match"] = sorted(full) == sorted(state)
        result["trained_diff"] = max_difference(full, state, trained)
        result["frozen_diff"] = max_difference(full, state, set(state) - trained)
        result["moved"] = max_difference(start.state_dict(), state, trained)
    return result


def main() -> None:
    out, checkpoints, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    state = PartialState(cpu=True)
    adapters = {case.split("/")[0] for case in cases}
    expected = {adapter: reference(adapter) for adapter in adapters} if state.is_main_process else {}
    report = {case: run_case(case, checkpoints, expected) for case in cases}
    if state.is_main_process:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
