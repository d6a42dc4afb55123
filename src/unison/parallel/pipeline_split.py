"""Pipeline parallelism, phase 1: cut a model into this rank's stage modules (`split_model`).

A stage module holds the ORIGINAL module objects of its part of the model (real `nn.Linear`s, so
`parallelize_module` and `fully_shard` work on them) under their original fully-qualified names, so the
stages' state dicts are the full model's state dict cut in pieces, and a DCP checkpoint moves between
layouts. Phase 2 (unison.parallel.pipeline: `build_pipeline`) runs the stages with torch's schedules.

How a stage runs: torchtitan's way, made to work on models we did not write. Each stage keeps its own
copy of the model's containers (`copy.deepcopy` of the model with the pieces memoised, so the copy
shares the pieces and copies only the containers: the root, `transformer`, `model`, the config) in
which the other stages' layers are missing, and runs the model's OWN forward on it, in the model's
own order, once per micro-batch:

- the block list holds this stage's blocks only, under their original names, and iterating it (or
  slicing it, as Hugging Face's `self.layers[: config.num_hidden_layers]` does) yields them alone: the
  model's loop skips the other stages' blocks, as torchtitan's models skip deleted layers;
- the stage's first block is called with the activations received from the previous stage in place
  of the tensors among its positional arguments; where the next stage's first block would be called,
  the forward stops and the tensors among that call's positional arguments are sent on;
- everything the model computes before its blocks from its inputs alone is RECOMPUTED on every stage:
  each stage gets the micro-batch's model inputs (torch's schedules hand keyword arguments to every
  stage), and the parameter-free modules (rotary embeddings, dropout) are on every stage. So the rotary
  tables, causal masks and position ids that Hugging Face decoders pass to every block by keyword cost
  a few element-wise ops per stage and no communication;
- another stage's modules that hold weights are stand-in functions, not modules (they are absent from
  the stage's `named_modules()` and state dict): on a later stage an embedding's stand-in returns NaN
  shaped like the received activations, on an earlier stage the head's stand-in raises.

The NaN stand-in makes the one case that cannot work loud instead of silently wrong: a value computed
before the blocks FROM THE EMBEDDINGS' OUTPUT and handed to a later stage's blocks (only the positional
arguments of the call at the split travel) is NaN there, which the first forward of every later stage
checks for and refuses with an error naming the block and the argument.

Why not torch's tracer (`pipeline()` + SplitPoint)? Its stages are graphs of aten ops (no `nn.Linear`
left), so tensor parallel cannot be applied to them. And why not torchtitan's model code as it is? It
needs a forward written to tolerate missing layers (`if self.tok_embeddings`), which Hugging Face's and
users' models are not.

Weights that several stages hold (a tied embedding) are recorded on each stage module (`tied`), so that
phase 2 can sum their gradients over the ranks that hold them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from unison.parallel.blocks import find_blocks
from unison.parallel.config import PP_SCHEDULES
from unison.parallel.stage_blocks import StageBlockList, StageBlockSequential, StageExit, StageRun

logger = logging.getLogger("unison")


@dataclass(frozen=True)
class _Layout:
    """The model's pieces around its block list: the blocks, the pieces that hold state (weights or
    persistent buffers) registered before and after the list, and the stateless ones (every stage's)."""

    container: str  # "transformer.h"
    blocks: tuple[str, ...]  # "transformer.h.0", ...
    pre: tuple[str, ...]  # stateful pieces registered before the block list: embeddings
    post: tuple[str, ...]  # stateful pieces registered after it: final norm, head
    stateless: tuple[str, ...]  # rotary embeddings, dropout: on every stage


def _has_state(module: nn.Module) -> bool:
    return len(module.state_dict(keep_vars=True)) > 0


def _layout(model: nn.Module) -> _Layout:
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model (config.is_encoder_decoder), which pipeline "
            "parallelism does not split: its stages would be one stack of blocks, but the decoder's blocks "
            "also take the encoder's output. Train it with ZeRO (parallelism='dp_shard_size=N') or tensor "
            "parallelism, or pipeline a decoder-only model."
        )
    found = find_blocks(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no block list (an nn.ModuleList/Sequential of one module class) "
            "to split into pipeline stages: keep the repeated layers in one ModuleList, as our GPT "
            "example does in transformer.h."
        )
    blocks_name, container = found
    order: list[str | None] = []  # stateful piece paths in registration order, None where the blocks sit
    stateless: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        state = module.state_dict(keep_vars=True)
        children = {name for name, _ in module.named_children()}
        direct = [f"{prefix}{key}" for key in state if key.split(".")[0] not in children]
        if direct:
            raise ValueError(
                f"{', '.join(direct)} belong directly to a module that contains the block list "
                f"{blocks_name!r}, so no single pipeline stage owns them: move them into a submodule."
            )
        for name, child in module.named_children():
            path = prefix + name
            if blocks_name.startswith(path + "."):
                walk(child, path + ".")
            elif path == blocks_name:
                order.append(None)
            elif _has_state(child):
                order.append(path)
            else:
                stateless.append(path)

    walk(model, "")
    split = order.index(None)
    blocks = tuple(f"{blocks_name}.{name}" for name, _ in container.named_children())
    return _Layout(
        container=blocks_name,
        blocks=blocks,
        pre=tuple(order[:split]),
        post=tuple(order[split + 1 :]),
        stateless=tuple(stateless),
    )


