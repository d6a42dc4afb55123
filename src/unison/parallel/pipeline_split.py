"""Pipeline parallelism, phase 1: cut a model into this rank's stage modules (`split_model`).

A stage module holds the ORIGINAL module objects of its part of the model (real `nn.Linear`s, so
`parallelize_module` and `fully_shard` work on them) under their original fully-qualified names, so the
stages' state dicts are the full model's state dict cut in pieces, and a DCP checkpoint moves between
layouts. Phase 2 (unison.parallel.pipeline: `build_pipeline`) runs the stages with torch's schedules.

Why not torch's tracer (`pipeline()` + SplitPoint)? It works on our GPT, but its stages are graphs of
aten ops (no `nn.Linear` left), so tensor parallel cannot be applied to them. Here each stage runs the
user's own `forward`, unchanged: modules of earlier stages are replaced by copies on the meta device
(shape-only, no memory, no compute), earlier blocks by a pass-through, the stage's first block takes
the activations received from the previous stage instead of its meta input, and the forward stops
where the next stage's first block is called, sending that block's positional arguments on. This works
for models whose blocks pass their activations on positionally (GPT-2, nanoGPT, our GPT example);
values computed before a split and handed to a later block by another route (a rotary table passed as
a keyword, a mask) are refused with an error.

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

logger = logging.getLogger("unison")


@dataclass(frozen=True)
class _Layout:
    """Where the model's pieces sit around its block list, in call order (= registration order)."""

    blocks: tuple[str, ...]  # "transformer.h.0", ...
    pre: tuple[str, ...]  # pieces registered before the block list: embeddings, dropout
    post: tuple[str, ...]  # pieces registered after it: final norm, head


def _layout(model: nn.Module) -> _Layout:
    found = find_blocks(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no block list (an nn.ModuleList/Sequential of one module class) "
            "to split into pipeline stages: keep the repeated layers in one ModuleList, as our GPT "
            "example does in transformer.h."
        )
    blocks_name, container = found
    order: list[str | None] = []  # piece paths in registration order, None where the blocks sit

    def walk(module: nn.Module, prefix: str) -> None:
        direct = [f"{prefix}{n}" for n in (*module._parameters, *module._buffers)]
        if direct:
            raise ValueError(
                f"{', '.join(direct)} belong directly to a module that contains the block list "
                f"{blocks_name!r}, so no single pipeline stage owns them: move them into a submodule."
            )
        for name, child in module.named_children():
            path = prefix + name
            if blocks_name.startswith(path + "."):
                walk(child, path + ".")
            else:
                order.append(None if path == blocks_name else path)

    walk(model, "")
    split = order.index(None)
    blocks = tuple(f"{blocks_name}.{name}" for name, _ in container.named_children())
    return _Layout(blocks=blocks, pre=tuple(order[:split]), post=tuple(order[split + 1 :]))


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


def _empty_like(module: nn.Module) -> nn.Module:
    """A copy of `module` without children and with its own (empty) hook tables: a container to refill."""
    clone = copy.copy(module)
    for key, value in vars(nn.Module()).items():
        clone.__dict__[key] = copy.copy(value)
    clone.training = module.training
    return clone


def _insert(root: nn.Module, path: str, module: nn.Module, source: nn.Module) -> None:
    """Put `module` at `path` under `root`, creating containers shaped like `source`'s on the way."""
    *parents, leaf = path.split(".")
    node, origin = root, source
    for part in parents:
        origin = getattr(origin, part)
        if part not in node._modules:
            node.add_module(part, _empty_like(origin))
        node = node._modules[part]
    node.add_module(leaf, module)


def _meta_copy(module: nn.Module) -> nn.Module:
    """`module` with its tensors on the meta device, built without copying any real storage."""
    memo: dict[int, Any] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    return copy.deepcopy(module, memo)


class _StageExit(BaseException):
    """Raised where the next stage's first block is called; args[0]: that block's positional inputs.

    A BaseException, as StopIteration's cousins GeneratorExit and KeyboardInterrupt are: it ends the
    stage's forward, it is no error, and a model's own `except Exception:` around its blocks (a
    fallback path, a logging wrapper) must not catch it and run on past the stage boundary."""


