"""Launched by tests/test_context_parallel.py: train a tiny causal SDPA model under each layout given on the
command line (e.g. "cp_size=2" "dp_shard_size=2,cp_size=2") through Accelerator.prepare and
maybe_context_parallel, next to a single-process reference trained in this process on the global batch;
write what every rank saw to the JSON file named first.

The model takes its positions as an input (a buffer sharded with the tokens): a model that builds
`arange(T)` itself would number each rank's part of the sequence from 0.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from unison import Accelerator

VOCAB, WIDTH, HEADS, SEQ, SAMPLES, PER_RANK_BATCH, STEPS = 32, 32, 4, 16, 16, 2, 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # view(B, T, -1, head_dim): under tensor parallel a rank holds HEADS / tp heads
        q, k, v = (
            p(x).view(B, T, -1, WIDTH // HEADS).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, 2 * WIDTH)
        self.down_proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Llama's module names, so the built-in tensor-parallel plan applies."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.self_attn, self.mlp = Attention(), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinySdpaModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm, self.lm_head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx) + self.wpe(pos)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def make_model() -> TinySdpaModel:
    torch.manual_seed(0)
    return TinySdpaModel()


def dataset() -> torch.Tensor:
    """SAMPLES sequences of SEQ + 1 tokens (inputs and next-token targets), the same on every rank."""
    return torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(1))


def loss_of(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def targets_of(rows: torch.Tensor, items: bool) -> torch.Tensor:
    """Next tokens; with `items`, those below 4 are ignored (-100), so ranks count different numbers."""
    targets = rows[:, 1:].clone()
    if items:
        targets[targets < 4] = -100
    return targets


def reference(dp_size: int, items: bool) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, the global batch (every data-parallel rank's rows) per step, whole sequences."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    data = dataset()
    losses, norms = [], []
    for step in range(STEPS):
        rows = data[step * PER_RANK_BATCH * dp_size : (step + 1) * PER_RANK_BATCH * dp_size]
        pos = torch.arange(SEQ).expand(rows.shape[0], SEQ)
        loss = loss_of(model(rows[:, :-1], pos), targets_of(rows, items))  # mean over kept tokens
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def run(name: str) -> dict:
    """Train under the layout `name` ("LAYOUT" or "LAYOUT+items": a summed loss with num_items)."""
    start = time.perf_counter()
    layout, _, items = name.partition("+")
    accelerator = Accelerator(parallelism=layout)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=PER_RANK_BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    result: dict = {"cp_rank": accelerator.context_parallel_rank, "losses": [], "batches": [], "norms": []}
    for step, rows in enumerate(loader):
        if step == STEPS:
            break
        idx, targets = rows[:, :-1].clone(), targets_of(rows, bool(items))
        pos = torch.arange(SEQ).expand(rows.shape[0], SEQ).clone()
        result["batches"].append(rows[:, 0].tolist())
        with accelerator.maybe_context_parallel(buffers=[idx, targets, pos], buffer_seq_dims=[1, 1, 1]):
            local_shape = list(idx.shape)
            if items:  # the sum over this rank's part of the sequences, and its own count
                loss = loss_of(model(idx, pos), targets, "sum")
                accelerator.backward(loss, num_items=(targets != -100).sum())
            else:
                loss = loss_of(model(idx, pos), targets)
                accelerator.backward(loss)
        result["local_shape"] = local_shape
        result["restored_shape"] = list(idx.shape)  # the buffers are whole again after the block
        result["norms"].append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())  # it clips
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(accelerator.reduce(loss.detach(), "mean").item())
    # outside the block every cp rank holds the whole batch: a gather keeps one rank per cp group
    result["gathered_rows"] = len(accelerator.gather(rows[:, 0]))
    result["dp_size"] = accelerator.parallelism.dp_size
    state = accelerator.get_state_dict(model)
    want, result["want_losses"], result["want_norms"] = reference(
        accelerator.parallelism.dp_size, bool(items)
    )
    if state:  # the full state (every rank asks; process 0 may be the only one holding it)
        result["keys_match"] = sorted(state) == sorted(want)
        result["max_abs_diff"] = max((state[k].float() - want[k]).abs().max().item() for k in want)
    result["uneven_error"] = uneven_sequence_error(accelerator)
    result["seconds"] = time.perf_counter() - start
    return result


def uneven_sequence_error(accelerator: Accelerator) -> str | None:
    """maybe_context_parallel with a sequence that does not split evenly: the error every rank raises."""
    try:
        with accelerator.maybe_context_parallel(buffers=[torch.zeros(2, SEQ + 1)], buffer_seq_dims=[1]):
            pass
    except ValueError as error:
        return str(error)
    return None


def main() -> None:
    out, layouts = sys.argv[1], sys.argv[2:]
    results = {layout: run(layout) for layout in layouts}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"ranks": everyone}, f)


if __name__ == "__main__":
    main()