def _balance(weights: Sequence[int], parts: int) -> list[int]:
    """Start indices of `parts` contiguous, non-empty groups of `weights` with the smallest maximum sum."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max-load of the first i weights cut into k groups; cut[k][i]: last group's start
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i], cut[k][i] = load, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def _stage_starts(
    model: nn.Module, layout: _Layout, num_stages: int, split_points: Sequence[str] | None
) -> list[int]:
    """Index of the first block of every stage."""
    blocks = layout.blocks
    if num_stages > len(blocks):
        raise ValueError(
            f"{num_stages} pipeline stages but the model has {len(blocks)} blocks ({blocks[0]} ... "
            f"{blocks[-1]}): every stage needs at least one block. Use at most {len(blocks)} stages."
        )
    if split_points is None:
        # a tied weight counts on every piece that holds it: each of their stages stores a copy
        def size(paths: Sequence[str]) -> int:
            return sum(p.numel() for path in paths for p in model.get_submodule(path).parameters())

        weights = [size([block]) for block in blocks]
        weights[0] += size(layout.pre)
        weights[-1] += size(layout.post)
        return _balance(weights, num_stages)
    starts = [0]
    for name in split_points:
        if name not in blocks[1:]:
            raise ValueError(
                f"split point {name!r} is not a block where a stage can begin: pass names of blocks "
                f"{blocks[1]} ... {blocks[-1]} (the first block, {blocks[0]}, always starts stage 0)."
            )
        index = blocks.index(name)
        if index <= starts[-1]:
            raise ValueError(
                f"split points {list(split_points)} are not in model order without repeats: list each "
                "block where a new stage begins once, first to last."
            )
        starts.append(index)
    return starts


@dataclass(frozen=True)
class _Tie:
    """A weight that several stages hold (a tied embedding): `key` names it the same on every rank."""

    key: str
    stages: tuple[int, ...]


def _ties(model: nn.Module, pieces_by_stage: Sequence[Sequence[str]]) -> dict[tuple[int, str], _Tie]:
    """(stage, local parameter name) -> tie, for parameters held by more than one stage."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for stage, pieces in enumerate(pieces_by_stage):
        for path in pieces:
            for name, param in model.get_submodule(path).named_parameters(remove_duplicate=False):
                holders.setdefault(id(param), []).append((stage, f"{path}.{name}"))
    ties = {}
    for entries in holders.values():
        stages = tuple(sorted({stage for stage, _ in entries}))
        if len(stages) > 1:
            tie = _Tie(key=entries[0][1], stages=stages)
            ties.update({entry: tie for entry in entries})
    return ties


class _EarlierStandIn:
    """Stands for a module of an earlier stage that holds weights (an embedding) on a later stage.

    Its output only feeds the model's code before the blocks (shapes, dtypes, devices for positions,
    masks, rotary tables): the stage's first block gets the received activations instead. NaN marks
    anything computed from it, so a value that depends on it and reaches a block is caught."""

    def __init__(self, path: str, run: StageRun):
        self.path, self.run = path, run

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.run.entered:
            raise RuntimeError(
                f"{self.path} holds weights and is registered before the block list, so it belongs to "
                "pipeline stage 0, but the model's forward calls it after its blocks (stages own such "
                "modules by registration order: before the block list, the first stage; after it, the "
                f"last). Register {self.path} after the block list, or use a separate module for a "
                "second use after the blocks."
            )
        like = self.run.received[0]
        return torch.full_like(like, float("nan")) if like.is_floating_point() else torch.zeros_like(like)


class _LaterStandIn:
    """Stands for a module of a later stage (the final norm, the head) on an earlier stage: the
    forward must end (at the next stage's first block) before it is reached."""

    def __init__(self, path: str, stage: int):
        self.path, self.stage = path, stage

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{self.path} belongs to pipeline stage {self.stage} but ran before this stage ended: the "
            "model's forward calls a module that holds weights and is registered after the block list "
            "before its blocks, which pipeline splitting cannot serve. Register it before the block list."
        )


