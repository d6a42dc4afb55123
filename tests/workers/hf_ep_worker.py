"""Launched worker: Hugging Face mixtures of experts under expert parallelism (unison.parallel.experts),
against one process.

Each family is built from a tiny config (no download; 4 experts, 2 per token) and trained STEPS
SGD+momentum steps with 2 accumulation micro-steps, gradient clipping and a scheduler that changes the
rate every step, under the run's layout (ep_size=2 on 2 processes; ep_size=2 beside dp_shard_size=4
on 4: two EP groups replicating each other, the rest ZeRO-3 over all 4); the same model trains in
process 0 (whose report is written), plain torch, on each step's whole batch. What each family's
experts exercise:

- mixtral: gate|up fused in one [experts, 2 x inner, hidden] tensor, the router's weights renormalised;
- qwen2_moe: beside a shared expert with its own sigmoid gate (dense, left to ZeRO);
- olmoe: q_norm / k_norm in attention, router weights not renormalised;
- gpt_moe: the MoE block of unison's own example (examples/gpt/model.py, n_experts=4);
- mixtral_one_sided: Mixtral with every token routed to the experts of one process of the EP group.

A family spec "mixtral+aux" also trains on the model's load-balancing loss (each process's over its own
micro-batch; the reference computes it over the same micro-batches). "save": DIR saves the trained state;
"load": DIR loads one saved under any layout and takes one more step, against the reference's four.

Arguments: the JSON report's path (written by process 0) and a JSON list of runs, each a dict: "name",
"layout", "families" (the family specs), and optionally "save", "load", "mixed_precision", "meta" (build
inside init_empty_weights()), "short_window" (end with a window of 1 micro-batch), "dynamo_backend"
(compile each block with it), "state" (write the trained model's full state to STATE.<family>.pt). The
runs share the launch (its process group): each builds its Accelerator anew (the state reset between
runs, as the combination matrix does). The report: {name: {family spec: result}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from hf_fidelity import ACCUMULATION, DECODER, SEED, SEQ, STEPS, VOCAB, make_optimizer, plain_step
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, PartialState, init_empty_weights
from unison.state import AcceleratorState, GradientState

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))
from model import GPT, GPTConfig  # noqa: E402  (the example's MoE block)

BATCH = 8
SHAPE = dict(**DECODER, num_experts_per_tok=2)
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
    "gpt_moe": lambda: GPT(
        GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, n_experts=4)
    ),
    "mixtral_one_sided": lambda: one_sided(FAMILIES["mixtral"]()),
}


def one_sided(model: torch.nn.Module) -> torch.nn.Module:
    """Each router zeroed and frozen: every token scores the 4 experts alike and goes to the same 2
    (torch.topk's pick among ties), so the other process of an EP group receives no token, and
    transformers' eager loop, which visits only the experts that got tokens, computes nothing there."""
    for name, parameter in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            parameter.data.zero_()
            parameter.requires_grad_(False)
    model.set_experts_implementation("eager")  # 5.24's default, grouped_mm, touches every weight anyway
    return model


AUX = 0.1
"""The load-balancing loss's weight in a family spec ending "+aux" (the model returns `aux_loss`)."""


def make(spec: str) -> torch.nn.Module:
    family, _, aux = spec.partition("+")
    torch.manual_seed(SEED)
    model = FAMILIES[family]()
    model.config.output_router_logits = aux == "aux"
    return model


def rows(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_dataset(short_window: bool = False) -> TensorDataset:
    """STEPS whole steps' rows; with short_window one micro-step's more over all processes, so the last
    accumulation window has 1 of its 2 micro-batches and is averaged over it, as one process does."""
    count = STEPS * BATCH + (BATCH // ACCUMULATION if short_window else 0)
    return TensorDataset(*rows(count, 3), torch.arange(count))


def loss_of(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, plus the load-balancing loss where the model returns it: computed by each process
    over its own micro-batch, as one process computes it over each micro-batch it accumulates."""
    output = model(ids)
    logits = output[0] if isinstance(output, tuple) else output.logits  # examples/gpt returns (logits, loss)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss if getattr(output, "aux_loss", None) is None else loss + AUX * output.aux_loss


def reference(
    spec: str, groups: list[list[list[int]]], extra: bool, short_window: bool
) -> tuple[dict, list[float]]:
    """One process, plain torch. groups[step]: the dataset rows of each micro-batch the processes ran in
    that step; the cross-entropy is the whole batch's mean either way, the load-balancing loss is each
    micro-batch's, averaged. extra: one more step on rows(BATCH, 5), as a resumed run takes."""
    model = make(spec)
    optimizer, scheduler = make_optimizer(model)
    ids, targets = make_dataset(short_window).tensors[:2]
    steps = [[(ids[g], targets[g]) for g in step] for step in groups]
    if extra:
        extra_ids, extra_targets = rows(BATCH, 5)
        steps.append([(extra_ids[i::2], extra_targets[i::2]) for i in range(2)])
    losses = []
    for micro_batches in steps:
        loss = sum(loss_of(model, i, t) for i, t in micro_batches) / len(micro_batches)
        losses.append(plain_step(loss, model, optimizer, scheduler))
    return model.state_dict(), losses


def micro_step(accelerator, model, optimizer, scheduler, ids, targets) -> float:
    with accelerator.accumulate(model):
        loss = loss_of(model, ids, targets)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return accelerator.reduce(loss.detach(), "mean").item()  # over the data-parallel ranks


def train(spec: str, run: dict) -> dict:
    """One family under run's layout and options, against the one-process reference."""
    save, load = (Path(run[key]) if run.get(key) else None for key in ("save", "load"))
    precision, meta, short_window = (
        run.get("mixed_precision", "no"),
        run.get("meta", False),
        run.get("short_window", False),
    )
    state_out = Path(run["state"]) if run.get("state") else None
    AcceleratorState._reset_state()  # one layout and precision per Accelerator: a new one for each
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True,
        parallelism=run["layout"],
        gradient_accumulation_steps=ACCUMULATION,
        mixed_precision=precision,
        dynamo_backend=run.get("dynamo_backend", "no"),
    )
    if meta:
        with init_empty_weights():
            model = make(spec)
    else:
        model = make(spec)
    optimizer, scheduler = make_optimizer(model)
    dp = accelerator.parallelism.dp_size
    loader = DataLoader(make_dataset(short_window), batch_size=BATCH // (ACCUMULATION * dp))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses: list[float] = []
    groups: list[list[list[int]]] = []
    if load is None:
        window: list[float] = []
        for ids, targets, held in loader:
            window.append(micro_step(accelerator, model, optimizer, scheduler, ids, targets))
            if len(window) == 1:
                groups.append([])
            # which rows each process's micro-batch held, for the reference's load-balancing loss
            groups[-1].extend(accelerator.gather(held[None]).tolist())
            if len(window) == ACCUMULATION:
                losses.append(sum(window) / ACCUMULATION)
                window = []
        if window:  # a short last window
            losses.append(sum(window) / len(window))
        if save is not None:
            accelerator.save_state(save / spec)
    else:
        accelerator.load_state(load / spec)
        ids, targets = rows(BATCH, 5)
        mine = slice(accelerator.process_index, None, dp)  # this process's rows, half per micro-step
        ids, targets = ids[mine], targets[mine]
        half = len(ids) // ACCUMULATION
        window = [
            micro_step(
                accelerator,
                model,
                optimizer,
                scheduler,
                ids[i * half : (i + 1) * half],
                targets[i * half : (i + 1) * half],
            )
            for i in range(ACCUMULATION)
        ]
        losses.append(sum(window) / ACCUMULATION)
        groups = [[list(range(r * BATCH, (r + 1) * BATCH))] for r in range(STEPS)]  # no aux on resume
    full = accelerator.get_state_dict(model)
    result: dict = {"steps": len(losses)}
    unwrapped = accelerator.unwrap_model(model)
    result["sharded_parameters"] = sum(hasattr(p, "placements") for p in unwrapped.parameters())
    # how many experts this process stores of each layer (the leading dimension of its local shards)
    result["experts_held"] = sorted(
        {
            (p.to_local() if hasattr(p, "placements") else p).shape[0]
            for n, p in unwrapped.named_parameters()
            if ".experts." in n
        }
    )
    if accelerator.is_main_process:  # the report is process 0's: the others need no reference
        if state_out is not None:
            torch.save(full, state_out.with_name(f"{state_out.name}.{spec}.pt"))
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            expected, expected_losses = reference(spec, groups, load is not None, short_window)
        expected_losses = expected_losses[-len(losses) :]
        result["loss_diff"] = max(abs(a - b) for a, b in zip(losses, expected_losses, strict=True))
        result["keys_match"] = sorted(full) == sorted(expected)
        result["max_abs_diff"] = max((full[k] - v).abs().max().item() for k, v in expected.items())
    return result


def main() -> None:
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    state = PartialState(cpu=True)
    report = {}
    for run in runs:
        report[run["name"]] = {spec: train(spec, run) for spec in run["families"]}
        if run.get("dynamo_backend", "no") != "no":
            torch._dynamo.reset()  # the next run's blocks are not this one's compiled code
    if state.is_main_process:
        out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