class _Exit(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> None:
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            raise ValueError(
                "a block at a pipeline split point is called with keyword or non-tensor arguments; only "
                "positional tensors can travel between stages. Pass the block's inputs positionally."
            )
        raise _StageExit(args)


class _PassThrough(nn.Module):
    """A block of an earlier stage: its (meta) input flows on unchanged."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


class _Absent(nn.Module):
    def __init__(self, path: str, stage: int):
        super().__init__()
        self.path, self.stage = path, stage

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{self.path} belongs to pipeline stage {self.stage} but ran before this stage ended: the "
            "model's forward does not call its pieces in registration order (embeddings, blocks, head), "
            "which pipeline splitting relies on."
        )


class _Live(nn.Module):
    """One of a later stage's own modules in the skeleton: the first block is fed the activations
    received from the previous stage; no module may get a meta tensor (a value of an earlier stage)."""

    def __init__(self, stage: _StageModule, path: str):
        super().__init__()
        # plain attributes, not children: the stage registers its modules under their own names
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "target", None)
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.path == self.stage._entry:
            args = self.stage._received
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
            raise ValueError(
                f"{self.path} on pipeline stage {self.stage.stage_index} gets a tensor computed before the "
                "stage's first block (e.g. a mask or rotary table made next to the embeddings): only the "
                "first block's positional inputs travel between stages. Compute it inside the blocks."
            )
        return self.target(*args, **kwargs)


class _StageModule(nn.Module):
    """One pipeline stage: this stage's original modules under their original names, and a forward
    that runs the model's own forward over a skeleton holding them (see the module docstring)."""

    def __init__(self, model: nn.Module, layout: _Layout, pieces: Sequence[Sequence[str]], stage_index: int):
        super().__init__()
        self.stage_index, self.num_stages = stage_index, len(pieces)
        self.pieces = tuple(pieces[stage_index])
        for path in self.pieces:
            _insert(self, path, model.get_submodule(path), model)
        self.tied: dict[str, _Tie] = {}
        # every tied weight's full-model names, over all stages (consolidation writes one copy)
        self.tied_names: list[tuple[str, ...]] = []
        owner = {path: s for s, paths in enumerate(pieces) for path in paths}
        first_block = {s: next(p for p in paths if p in layout.blocks) for s, paths in enumerate(pieces)}
        self._entry = first_block[stage_index] if stage_index > 0 else None
        # later stages check what reaches their modules (not children: they wrap modules of ours)
        guards = {path: _Live(self, path) for path in self.pieces} if stage_index > 0 else {}
        object.__setattr__(self, "_guards", guards)
        self._received: tuple[torch.Tensor, ...] = ()
        self._micro_inputs: tuple[torch.Tensor, ...] | None = None
        self._output_spec: Any = None
        skeleton = _empty_like(model)
        for path in (*layout.pre, *layout.blocks, *layout.post):
            if owner[path] == stage_index:
                stand_in = nn.Identity()  # replaced by the live module at every forward
            elif owner[path] < stage_index:  # meta copies compute the shapes the model's glue needs
                stand_in = _PassThrough() if path in layout.blocks else _meta_copy(model.get_submodule(path))
            elif path == first_block.get(stage_index + 1):
                stand_in = _Exit()
            else:
                stand_in = _Absent(path, owner[path])
            _insert(skeleton, path, stand_in, model)
        object.__setattr__(self, "_skeleton", skeleton)  # not a child: its meta copies are not ours

    def train(self, mode: bool = True) -> _StageModule:
        """nn.Module.train, for the skeleton too: it is not a child (see __init__), and its containers
        run the model's own forward, which may branch on `self.training` (eval() goes through here)."""
        super().train(mode)
        for module in self._skeleton.modules():
            module.training = mode
        return self

    def set_micro_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        """Shapes of one micro-batch of the model's inputs, for the meta run of earlier stages' pieces."""
        self._micro_inputs = tuple(torch.empty_like(t, device="meta") for t in inputs)

    def _place_live_modules(self) -> None:
        """Put this stage's current modules into the skeleton: a wrapper applied to one of them after
        the split (activation checkpointing, compile) replaces it here, and the skeleton must see it."""
        for path in self.pieces:
            parent_path, _, leaf = path.rpartition(".")
            live = self.get_submodule(path)
            if path in self._guards:
                object.__setattr__(self._guards[path], "target", live)
                live = self._guards[path]
            self._skeleton.get_submodule(parent_path)._modules[leaf] = live

    def forward(self, *args: torch.Tensor) -> Any:
        self._place_live_modules()
        if self._entry is None:
            inputs = args
        elif self._micro_inputs is None:
            raise RuntimeError("a later pipeline stage ran before set_micro_inputs: use PipelineModel.step")
        else:
            inputs, self._received = self._micro_inputs, args
        try:
            output = self._skeleton(*inputs)
        except _StageExit as boundary:
            sent = boundary.args[0]
            return sent[0] if len(sent) == 1 else sent
        finally:
            self._received = ()
        # torch sends and checks tensors only: hand over the tensors, rebuild the structure for loss_fn
        leaves, spec = tree_flatten(output)
        if any(leaf is not None and not isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise TypeError(
                f"the model returns {[type(v).__name__ for v in leaves]}; the last pipeline stage can "
                "return tensors and None (in any tuple/list/dict structure) only."
            )
        self._output_spec = (spec, [leaf is None for leaf in leaves])
        tensors = tuple(leaf for leaf in leaves if leaf is not None)
        return tensors[0] if len(tensors) == 1 else tensors

    def rebuild_output(self, stage_output: Any) -> Any:
        """The model's output structure (e.g. GPT's `(logits, None)`) from the tensors this stage returned."""
        tensors = iter(stage_output if isinstance(stage_output, tuple) else (stage_output,))
        spec, is_none = self._output_spec
        return tree_unflatten([None if none else next(tensors) for none in is_none], spec)


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
