"""Pipeline parallelism: a model cut into stages, run by torch.distributed.pipelining's schedules.

Two phases, so that tensor parallel or FSDP2 can be applied to each stage in between (torchtitan's
order: pipeline split, then TP, then FSDP):

1. `split_model(model, pp_rank, pp_size, ...)` returns this rank's stage modules. A stage module holds
   the ORIGINAL module objects of its part of the model (real `nn.Linear`s, so `parallelize_module` and
   `fully_shard` work on them) under their original fully-qualified names, so the stages' state dicts
   are the full model's state dict cut in pieces, and a DCP checkpoint moves between layouts.
2. `build_pipeline(stages, pp_group, ...)` wraps them in torch `PipelineStage`s and a schedule (GPipe,
   1F1B, interleaved 1F1B) and returns a `PipelineModel` whose `step(inputs, target, loss_fn)` runs
   forward and backward of all micro-batches and returns the loss on every rank of the pipeline.

Why not torch's tracer (`pipeline()` + SplitPoint)? It works on our GPT, but its stages are graphs of
aten ops (no `nn.Linear` left), so tensor parallel cannot be applied to them. Here each stage runs the
user's own `forward`, unchanged: modules of earlier stages are replaced by copies on the meta device
(shape-only, no memory, no compute), earlier blocks by a pass-through, the stage's first block takes
the activations received from the previous stage instead of its meta input, and the forward stops
where the next stage's first block is called, sending that block's positional arguments on. This works
for models whose blocks pass their activations on positionally (GPT-2, nanoGPT, our GPT example);
values computed before a split and handed to a later block by another route (a rotary table passed as
a keyword, a mask) are refused with an error.

Tied weights (GPT's `wte.weight` is `lm_head.weight`) live on the first and the last stage; after each
step their gradients are summed over the ranks that hold them (as Megatron does), so both copies
receive the same update as the single tied parameter of the plain model.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from unison.parallel.blocks import find_blocks
from unison.parallel.config import PP_SCHEDULES

logger = logging.getLogger("unison")

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def pipeline_bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe/1F1B step with p stages and m micro-batches: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


# ----------------------------------------------------------------------------------------------------
# Phase 1: split


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


class _StageExit(Exception):
    """Raised where the next stage's first block is called; args[0]: that block's positional inputs."""


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
    for stage in stages:
        stage.tied = {name: tie for (s, name), tie in ties.items() if s == stage.stage_index}
    logger.debug(
        "pipeline split: %s",
        "; ".join(f"stage {s}: {', '.join(paths)}" for s, paths in enumerate(pieces)),
    )
    return [(stage.stage_index, stage) for stage in stages]


# ----------------------------------------------------------------------------------------------------
# Phase 2: schedule


def _unwrap(module: nn.Module) -> _StageModule:
    if isinstance(module, DistributedDataParallel):
        raise TypeError(
            "DistributedDataParallel around a pipeline stage does not work with torch's schedules (on "
            "torch 2.13 its reducer fails on the schedule's shape-inference pass, or with static_graph "
            "gives wrong gradients). Replicate stages with FSDP2 instead: "
            "fully_shard(stage, mesh=dp_mesh), on a 2-D (dp_replicate, dp_shard) mesh for pure replication."
        )
    if not isinstance(module, _StageModule):
        raise TypeError(
            f"build_pipeline got a {type(module).__name__}, not a stage made by split_model: pass the "
            "(stage_index, module) pairs split_model returned (after tensor parallel / fully_shard)."
        )
    return module


class PipelineModel(nn.Module):
    """This rank's pipeline stages, trained through `step` (forward + backward of every micro-batch).

    `parameters()`, `state_dict()` and `load_state_dict()` cover this rank's stages with the model's
    original names, so the union over the pipeline ranks is the full model's state dict. Calling the
    model directly is refused: a pipeline cannot return one rank's forward output on every rank.
    """

    def __init__(
        self,
        stages: Sequence[_StageModule],
        schedule: Any,
        group: dist.ProcessGroup,
        microbatches: int,
        device: torch.device,
        tie_groups: Sequence[tuple[list[torch.Tensor], dist.ProcessGroup]],
        norm_excluded: set[int],
    ):
        super().__init__()
        self.stage_modules = list(stages)  # a list, not children: each module is registered once, below
        for stage in self.stage_modules:
            for path in stage.pieces:
                _insert(self, path, stage.get_submodule(path), stage)
        self.schedule = schedule
        self.microbatches = microbatches
        self._group, self._device = group, device
        self._tie_groups, self._norm_excluded = tie_groups, norm_excluded
        self._loss_fn: LossFn | None = None
        self._loss_scale = 1.0
        self._losses: list[torch.Tensor] = []
        self._shapes: tuple[bool, tuple] | None = None  # (training?, shapes) the schedule was sized for

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a pipeline-parallel model cannot be called directly: each rank holds only some stages. Use "
            "loss = model.step(inputs, target, loss_fn) (accelerator.forward_backward) to train and "
            "model.evaluate(inputs, target, loss_fn) for a forward-only loss."
        )

    def norm_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, a tied weight kept on one rank only: summing the squared gradient
        norms of these over the pipeline ranks counts every weight of the model once (for clipping)."""
        return (p for p in self.parameters() if id(p) not in self._norm_excluded)

    def step(
        self, inputs: Any, target: torch.Tensor, loss_fn: LossFn, *, divide_by: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward of all micro-batches; returns the mean loss (detached) on every rank.

        inputs: the model's positional input (a tensor or a tuple of tensors), the whole batch, on
            every pipeline rank (the first stage reads it, the others take its shapes).
        loss_fn(output, target): output as the model returns it (GPT: `(logits, None)`), mean-reduced.
        divide_by: gradients become those of mean_loss / divide_by (gradient accumulation); the
            returned loss is not divided. Gradients accumulate into `.grad` across calls.
        """
        inputs = self._prepare(inputs, target, loss_fn, training=True)
        self._loss_scale = 1.0 / (self.microbatches * divide_by)
        held = [[self._detach_grad(p) for p in params] for params, _ in self._tie_groups]
        self.schedule.step(*inputs, target=target)
        for (params, group), previous in zip(self._tie_groups, held):
            for param, before in zip(params, previous):
                self._sum_tied_grad(param, before, group)
        return self._mean_loss()

    @torch.no_grad()
    def evaluate(self, inputs: Any, target: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """Forward only (torch's `schedule.eval`): the mean loss over micro-batches on every rank."""
        inputs = self._prepare(inputs, target, loss_fn, training=False)
        self.schedule.eval(*inputs, target=target)
        return self._mean_loss()

    def _prepare(self, inputs: Any, target: torch.Tensor, loss_fn: LossFn, training: bool) -> tuple:
        """Checks (the same verdict on every rank, before any communication) and the micro-batch shapes."""
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        m = self.microbatches
        for name, tensor in [*((f"inputs[{i}]", t) for i, t in enumerate(inputs)), ("target", target)]:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                raise TypeError(f"{name} must be a batched tensor, got {type(tensor).__name__}.")
            if tensor.shape[0] % m:
                raise ValueError(
                    f"{name} has batch size {tensor.shape[0]}, not divisible into {m} micro-batches: use a "
                    f"batch size that is a multiple of {m} (drop_last=True for the data loader)."
                )
        shapes = tuple(tuple(t.shape) for t in (*inputs, target))
        if self._shapes is not None and self._shapes[0] == training and self._shapes[1] != shapes:
            raise ValueError(
                f"batch shapes {shapes} differ from {self._shapes[1]} of the previous "
                f"{'step' if training else 'evaluate'} call: the pipeline's send/receive buffers are "
                "sized on the first call. Keep batch shapes fixed (drop_last=True, fixed sequence length)."
            )
        self._shapes = (training, shapes)
        micro = tuple(t[: t.shape[0] // m] for t in inputs)
        for stage in self.stage_modules:
            stage.set_micro_inputs(micro)
        self._loss_fn = loss_fn
        self._losses.clear()
        return inputs

    def _loss(self, stage_output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the user's, on the model's own output structure, scaled so the
        summed micro-batch gradients are those of the batch mean (torch's scale_grads would also
        divide gradients accumulated by earlier calls)."""
        loss = self._loss_fn(self.stage_modules[-1].rebuild_output(stage_output), target)
        value = loss.detach()
        self._losses.append(value.full_tensor() if hasattr(value, "full_tensor") else value)  # loss_parallel
        return loss * self._loss_scale

    def _mean_loss(self) -> torch.Tensor:
        """Mean of this call's micro-batch losses, broadcast from the last stage's rank."""
        result = torch.zeros((), dtype=torch.float32, device=self._device)
        if self.stage_modules[-1].stage_index == self.stage_modules[-1].num_stages - 1:
            # the schedule's shape inference calls the loss once more on its first call: take the last m
            result.copy_(torch.stack(self._losses[-self.microbatches :]).mean())
        dist.broadcast(result, group=self._group, group_src=dist.get_world_size(self._group) - 1)
        return result

    @staticmethod
    def _detach_grad(param: torch.Tensor) -> torch.Tensor | None:
        """Take the gradient accumulated so far off a tied weight, so only this call's part is summed."""
        before, param.grad = param.grad, None
        return before

    @staticmethod
    def _sum_tied_grad(param: torch.Tensor, before: torch.Tensor | None, group: dist.ProcessGroup) -> None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # a view
        dist.all_reduce(grad, group=group)
        if before is not None:
            param.grad.add_(before)


def build_pipeline(
    stages: Sequence[tuple[int, nn.Module]],
    pp_group: dist.ProcessGroup | DeviceMesh | None,
    schedule: str = "1f1b",
    microbatches: int = 1,
    device: torch.device | str | None = None,
) -> PipelineModel:
    """Wrap this rank's stages (from `split_model`, possibly after TP / fully_shard) in a schedule.

    pp_group: the pipeline dimension (a 1-D DeviceMesh such as mesh["pp"], a ProcessGroup, or None for
        the whole world). Collective: every rank of the pipeline calls it.
    schedule: "gpipe" (fill-drain), "1f1b" (one forward one backward: at most pp_size micro-batches'
        activations alive; with fewer micro-batches than stages it runs GPipe, which then keeps no more)
        or "interleaved" (several stages per rank, smaller bubble).
    microbatches: m micro-batches per step; m=1 is naive model parallelism.
    """
    _check_schedule(schedule)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r}: give a whole number >= 1.")
    group = pp_group.get_group() if isinstance(pp_group, DeviceMesh) else (pp_group or dist.group.WORLD)
    pp_rank, pp_size = dist.get_rank(group), dist.get_world_size(group)
    stages = sorted(stages, key=lambda pair: pair[0])
    inner = [_unwrap(module) for _, module in stages]
    num_stages = inner[0].num_stages
    expected = list(range(pp_rank, num_stages, pp_size))
    if [index for index, _ in stages] != expected or any(
        s.stage_index != i for s, (i, _) in zip(inner, stages)
    ):
        raise ValueError(
            f"pipeline rank {pp_rank} of {pp_size} holds stages {[i for i, _ in stages]}, but stage s of "
            f"{num_stages} lives on rank s % {pp_size}: expected {expected}. Split with this rank's "
            "pp_rank and pp_size."
        )
    if schedule != "interleaved" and len(stages) != 1:
        raise ValueError(
            f"the {schedule!r} schedule runs one stage per rank, this rank has {len(stages)}: split with "
            f"schedule={schedule!r} or build with schedule='interleaved'."
        )
    rounds = max(1, microbatches // pp_size)
    if schedule == "interleaved" and microbatches % rounds:
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in {rounds} rounds (microbatches // pp_size): "
            f"microbatches={microbatches} must be a multiple of {rounds}. Use a multiple of {pp_size}."
        )
    if device is None:
        device = next(iter(inner[0].parameters())).device
    device = torch.device(device)
    pipe_stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in stages]
    model_ref: list[PipelineModel] = []

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        return model_ref[0]._loss(output, target)

    options = dict(n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "interleaved":
        runner = ScheduleInterleaved1F1B(pipe_stages, **options)
    elif schedule == "1f1b" and microbatches >= num_stages:
        runner = Schedule1F1B(pipe_stages[0], **options)
    else:
        runner = ScheduleGPipe(pipe_stages[0], **options)
    tie_groups, norm_excluded = _tie_groups(inner, group, pp_rank, pp_size)
    model = PipelineModel(inner, runner, group, microbatches, device, tie_groups, norm_excluded)
    model_ref.append(model)
    return model


def _tie_groups(
    stages: Sequence[_StageModule], group: dist.ProcessGroup, pp_rank: int, pp_size: int
) -> tuple[list[tuple[list[torch.Tensor], dist.ProcessGroup]], set[int]]:
    """For each tied weight held on several ranks: this rank's copies and the group of its holders.

    Groups of fewer ranks than the pipeline are created by their members only (in the same order,
    sorted by the weight's name), so ranks of other pipelines or stages need not take part.
    """
    held: dict[str, tuple[_Tie, list[torch.Tensor]]] = {}
    for stage in stages:
        for name, tie in stage.tied.items():
            params = held.setdefault(tie.key, (tie, []))[1]
            param = stage.get_parameter(name)
            if all(param is not p for p in params):
                params.append(param)
    result, norm_excluded = [], set()
    for key in sorted(held):
        tie, params = held[key]
        ranks = sorted({s % pp_size for s in tie.stages})
        if len(ranks) == 1:
            continue  # the same Parameter object on this one rank: autograd already sums
        if len(ranks) == pp_size:
            tie_group = group
        else:
            global_ranks = [dist.get_global_rank(group, r) for r in ranks]
            tie_group = dist.new_group(global_ranks, use_local_synchronization=True)
        result.append((params, tie_group))
        if pp_rank != ranks[0]:
            norm_excluded.update(id(p) for p in params)
    return result, norm_excluded