class _ModelRoot:
    """Holds the stage's copy of the model's root module without making it a child: its children are
    the stage's own (registered on the stage under their original names), the root only runs forward."""

    def __init__(self, module: nn.Module):
        self.module = module


def _stage_copy(
    model: nn.Module, layout: _Layout, owner: dict[str, int], stage_index: int, run: StageRun
) -> nn.Module:
    """The model's containers, copied, holding this stage's pieces (the model's own objects), the
    stateless pieces, this stage's blocks in a block list of ours, and stand-ins for the rest."""
    original = model.get_submodule(layout.container)
    kind = StageBlockSequential if isinstance(original, nn.Sequential) else StageBlockList
    keys = [name for name, _ in original.named_children()]
    own = {i: name for i, name in enumerate(keys) if owner[layout.blocks[i]] == stage_index}
    successor = max(own) + 1 if max(own) + 1 < len(keys) else None
    blocks = kind(
        {name: original.get_submodule(name) for name in own.values()},
        positions=list(own),
        total=len(keys),
        run=run,
        path=layout.container,
        successor=None if successor is None else original.get_submodule(keys[successor]),
        successor_path=None if successor is None else layout.blocks[successor],
    )
    memo: dict[int, Any] = {id(original): blocks}
    stand_ins: dict[str, Any] = {}
    for path in (*layout.pre, *layout.post, *layout.stateless):
        piece = model.get_submodule(path)
        if path in layout.stateless or owner[path] == stage_index:
            memo[id(piece)] = piece
        else:
            memo[id(piece)] = None  # an empty child slot in the copy, replaced below by a stand-in
            stand_ins[path] = (
                _EarlierStandIn(path, run) if owner[path] < stage_index else _LaterStandIn(path, owner[path])
            )
    for path in layout.blocks:  # a block referenced from elsewhere in the model is never copied
        memo.setdefault(id(model.get_submodule(path)), None)
    clone = copy.deepcopy(model, memo)
    for path, stand_in in stand_ins.items():
        parent_path, _, leaf = path.rpartition(".")
        parent = clone.get_submodule(parent_path)
        delattr(parent, leaf)  # a plain attribute now: called by the forward, not a module of the stage
        setattr(parent, leaf, stand_in)
    return clone


class _StageModule(nn.Module):
    """One pipeline stage: this stage's modules under their original names, and a forward that runs
    the model's own forward on the stage's copy of the model (see the module docstring).

    forward(*received, inputs=(model inputs of the micro-batch)): the first stage receives nothing."""

    def __init__(self, model: nn.Module, layout: _Layout, pieces: Sequence[Sequence[str]], stage_index: int):
        super().__init__()
        self.stage_index, self.num_stages = stage_index, len(pieces)
        self.pieces = tuple(pieces[stage_index])
        self.tied: dict[str, _Tie] = {}
        # every tied weight's full-model names, over all stages (consolidation writes one copy)
        self.tied_names: list[tuple[str, ...]] = []
        owner = {path: s for s, paths in enumerate(pieces) for path in paths}
        self._run = StageRun(stage_index)
        root = _stage_copy(model, layout, owner, stage_index, self._run)
        self._root = _ModelRoot(root)
        for name, child in root.named_children():
            self.add_module(name, child)
        self._output_spec: Any = None

    @property
    def root_module(self) -> nn.Module:
        """The stage's copy of the user's root module (its class and attributes, such as a Hugging Face
        model's `config`); it holds this stage's pieces and stand-ins for the others."""
        return self._root.module

    def train(self, mode: bool = True) -> _StageModule:
        """nn.Module.train, for the copy's root too: it is not a child (see _ModelRoot), and the model's
        own forward may branch on `self.training` (eval() goes through here)."""
        super().train(mode)
        self._root.module.training = mode
        return self

    def forward(self, *received: torch.Tensor, inputs: Sequence[torch.Tensor] = ()) -> Any:
        run = self._run
        if self.stage_index > 0 and not received:
            raise RuntimeError(
                f"pipeline stage {self.stage_index} ran without activations from stage "
                f"{self.stage_index - 1}: run the stages through build_pipeline's PipelineModel.step."
            )
        run.start(received)
        try:
            output = self._root.module(*inputs)
        except StageExit as boundary:
            sent = boundary.args[0]
            run.finish()
            return sent[0] if len(sent) == 1 else sent
        finally:
            run.stop()
        if self.stage_index < self.num_stages - 1:
            raise RuntimeError(
                f"the model's forward ended on pipeline stage {self.stage_index} without calling the next "
                "stage's first block: the forward must call its blocks by iterating the block list."
            )
        run.finish()
        # torch sends and checks tensors only: hand over the tensors, keep the rest to rebuild the output
        leaves, spec = tree_flatten(output)
        self._output_spec = (spec, [None if isinstance(leaf, torch.Tensor) else (leaf,) for leaf in leaves])
        tensors = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        return tensors[0] if len(tensors) == 1 else tensors

    def rebuild_output(self, stage_output: Any) -> Any:
        """The model's output structure (GPT's `(logits, None)`, a Hugging Face `CausalLMOutputWithPast`)
        from the tensors this stage returned; leaves that are not tensors are those of the last forward."""
        tensors = iter(stage_output if isinstance(stage_output, tuple) else (stage_output,))
        spec, others = self._output_spec
        return tree_unflatten([next(tensors) if other is None else other[0] for other in others], spec)


