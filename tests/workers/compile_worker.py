"""Launched worker: torch.compile at prepare() (unison.parallel.compiling) under each layout, against eager.

For every run below the script trains a tiny GPT (examples/gpt/model.py, 2 blocks) for STEPS optimizer
steps through `Accelerator(parallelism=..., dynamo_backend=...)`, `prepare`, `accumulate`, `backward`
(`forward_backward` under pipeline parallelism), twice: eager and
compiled with the "aot_eager" backend (AOTAutograd traces forward and backward into graphs and runs them
with eager kernels: the same arithmetic, so the parameters should match to the last bit or to rounding),
and compares the consolidated state dicts (`accelerator.get_state_dict`).

Runs (2 processes): ddp with accumulation 2, ddp with DDP's static_graph, zero1, zero2, zero3, tp_size=2 (on
the example Llama: separate q/k/v projections), zero3 with bf16 autocast and blocks that checkpoint their
activations (torch.utils.checkpoint in the block's forward), pp_size=2 (each stage's blocks compiled), and
ddp on a model without a block list (compiled whole). Every forward sees MICRO_BATCH rows, so a layout's
graphs are traced for one shape.

Each compiled run also reports: whether the blocks' forward really ran compiled (the block records
`torch.compiler.is_compiling()` on each call), the class `unwrap_model` gives, whether any state-dict key
or any byte of a `save_state` checkpoint holds "_orig_mod", and whether that checkpoint loads (strict)
into the eager run's model of the same layout.

Process 0 writes a JSON report to the path given as the first argument.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from tiny_gpt import gpt_model, llama_model, make_optimizer
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, PartialState
from unison.kwargs_handlers import DistributedDataParallelKwargs

STEPS = 3
BLOCK = 16
VOCAB = 32
SEED = 1234
MICRO_BATCH = 2  # rows per rank per forward in every run: one input shape, so no recompilation for a new one
RUNS = {  # name: (parallelism, data-parallel degree, accumulation, mixed precision, model, DDP static graph)
    "ddp_acc2": ("ddp", 2, 2, "no", "gpt", False),
    "ddp_static_graph": ("ddp", 2, 1, "no", "gpt", True),  # (static_graph with no_sync: DDP fails, eager too)
    "zero1": ("zero1", 2, 1, "no", "gpt", False),
    "zero2": ("zero2", 2, 1, "no", "gpt", False),
    "zero3": ("zero3", 2, 1, "no", "gpt", False),
    "tp2": ("tp_size=2", 1, 1, "no", "llama", False),
    "zero3_bf16_checkpointed": ("zero3", 2, 1, "bf16", "checkpointed", False),
    "pp2": ("pp_size=2", 1, 1, "no", "gpt", False),
    "ddp_no_blocks": ("ddp", 2, 1, "no", "mlp", False),
}

COMPILED_CALLS = torch.zeros((), dtype=torch.long)
"""Block calls that ran inside compiled code (a tensor: dynamo guards on a list's length, recompiling)."""


def record_call() -> None:
    if torch.compiler.is_compiling():
        COMPILED_CALLS.add_(1)


class RecordingBlock(gpt_model.Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record_call()
        return super().forward(x)


class RecordingLlamaLayer(llama_model.LlamaDecoderLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record_call()
        return super().forward(x)


class CheckpointedBlock(gpt_model.Block):
    """A block that recomputes its activations in backward (what activation checkpointing applies)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record_call()
        return checkpoint(super().forward, x, use_reentrant=False)


class MLP(nn.Module):
    """No list of same-class blocks: compiled whole. Returns (logits, loss) as the GPT does."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        record_call()
        logits = self.head(self.body(self.embed(idx)))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(SEED)
    if kind == "mlp":
        return MLP()
    if kind == "llama":
        layer_class, llama_model.LlamaDecoderLayer = llama_model.LlamaDecoderLayer, RecordingLlamaLayer
        try:  # 4 query heads sharing 2 key/value heads, separate q/k/v projections
            config = llama_model.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                rope_theta=10000.0,
            )
            return llama_model.LlamaForCausalLM(config)
        finally:
            llama_model.LlamaDecoderLayer = layer_class
    block_class = gpt_model.Block
    gpt_model.Block = RecordingBlock if kind == "gpt" else CheckpointedBlock  # GPT builds blocks by this name
    try:
        config = gpt_model.GPTConfig(block_size=BLOCK, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32)
        return gpt_model.GPT(config)
    finally:
        gpt_model.Block = block_class


def loader(global_batch: int) -> DataLoader:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (STEPS * global_batch, BLOCK + 1), generator=generator)
    dataset = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(dataset, batch_size=global_batch)


def train(run: str, backend: str | None) -> tuple[Accelerator, nn.Module, dict[str, torch.Tensor]]:
    layout, dp_size, accumulation, precision, kind, static_graph = RUNS[run]
    AcceleratorState._reset_state()  # each run its own precision (the process group stays)
    handlers = [DistributedDataParallelKwargs(static_graph=True)] if static_graph else []
    accelerator = Accelerator(
        cpu=True,
        parallelism=layout,
        mixed_precision=precision,
        gradient_accumulation_steps=accumulation,
        split_batches=True,  # each step's rows, split over the data-parallel ranks
        kwargs_handlers=handlers,
        dynamo_backend=backend,
    )
    model = make_model(kind)
    optimizer = make_optimizer("sgd", model.parameters())
    model, optimizer, data = accelerator.prepare(
        model, optimizer, loader(MICRO_BATCH * dp_size * accumulation)
    )
    COMPILED_CALLS.zero_()
    for x, y in data:
        for x_micro, y_micro in zip(x.chunk(accumulation), y.chunk(accumulation)):
            with accelerator.accumulate(model):
                if accelerator.parallelism.pp_size > 1:  # no rank holds the whole model: one call
                    accelerator.forward_backward(model, x_micro, y_micro, mean_loss)
                else:
                    accelerator.backward(model(x_micro, y_micro)[1])
                optimizer.step()
                optimizer.zero_grad()
    return accelerator, model, accelerator.get_state_dict(model)


def mean_loss(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    if not a:  # not the main process: get_state_dict gives it nothing
        return None
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def compiled_units(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def check_checkpoint(accelerator: Accelerator, eager: Accelerator, eager_model: nn.Module) -> dict:
    """save_state of the compiled run: no "_orig_mod" in any file; loads strictly into the eager model."""
    with tempfile.TemporaryDirectory() as scratch:
        shared = [scratch]
        dist.broadcast_object_list(shared, src=0)  # one directory for every process
        directory = Path(shared[0]) / "ckpt"
        accelerator.save_state(directory)
        accelerator.wait_for_everyone()
        files = [p for p in directory.rglob("*") if p.is_file()]
        renamed = any(b"_orig_mod" in p.read_bytes() for p in files)
        eager.load_state(directory, strict=True)
        loaded = eager.get_state_dict(eager_model)
        eager.wait_for_everyone()  # process 0's directory lives until every process read it
    return {"files": len(files), "orig_mod_in_files": renamed, "loaded": loaded}


def main() -> None:
    out = Path(sys.argv[1])
    state = PartialState(cpu=True)
    report = {"world": state.num_processes, "runs": {}}
    for run in RUNS:
        started = time.perf_counter()
        eager, eager_model, eager_state = train(run, None)
        eager_calls = COMPILED_CALLS.item()
        accelerator, model, compiled_state = train(run, "aot_eager")
        compiled_calls = COMPILED_CALLS.item()
        user_module = accelerator.unwrap_model(model)
        checkpoint_check = check_checkpoint(accelerator, eager, eager_model)
        loaded = checkpoint_check.pop("loaded")
        report["runs"][run] = {
            "max_abs_diff": max_diff(eager_state, compiled_state),
            "checkpoint_roundtrip_diff": max_diff(compiled_state, loaded),
            "eager_calls_compiled": eager_calls,
            "calls_compiled": compiled_calls,
            "compiled_units": compiled_units(user_module),
            "unwrapped_class_mro": [c.__name__ for c in type(user_module).__mro__],
            "orig_mod_in_keys": any(
                "_orig_mod" in key for key in [*compiled_state, *user_module.state_dict()]
            ),
            **checkpoint_check,
            "seconds": time.perf_counter() - started,
        }
    if state.is_main_process:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
