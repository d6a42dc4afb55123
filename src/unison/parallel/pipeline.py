"""Pipeline parallelism, phase 2: run this rank's stages with torch.distributed.pipelining's schedules.

Two phases, so that tensor parallel or FSDP2 can be applied to each stage in between (torchtitan's
order: pipeline split, then TP, then FSDP):

1. `split_model(model, pp_rank, pp_size, ...)` returns this rank's stage modules: the model's own
   modules under their original names, each stage running the model's own forward
   (unison.parallel.pipeline_split, which says how; re-exported here).
2. `build_pipeline(stages, pp_group, ...)` wraps them in torch `PipelineStage`s and a schedule (GPipe,
   1F1B, interleaved 1F1B) and returns a `PipelineModel` whose `step(inputs, target, loss_fn)` runs
   forward and backward of all micro-batches and returns the loss on every rank of the pipeline.

Tied weights (GPT's `wte.weight` is `lm_head.weight`) live on the first and the last stage; after each
step their gradients are summed over the ranks that hold them (as Megatron does), so both copies
receive the same update as the single tied parameter of the plain model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from unison.parallel.pipeline_split import _check_schedule, _StageModule, _Tie, split_model

__all__ = [
    "LossFn",
    "PipelineModel",
    "build_pipeline",
    "microbatches_for",
    "pipeline_bubble_fraction",
    "split_model",
]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def pipeline_bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe/1F1B step with p stages and m micro-batches: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def _unwrap(module: nn.Module) -> _StageModule:
    if isinstance(module, DistributedDataParallel):
        raise TypeError(
            "DistributedDataParallel around a pipeline stage does not work with torch's schedules (on "
            "torch 2.13 its reducer fails on the schedule's shape-inference pass, or with static_graph "
            "gives wrong gradients). Replicate stages with FSDP2 instead: "
            "fully_shard(stage, mesh=dp_mesh) (ZeRO-2 over the replicas with reshard_after_forward=False, as "
            "unison's prepare() does)."
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
        build_schedule: _ScheduleBuilder,
        group: dist.ProcessGroup,
        microbatches: int,
        device: torch.device,
        tie_groups: Sequence[tuple[list[torch.Tensor], dist.ProcessGroup]],
        norm_excluded: set[int],
    ):
        super().__init__()
        self.stage_modules = list(stages)  # a list, not children: each module is registered once, below
        _merge_into(self, self.stage_modules)
        self.microbatches = microbatches
        self._group, self._device = group, device
        self._tie_groups, self._norm_excluded = tie_groups, norm_excluded
        # the full-model names of each weight tied across stages: consolidated state dicts and
        # save_model then hold it once, as the plain model's do
        self.tied_names = self.stage_modules[0].tied_names
        self._loss_fn: LossFn | None = None
        self._loss_scale = 1.0
        self._grad_scale: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        # torch sizes a schedule's send/receive buffers on its first call: one schedule per (training?,
        # batch shapes), the one built first for the first call; the first shapes of each mode fix the
        # regular micro-batch size and the dimensions other than the batch
        self._build_schedule = build_schedule
        build_schedule.loss_fn = self._loss
        self.schedule = build_schedule(microbatches)  # the regular batches'
        self._first_schedule: Any = self.schedule
        self._schedules: dict[tuple[bool, tuple], tuple[Any, int]] = {}
        self._regular: dict[bool, tuple] = {}
        self._ran: list[Any] = []  # schedules that have inferred their shapes
        # tied weights' gradients from before the accumulation window in progress, None between windows
        self._held_tied_grads: list[list[torch.Tensor | None]] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a pipeline-parallel model cannot be called directly: each rank holds only some stages. Use "
            "loss = model.step(inputs, target, loss_fn) (accelerator.forward_backward) to train and "
            "model.evaluate(inputs, target, loss_fn) for a forward-only loss."
        )

    def train(self, mode: bool = True) -> PipelineModel:
        """nn.Module.train, for the stages too: each runs the model's own forward on its copy of the
        model's root, which is no child of ours, and that forward may branch on `self.training`."""
        super().train(mode)
        for stage in self.stage_modules:
            stage.train(mode)
        return self

    def norm_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, a tied weight kept on one rank only: summing the squared gradient
        norms of these over the pipeline ranks counts every weight of the model once (for clipping)."""
        return (p for p in self.parameters() if id(p) not in self._norm_excluded)

    def step(
        self,
        inputs: Any,
        target: torch.Tensor,
        loss_fn: LossFn,
        *,
        divide_by: float = 1.0,
        sync: bool = True,
        reduction: str = "mean",
        grad_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of all micro-batches; returns the batch's loss (detached) on every rank.

        inputs: the model's positional input (a tensor or a tuple of tensors), the whole batch, on
            every pipeline rank (every stage runs the model's forward on its micro-batches).
        loss_fn(output, target): output as the model returns it (GPT: `(logits, None)`).
        reduction: "mean": loss_fn returns a micro-batch's mean; the gradients and the returned loss
            are those of the batch's mean (the mean of its equal micro-batches' means). "sum": loss_fn
            returns a micro-batch's sum over its items; they are those of the batch's sum.
        divide_by: gradients become those of that loss / divide_by (gradient accumulation); the
            returned loss is not divided. Gradients accumulate into `.grad` across calls.
        sync: False on the non-final micro-steps of an accumulation window: the copies of a weight tied
            across stages keep their local gradients, summed over the pipeline ranks once, by the call
            that ends the window (the sum is linear: one all-reduce of the window's total is the same).
        grad_scale: fp16's loss scale (a one-element tensor, GradScaler's): the loss the last stage
            backpropagates is multiplied by it, so every stage's gradients come out scaled, as
            `scaler.scale(loss).backward()` leaves them in one process; the returned loss is not.

        A batch of another size than the first call's (a loader's short last batch) runs too, in a
        schedule of its own (`microbatches_for` says how many micro-batches).
        """
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r}: pass 'mean' (loss_fn returns means) or 'sum' (sums).")
        inputs, schedule, microbatches = self._prepare(inputs, target, loss_fn, training=True)
        self._loss_scale = (1.0 / microbatches if reduction == "mean" else 1.0) / divide_by
        self._grad_scale = grad_scale
        if self._held_tied_grads is None:  # the window's first call: set aside what was reduced before
            self._held_tied_grads = [[self._detach_grad(p) for p in params] for params, _ in self._tie_groups]
        # keyword arguments reach every stage (split into micro-batches): each recomputes from the
        # model's inputs what the model computes before its blocks (positions, masks, rotary tables)
        with self._gradients_kept(schedule):
            schedule.step(target=target, inputs=inputs)
        if sync:
            for (params, group), previous in zip(self._tie_groups, self._held_tied_grads):
                for param, before in zip(params, previous):
                    self._sum_tied_grad(param, before, group)
            self._held_tied_grads = None
        loss = self._mean_loss(microbatches)
        return loss if reduction == "mean" else loss * microbatches

    @torch.no_grad()
    def evaluate(self, inputs: Any, target: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """Forward only (torch's `schedule.eval`): the batch's mean loss on every rank (the mean over its
        equal micro-batches' means); a short last batch runs as in `step`."""
        inputs, schedule, microbatches = self._prepare(inputs, target, loss_fn, training=False)
        self._grad_scale = None
        with self._gradients_kept(schedule):
            schedule.eval(target=target, inputs=inputs)
        return self._mean_loss(microbatches)

    def _prepare(self, inputs: Any, target: torch.Tensor, loss_fn: LossFn, training: bool) -> tuple:
        """Checks (the same verdict on every rank, before any communication) and the schedule for these
        batch shapes; returns the inputs this rank hands the schedule, the schedule and its number of
        micro-batches."""
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        tensors = [*((f"inputs[{i}]", t) for i, t in enumerate(inputs)), ("target", target)]
        for name, tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                raise TypeError(f"{name} must be a batched tensor, got {type(tensor).__name__}.")
        shapes = tuple(tuple(t.shape) for _, t in tensors)
        regular = self._regular.get(training, shapes)
        if [s[1:] for s in shapes] != [s[1:] for s in regular]:
            raise ValueError(
                f"batch shapes {shapes} differ from {regular} of the first "
                f"{'step' if training else 'evaluate'} call in more than the batch size: the pipeline's "
                "send/receive buffers are sized for the shapes it saw, and only a batch of another size "
                "(a loader's short last batch) gets a schedule of its own. Keep the other dimensions "
                "fixed (pad sequences to one length)."
            )
        m = self.microbatches
        microbatches = m
        if shapes != regular:  # another batch size than the first call's: the loader's short last batch
            pp_size = dist.get_world_size(self._group)
            micro_rows = max(1, regular[0][0] // m)
            microbatches = microbatches_for(
                shapes[0][0], micro_rows, pp_size, self._build_schedule.interleaved
            )
        for name, tensor in tensors:
            if tensor.shape[0] % microbatches:
                raise ValueError(
                    f"{name} has batch size {tensor.shape[0]}, not divisible into {microbatches} "
                    f"micro-batches: use a batch size that is a multiple of {m} (only a loader's last "
                    "batch may be another size), the same for every input and the target."
                )
        self._regular.setdefault(training, shapes)
        key = (training, shapes)
        if key not in self._schedules:
            if microbatches == m and self._first_schedule is not None:  # the one build_pipeline made
                schedule, self._first_schedule = self._first_schedule, None
            else:
                schedule = self._build_schedule(microbatches)
            self._schedules[key] = (schedule, microbatches)
        self._loss_fn = loss_fn
        self._losses.clear()
        schedule, microbatches = self._schedules[key]
        return inputs, schedule, microbatches

    @contextlib.contextmanager
    def _gradients_kept(self, schedule: Any) -> Iterator[None]:
        """A schedule's first call infers its shapes by running a micro-batch through the stages, after
        which torch drops the gradients of FSDP-sharded stages (`_post_metadata_inference_cleanup`). A
        schedule first run inside an accumulation window (a short last batch, an evaluation) would lose
        the window's gradients so far: they are set aside around that first call and added back."""
        if schedule in self._ran:
            yield
            return
        self._ran.append(schedule)
        params = [p for p in self.parameters() if p.grad is not None]
        held = [self._detach_grad(p) for p in params]
        try:
            yield
        finally:
            for param, grad in zip(params, held):
                param.grad = grad if param.grad is None else param.grad.add_(grad)

    def _loss(self, stage_output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the user's, on the model's own output structure, scaled so the
        summed micro-batch gradients are those of the batch mean (torch's scale_grads would also
        divide gradients accumulated by earlier calls), and by fp16's loss scale."""
        loss = self._loss_fn(self.stage_modules[-1].rebuild_output(stage_output), target)
        value = loss.detach()
        self._losses.append(value.full_tensor() if hasattr(value, "full_tensor") else value)  # loss_parallel
        loss = loss * self._loss_scale
        return loss if self._grad_scale is None else loss * self._grad_scale

    def _mean_loss(self, microbatches: int) -> torch.Tensor:
        """Mean of this call's micro-batch losses, broadcast from the last stage's rank."""
        result = torch.zeros((), dtype=torch.float32, device=self._device)
        if self.stage_modules[-1].stage_index == self.stage_modules[-1].num_stages - 1:
            # a schedule's shape inference calls the loss once more on its first call: take the last ones
            result.copy_(torch.stack(self._losses[-microbatches:]).mean())
        dist.broadcast(result, group=self._group, group_src=dist.get_world_size(self._group) - 1)
        return result

    @staticmethod
    def _detach_grad(param: torch.Tensor) -> torch.Tensor | None:
        """Take the gradient accumulated so far off a tied weight, so only this window's part is summed."""
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


def _merge_into(target: nn.Module, sources: Sequence[nn.Module]) -> None:
    """Register on `target` the union of the `sources`' module trees under their names (a rank's stages:
    interleaved stages on one rank each hold some blocks of one block list). A module several sources
    share (a stateless piece) is registered once; containers that differ are merged into a new one."""
    names = list(dict.fromkeys(name for source in sources for name, _ in source.named_children()))
    for name in names:
        found = list({id(m): m for s in sources for n, m in s.named_children() if n == name}.values())
        if len(found) == 1:
            target.register_module(name, found[0])
            continue
        merged = nn.ModuleList() if all(isinstance(m, nn.ModuleList) for m in found) else nn.Module()
        _merge_into(merged, found)
        target.register_module(name, merged)


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
    build_schedule = _ScheduleBuilder(stages, num_stages, device, group, schedule)
    tie_groups, norm_excluded = _tie_groups(inner, group, pp_rank, pp_size)
    return PipelineModel(inner, build_schedule, group, microbatches, device, tie_groups, norm_excluded)


class _ScheduleBuilder:
    """Builds torch schedules of this rank's stages for a number of micro-batches: one for the regular
    batches, one more for each other batch size (a loader's short last batch). Each gets its own
    `PipelineStage`s, whose send/receive buffers torch sizes on the schedule's first call; the stage
    modules are shared."""

    def __init__(
        self,
        stages: Sequence[tuple[int, nn.Module]],
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: str,
    ):
        self.stages, self.num_stages, self.device, self.group = stages, num_stages, device, group
        self.schedule, self.interleaved = schedule, schedule == "interleaved"
        self.loss_fn: LossFn | None = None  # the PipelineModel's, which scales the user's

    def __call__(self, microbatches: int) -> Any:
        # torch.distributed.pipelining imports torch._dynamo (0.4 s): loaded only by pipeline layouts.
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        pipe_stages = [
            PipelineStage(module, index, self.num_stages, self.device, group=self.group)
            for index, module in self.stages
        ]
        options = dict(n_microbatches=microbatches, loss_fn=self.loss_fn, scale_grads=False)
        if self.interleaved:
            return ScheduleInterleaved1F1B(pipe_stages, **options)
        if self.schedule == "1f1b" and microbatches >= self.num_stages:
            return Schedule1F1B(pipe_stages[0], **options)
        return ScheduleGPipe(pipe_stages[0], **options)


def microbatches_for(rows: int, micro_batch_rows: int, pp_size: int, interleaved: bool) -> int:
    """How many micro-batches a batch of `rows` runs in when its size is not the regular one (a loader's
    short last batch): torch's schedules send equal shapes, so a count that divides the batch; the
    fewest whose micro-batches hold at most the regular `micro_batch_rows` (no more activation memory
    than a regular step), or the most if none does. Interleaved 1F1B also needs a multiple of the rounds
    it runs them in (count // pp_size). 2 rows, regular micro-batches of 1: 2; 3 rows, of 2: 3;
    2 rows, of 2: 1. Equal micro-batches make the mean of their mean losses the batch's mean."""
    counts = [
        d for d in range(1, rows + 1) if rows % d == 0 and not (interleaved and d % max(1, d // pp_size))
    ]
    fitting = [d for d in counts if rows // d <= micro_batch_rows]
    return min(fitting) if fitting else max(counts)


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