def _check_schedule(schedule: str) -> None:
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is unknown: use one of {', '.join(PP_SCHEDULES)}.")


def split_model(
    model: nn.Module,
    pp_rank: int,
    pp_size: int,
    split_points: Sequence[str] | None = None,
    schedule: str = "1f1b",
    num_stages: int | None = None,
) -> list[tuple[int, nn.Module]]:
    """This rank's pipeline stages as (stage index, stage module), stage s living on rank s % pp_size.

    split_points: names of the blocks where a new stage begins (e.g. ["transformer.h.1"]); None
        balances the blocks over the stages by parameter count (the embeddings counted with the first
        block, the head with the last).
    num_stages: pp_size for "gpipe" and "1f1b"; for "interleaved" a multiple of pp_size (default
        2 * pp_size). With split_points it is len(split_points) + 1.

    Call it with the same arguments on every rank (the split is a pure function of them). The modules
    are the model's own objects, not copies: apply tensor parallel or FSDP2 to each stage module, then
    pass the list to `build_pipeline`. The full model is left intact; drop your reference to it (and
    build the optimizer from the stages' parameters) so the other stages' weights can be freed.
    A wrapper applied to a block after the split (activation checkpointing, compile) replaces it by
    name in the stage's block list: `blocks.register_module(name, wrapped)` over `named_children()`.
    """
    _check_schedule(schedule)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{pp_size - 1} for pp_size={pp_size}.")
    if split_points is not None:
        if num_stages not in (None, len(split_points) + 1):
            raise ValueError(
                f"num_stages={num_stages} contradicts {len(split_points)} split points (which make "
                f"{len(split_points) + 1} stages): give one or the other."
            )
        num_stages = len(split_points) + 1
    elif num_stages is None:
        num_stages = 2 * pp_size if schedule == "interleaved" else pp_size
    if schedule == "interleaved" and num_stages % pp_size:
        raise ValueError(
            f"the interleaved schedule runs {num_stages} stages on {pp_size} pipeline ranks: the stage "
            f"count must be a multiple of pp_size. Use e.g. {2 * pp_size} stages ({2 * pp_size - 1} "
            "split points)."
        )
    if schedule != "interleaved" and num_stages != pp_size:
        raise ValueError(
            f"the {schedule!r} schedule runs one stage per rank, but {num_stages} stages were asked for "
            f"on pp_size={pp_size}: give {pp_size - 1} split points, or use schedule='interleaved'."
        )
    layout = _layout(model)
    starts = _stage_starts(model, layout, num_stages, split_points)
    ends = [*starts[1:], len(layout.blocks)]
    pieces = [layout.blocks[b:e] for b, e in zip(starts, ends)]
    pieces[0] = (*layout.pre, *pieces[0])
    pieces[-1] = (*pieces[-1], *layout.post)
    stages = [_StageModule(model, layout, pieces, s) for s in range(num_stages) if s % pp_size == pp_rank]
    ties = _ties(model, pieces)
    groups: dict[str, set[str]] = {}
    for (_, name), tie in ties.items():
        groups.setdefault(tie.key, set()).add(name)
    tied_names = [tuple(sorted(names)) for names in groups.values()]
    for stage in stages:
        stage.tied = {name: tie for (s, name), tie in ties.items() if s == stage.stage_index}
        stage.tied_names = tied_names
    logger.debug(
        "pipeline split: %s",
        "; ".join(f"stage {s}: {', '.join(paths)}" for s, paths in enumerate(pieces)),
    )
    return [(stage.stage_index, stage) for stage in stages]
