"""Launched worker: a Hugging Face `transformers.LlamaForCausalLM` (built from a config, no download)
trained through the ordinary unison loop under each layout named on the command line, against one process.

Llama computes its rotary tables, causal mask and position ids before its first decoder layer and hands
them to every layer by keyword; a pipeline stage recomputes them from the micro-batch's inputs. The
batches carry an attention mask with right padding, so a later stage that did not get the micro-batch's
own mask would compute different logits. Every layout trains STEPS SGD+momentum steps of GLOBAL_BATCH
sequences with 2 accumulation micro-steps through `accelerator.forward_backward` (the call that also
runs pipelines) and compares `accelerator.get_state_dict` with the same model trained in this process
on each step's whole batch; also the loss every rank gets back and a forward-only loss.

Each layout's trained run is saved (save_state) to REPORT_DIR/LAYOUT/checkpoint, and its consolidated
weights to REPORT_DIR/LAYOUT/trained.pt (LAYOUT without "=", "," as "+"), for the export test.

argv[1]: JSON report path (written by process 0); argv[2:]: layouts (`parallelism=` strings).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tiny_gpt import make_optimizer
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState

STEPS = 3
GLOBAL_BATCH = 8
ACCUMULATION = 2
SEQ = 16
VOCAB = 128
SEED = 1234


def make_llama() -> torch.nn.Module:
    """4 layers, 64 wide, 4 query heads sharing 2 key/value heads, vocabulary 128: the same weights on
    every process. use_cache=False: training keeps no key/value cache."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        use_cache=False,
    )
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config)


def make_dataset() -> TensorDataset:
    """(input ids, attention mask with 8..16 valid tokens then padding, next-token targets)."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ + 1), generator=generator)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (STEPS * GLOBAL_BATCH,), generator=generator)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    return TensorDataset(tokens[:, :-1].contiguous(), mask, tokens[:, 1:].contiguous())


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position (equal micro-batches: the mean of means is the mean)."""
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


_REFERENCE: dict = {}


def reference() -> dict:
    """One process, plain torch: each step's GLOBAL_BATCH sequences in one batch."""
    if not _REFERENCE:
        model = make_llama()
        optimizer = make_optimizer("sgd", model.parameters())
        ids, mask, targets = make_dataset().tensors
        losses = []
        for step in range(STEPS):
            rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
            loss = loss_fn(model(ids[rows], mask[rows]), targets[rows])
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            eval_loss = loss_fn(model(ids[:GLOBAL_BATCH], mask[:GLOBAL_BATCH]), targets[:GLOBAL_BATCH]).item()
        _REFERENCE.update(state=model.state_dict(), losses=losses, eval_loss=eval_loss)
    return _REFERENCE


def train(layout: str, out_dir: Path) -> dict:
    accelerator = Accelerator(cpu=True, parallelism=layout, gradient_accumulation_steps=ACCUMULATION)
    model = make_llama()
    optimizer = make_optimizer("sgd", model.parameters())
    dp = accelerator.parallelism.dp_size
    loader = DataLoader(make_dataset(), batch_size=GLOBAL_BATCH // (dp * ACCUMULATION))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, window = [], []
    for ids, mask, targets in loader:
        with accelerator.accumulate(model):
            loss = accelerator.forward_backward(model, (ids, mask), targets, loss_fn)
            window.append(accelerator.reduce(loss, "mean").item())
            optimizer.step()
            optimizer.zero_grad()
        if len(window) == ACCUMULATION:
            losses.append(sum(window) / ACCUMULATION)
            window = []
    ids, mask, targets = make_dataset().tensors
    share = GLOBAL_BATCH // dp
    rows = slice(accelerator.data_parallel_index * share, (accelerator.data_parallel_index + 1) * share)
    eval_loss = accelerator.forward_loss(model, (ids[rows], mask[rows]), targets[rows], loss_fn)
    eval_loss = accelerator.reduce(eval_loss, "mean").item()
    full = accelerator.get_state_dict(model)
    # for test_pipeline_llama's export test: the checkpoint, and the trained weights it must give back
    saved_as = out_dir / layout.replace(",", "+").replace("=", "")
    accelerator.save_state(saved_as / "checkpoint")
    if accelerator.is_main_process:
        torch.save(full, saved_as / "trained.pt")
    expected = reference()
    result = {
        "engine": type(model).__name__,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, expected["losses"])),
        "steps": len(losses),
        "eval_loss_diff": abs(eval_loss - expected["eval_loss"]),
    }
    if accelerator.is_main_process:
        result["keys_match"] = sorted(full) == sorted(expected["state"])
        result["max_abs_diff"] = max((full[k] - v).abs().max().item() for k, v in expected["state"].items())
    return result


def main() -> None:
    out, layouts = Path(sys.argv[1]), sys.argv[2:]
    state = PartialState(cpu=True)
    report = {layout: train(layout, out.parent) for layout in layouts}
    if state.is_main_process:
        out.write_text(json.dumps({"world": state.num_processes, "layouts": report}))


if __name__ == "__main__":
    main()
