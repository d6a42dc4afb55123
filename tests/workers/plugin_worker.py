"""Launched worker: Accelerate's FSDP / DeepSpeed plugins train as the layout they name.

Usage: plugin_worker.py OUT_JSON MODE, MODE one of
- "fsdp": Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(FULL_SHARD, transformer-based wrapping
  of the GPT's Block class), gradient_accumulation_steps=2);
- "deepspeed": Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=JSON file with ZeRO stage 2,
  gradient_accumulation_steps 2 and DeepSpeed tuning keys));
- "launcher": Accelerator() with no argument, under `unison launch --use_fsdp ...` flags.

Each trains the tiny GPT for STEPS optimizer steps (SGD with momentum; each micro-step's global batch
of GLOBAL_BATCH sequences split over the processes, under accelerator.accumulate), while every process
also trains the same model alone on the whole batches (the reference). Process 0 writes what the
Accelerator chose (layout, accumulation, precision), how the model was sharded, and the largest
difference between the two final state dicts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tiny_gpt import gpt_model, make_tiny_gpt
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from unison import Accelerator
from unison.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

STEPS, ACCUMULATION, GLOBAL_BATCH, BLOCK, SEED = 3, 2, 6, 8, 7


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(
        0, 32, (STEPS * ACCUMULATION, GLOBAL_BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(SEED)
    )
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def reference() -> dict[str, torch.Tensor]:
    model = make_tiny_gpt(SEED, BLOCK)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for i, (x, y) in enumerate(micro_batches()):
        (model(x, y)[1] / ACCUMULATION).backward()
        if (i + 1) % ACCUMULATION == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def accelerator_for(mode: str, out: Path) -> Accelerator:
    if mode == "fsdp":
        plugin = FullyShardedDataParallelPlugin(
            sharding_strategy="FULL_SHARD",
            auto_wrap_policy="TRANSFORMER_BASED_WRAP",
            transformer_cls_names_to_wrap=["Block"],
            state_dict_type="SHARDED_STATE_DICT",
        )
        return Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=ACCUMULATION)
    if mode == "deepspeed":
        config = out.with_suffix(".ds_config.json")
        config.write_text(
            json.dumps(
                {
                    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
                    "gradient_accumulation_steps": ACCUMULATION,
                    "train_micro_batch_size_per_gpu": "auto",
                    "bf16": {"enabled": "auto"},
                }
            )
        )
        return Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(config)))
    assert mode == "launcher", mode
    return Accelerator(cpu=True)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    accelerator = accelerator_for(mode, out)
    model = make_tiny_gpt(SEED, BLOCK)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    n, rank = accelerator.num_processes, accelerator.process_index
    share = GLOBAL_BATCH // n
    for x, y in micro_batches():
        with accelerator.accumulate(model):
            loss = model(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share])[1]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    state = accelerator.get_state_dict(model)
    user_module = accelerator.unwrap_model(model)
    record = {
        "layout": accelerator.parallelism.describe(),
        "zero_blocks": accelerator.parallelism.zero_blocks,
        "accumulation": accelerator.gradient_accumulation_steps,
        "mixed_precision": accelerator.mixed_precision,
        "optimizer_steps": accelerator.optimizer_steps,
        "dtensor_params": all(isinstance(p, DTensor) for p in user_module.parameters()),
        "sharded_blocks": sum(
            isinstance(m, FSDPModule) and isinstance(m, gpt_model.Block) for m in user_module.modules()
        ),
    }
    if accelerator.is_main_process:
        expected = reference()
        assert set(state) == set(expected), (sorted(state), sorted(expected))
        record["max_difference"] = max((state[k] - expected[k]).abs().max().item() for k in expected)
        out.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
