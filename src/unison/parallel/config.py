"""`ParallelismConfig`: how the processes of a run are laid out over parallel dimensions.

One config describes every strategy of the multi-GPU guide as degrees of named dimensions, in
torchtitan's order: pipeline (`pp`), data-parallel replicas (`dp_replicate`: DDP alone, FSDP2 beside
tensor or pipeline parallelism), data-parallel
shards (`dp_shard`, ZeRO 1/2/3), context parallel (`cp`: each sequence split over the ranks) and tensor
parallel (`tp`). Field names follow Hugging Face
Accelerate's `ParallelismConfig` where it has them (`dp_replicate_size`, `dp_shard_size`, `tp_size`,
`cp_size`), so configs migrate unchanged.

Validation is a pure function of the config and the world size, so every rank reaches the same verdict
(and raises the same error) without talking to the others, before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .checkpointing_modes import normalize_mode

DEGREE_FIELDS = ("pp_size", "dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
"""The degrees (the mesh puts cp before tp: parallel/mesh.py; cp stays last here, as messages name it)."""

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
ZERO_STAGES = (1, 2, 3)
SHORTHANDS = ("ddp", "zero1", "zero2", "zero3", "dataparallel")

_BOOLEAN_FIELDS = ("sequence_parallel", "loss_parallel", "offload")
_SCALAR_FIELDS = (
    *DEGREE_FIELDS,
    "zero_stage",
    "pp_schedule",
    "pp_microbatches",
    "ep_size",
    *_BOOLEAN_FIELDS,
    "activation_checkpointing",
)
"""Fields that `from_string` accepts as FIELD=VALUE (plans and split points need code)."""


def _accepted_strings() -> str:
    return (
        f"{', '.join(repr(s) for s in SHORTHANDS)}, or comma-separated FIELD=VALUE pairs with FIELD in "
        f"{', '.join(_SCALAR_FIELDS)} (e.g. 'dp_shard_size=2,tp_size=2'; a ZeRO shorthand may lead them: "
        "'zero3,offload=true')"
    )


@dataclass(frozen=True)
class ParallelismConfig:
    """Degrees of each parallel dimension plus the strategy options that go with them.

    Sizes left as None are filled by `validate(world_size)`: the product of all degrees must equal the
    world size, and the one free dimension takes what the given ones leave: `dp_shard` when a
    `zero_stage` is set and `dp_shard_size` is not, else `dp_replicate`. So `ParallelismConfig()` is
    plain DDP over every process, `ParallelismConfig(zero_stage=3)` is ZeRO-3 over every process, and
    `ParallelismConfig(tp_size=2)` on 8 processes is 4 replicas of a 2-way tensor-parallel model (kept
    by FSDP2 as ZeRO-2 over the replicas: DDP cannot hold DTensor parameters).

    Attributes:
        zero_stage: what the dp_shard dimension shards (1: optimizer state, 2: + gradients, 3: + parameters);
            None with dp_shard_size > 1 means 3 (FSDP's full sharding, as in Accelerate and torchtitan).
        pp_schedule: "gpipe", "1f1b" or "interleaved" (several stages per rank).
        pp_microbatches: micro-batches per step for the pipeline; None lets the strategy pick.
        tp_plan: module name (pattern) -> parallel style, or None for the built-in plans.
        pp_split_points: module names where a new pipeline stage begins, or None to balance by parameters.
        zero_blocks: qualified name of the block list that ZeRO-2/3 shard one block at a time (e.g.
            "transformer.h"), or block class names (e.g. "GPT2Block,LlamaDecoderLayer": every module of those
            classes, Accelerate's transformer_cls_names_to_wrap), or None to use the model's largest
            ModuleList/Sequential of one class.
        sequence_parallel: with tensor parallel, also split norms and the residual stream over the sequence
            (activation memory / tp_size there; each all-reduce becomes a reduce-scatter + all-gather).
        loss_parallel: with tensor parallel, compute the cross-entropy on vocabulary-sharded logits without
            gathering them (the logits' memory / tp_size); the loss must be computed by the model's forward
            or in `Accelerator.forward_backward`, where unison enters torch's loss_parallel context.
        offload: with ZeRO-2/3, keep parameters, gradients and optimizer state in host memory (FSDP2's
            CPUOffloadPolicy, the guide's ZeRO-Offload): the device holds only the blocks being computed and
            the activations; each step copies shards in and gradients out over PCIe and the optimizer steps
            on the CPU. For models that fit no other way (the planner proposes it only then). Also on one
            process (one GPU, a model bigger than it): FSDP2 then runs over a one-rank dp_shard.
        legacy_data_parallel: single-process `torch.nn.DataParallel` over every visible GPU ("dataparallel").
            Opt-in by name only: DDP is faster (one exchange per step instead of five, no GIL-bound
            threads, no overloaded GPU 0; see docs/data-parallel.md).
        ep_size: expert parallelism: the experts of each mixture-of-experts layer divided over groups of
            ep_size consecutive dp_shard processes, tokens sent to their experts by all-to-all (the groups
            side by side replicate the experts); not a dimension of its own, it divides dp_shard, which it
            fills when left None (torchtitan's placement; parallel/experts.py, docs/expert-parallel.md).
        activation_checkpointing: "full", "selective" (op-level), "selective:K" (every K-th block) or None:
            which blocks recompute their activations in backward (parallel/checkpointing.py); the blocks are
            `zero_blocks` when given, else the found block list.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    pp_size: int | None = None
    zero_stage: int | None = None
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    tp_plan: Mapping[str, Any] | None = None
    pp_split_points: Sequence[str] | None = None
    zero_blocks: str | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    offload: bool = False
    legacy_data_parallel: bool = False
    activation_checkpointing: str | None = None
    ep_size: int | None = None

    @classmethod
    def from_string(cls, text: str) -> ParallelismConfig:
        """A config from a shorthand ("ddp", "zero1", "zero2", "zero3") or "FIELD=VALUE,..." pairs.

        The degrees are not checked here (no world size yet); call `validate(world_size)`.
        """
        value = text.strip().lower()
        if value == "ddp":
            return cls()
        if value == "dataparallel":
            return cls(legacy_data_parallel=True)
        if value in SHORTHANDS:
            return cls(zero_stage=int(value[-1]))
        first, _, rest = value.partition(",")
        if first.strip() in SHORTHANDS and first.strip() not in ("ddp", "dataparallel") and rest:
            # a ZeRO shorthand with options: "zero3,offload=true"
            return dataclasses.replace(cls.from_string(rest), zero_stage=int(first.strip()[-1]))
        if is_auto(value):
            raise ValueError(
                "parallelism='auto' is not a fixed layout: the Accelerator asks the planner for one at "
                "prepare(), from the model and the hardware (see docs/planner.md). Pass 'auto' to "
                "Accelerator(parallelism=...) or `unison launch --parallelism auto`, not to from_string."
            )
        if "=" not in value:
            raise ValueError(f"parallelism={text!r} is not understood: pass one of {_accepted_strings()}.")
        fields: dict[str, Any] = {}
        for pair in value.split(","):
            name, _, raw = (part.strip() for part in pair.partition("="))
            if name not in _SCALAR_FIELDS or not raw:
                raise ValueError(
                    f"parallelism={text!r}: {pair.strip()!r} is not FIELD=VALUE with a known FIELD; pass "
                    f"{_accepted_strings()}."
                )
            if name in fields:
                raise ValueError(f"parallelism={text!r} sets {name} twice: give each field once.")
            if name in ("pp_schedule", "activation_checkpointing"):
                fields[name] = raw
            elif name in _BOOLEAN_FIELDS:
                fields[name] = _parse_bool(text, name, raw)
            else:
                fields[name] = _parse_int(text, name, raw)
        return cls(**fields)

    def to_string(self) -> str:
        """The `parallelism=` / `--parallelism` string `from_string` reads back as this config: "ddp", a
        ZeRO shorthand, or the FIELD=VALUE pairs that differ from the defaults (a degree of 1 is the
        default's). A tensor-parallel plan and pipeline split points need code, and are left out."""
        defaults = type(self)()
        changed = {
            name: getattr(self, name)
            for name in _SCALAR_FIELDS
            if getattr(self, name) != getattr(defaults, name)
            and not (name in DEGREE_FIELDS and getattr(self, name) == 1)
        }
        if self.legacy_data_parallel:
            return "dataparallel"
        if not changed:
            return "ddp"
        if list(changed) == ["zero_stage"]:
            return f"zero{self.zero_stage}"
        return ",".join(f"{name}={str(value).lower()}" for name, value in changed.items())

    @classmethod
    def coerce(cls, value: ParallelismConfig | str | None) -> ParallelismConfig:
        """Accept a config, a string for `from_string`, or None (plain DDP)."""
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls.from_string(value)
        if isinstance(value, cls):
            return value
        raise TypeError(
            f"parallelism={value!r} is a {type(value).__qualname__}: pass a ParallelismConfig, a string "
            f"({_accepted_strings()}), or None for plain data parallelism."
        )

    # -- validation -------------------------------------------------------------------------------
    def validate(self, world_size: int) -> ParallelismConfig:
        """Check everything against `world_size` and return the config with every size filled in.

        Raises ValueError naming each degree, their product and the world size when they disagree.
        """
        for name in (*DEGREE_FIELDS, "ep_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"{name}={value!r} is not a degree: each degree is a whole number >= 1 (1: the dimension "
                    f"is not used), or None to let it be filled in. Pass e.g. {name}=2."
                )
        self._check_options()
        mode = normalize_mode(self.activation_checkpointing)
        resolved = dataclasses.replace(self, activation_checkpointing=mode)._fill(world_size)
        resolved._check_product(world_size)
        resolved._check_dimension_options()
        return resolved

    def _check_options(self) -> None:
        normalize_mode(self.activation_checkpointing)  # raises, naming the value, when it is no mode
        if self.zero_stage is not None and self.zero_stage not in ZERO_STAGES:
            raise ValueError(
                f"zero_stage={self.zero_stage!r} is not a ZeRO stage: pass 1 (optimizer state sharded), 2 "
                "(+ gradients), 3 (+ parameters), or None."
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(
                f"pp_schedule={self.pp_schedule!r} is unknown: pass one of "
                f"{', '.join(repr(s) for s in PP_SCHEDULES)}."
            )
        micro = self.pp_microbatches
        if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1):
            raise ValueError(
                f"pp_microbatches={micro!r} is not a count: pass a whole number >= 1 (1 is naive model "
                "parallelism; more shrink the pipeline bubble), or None to let the strategy pick."
            )
        if self.tp_plan is not None and not (
            isinstance(self.tp_plan, Mapping) and all(isinstance(key, str) for key in self.tp_plan)
        ):
            raise ValueError(
                f"tp_plan={self.tp_plan!r} is not a plan: pass a dict from module name to parallel style, "
                'e.g. {"mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}, or None.'
            )
        points = self.pp_split_points
        if points is not None and (isinstance(points, str) or not all(isinstance(p, str) for p in points)):
            raise ValueError(
                f"pp_split_points={points!r} is not a list of module names: pass e.g. ['blocks.4'] (a stage "
                "begins at each), or None to balance the stages by parameter count."
            )

    def _fill(self, world_size: int) -> ParallelismConfig:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is not a number of processes >= 1.")
        shards = self.zero_stage is not None or (self.ep_size or 1) > 1
        free = "dp_shard_size" if shards and self.dp_shard_size is None else None
        free = free or ("dp_replicate_size" if self.dp_replicate_size is None else None)
        sizes = {name: getattr(self, name) for name in DEGREE_FIELDS}
        given = math.prod(size for size in sizes.values() if size is not None)
        for name in sizes:
            if sizes[name] is None:
                sizes[name] = 1
        if free is not None and world_size % given == 0:
            sizes[free] = world_size // given
        zero_stage = self.zero_stage
        if zero_stage is None and sizes["dp_shard_size"] > 1:
            zero_stage = 3
        if self._offloads_on_one_process(sizes):
            # ZeRO-2/3 with offload on one process (one GPU, a model bigger than it): FSDP2 over a
            # one-rank dp_shard keeps parameters, gradients and optimizer state in host memory, the
            # device holding one unit at a time, as DeepSpeed's ZeRO-Offload does on one GPU.
            return dataclasses.replace(self, zero_stage=zero_stage, **sizes)
        alone = all(sizes[name] == 1 for name in ("tp_size", "pp_size", "cp_size"))
        if (self.ep_size or 1) > 1 and self.dp_shard_size is None and sizes["dp_shard_size"] == 1 and alone:
            # one process (the same script under `python train.py`): every expert is local
            return dataclasses.replace(self, ep_size=None)._fill(world_size)
        if self._nothing_left_to_shard(sizes):
            # The same script on fewer processes (one, with `python train.py`): ZeRO over a single
            # process is plain training, so it runs as such (unsharded_note says so) instead of failing.
            keep_blocks = self.zero_blocks if self.activation_checkpointing else None
            return dataclasses.replace(self, zero_stage=None, offload=False, zero_blocks=keep_blocks, **sizes)
        return dataclasses.replace(self, zero_stage=zero_stage, **sizes)

    def _nothing_left_to_shard(self, sizes: dict[str, int]) -> bool:
        """A ZeRO stage asked for with dp_shard_size left to fill, and no process left to fill it with."""
        return (
            self.zero_stage is not None
            and self.dp_shard_size is None
            and sizes["dp_shard_size"] == 1
            and sizes["cp_size"] == 1
        )

    def _offloads_on_one_process(self, sizes: dict[str, int]) -> bool:
        """ZeRO-2/3 with offload=true on a single process: nothing to shard, but memory to move to the
        host, so FSDP2 still runs (over a one-rank dp_shard)."""
        return self.offload and self.zero_stage in (2, 3) and math.prod(sizes.values()) == 1

    def unsharded_note(self, world_size: int) -> str | None:
        """The line that says a ZeRO stage runs unsharded on `world_size` processes, or None."""
        resolved = self.validate(world_size)
        if self.zero_stage is None or resolved.zero_stage is not None or resolved.dp_shard_size != 1:
            return None
        extra = " (and offload=true: the state stays on the device)" if self.offload else ""
        return (
            f"zero_stage={self.zero_stage}{extra} on {world_size} process{'es' if world_size > 1 else ''} "
            f"as {resolved.describe()}: there is no second process to shard over, so parameters, gradients "
            "and optimizer state stay whole; launch more processes to shard them"
        )

    def _check_product(self, world_size: int) -> None:
        if self.total_size == world_size:
            return
        degrees = " x ".join(f"{name}={getattr(self, name)}" for name in DEGREE_FIELDS)
        raise ValueError(
            f"the parallel degrees {degrees} multiply to {self.total_size}, but the world size is "
            f"{world_size} processes: their product must equal the world size. Change the degrees so "
            f"they multiply to {world_size} (a degree left as None is filled in when the others divide "
            f"{world_size}), or launch {self.total_size} processes."
        )

    def _check_dimension_options(self) -> None:
        if self.legacy_data_parallel and self.total_size != 1:
            raise ValueError(
                f"legacy_data_parallel (torch.nn.DataParallel) runs in ONE process over all visible GPUs, "
                f"but this layout is {self.describe()} on {self.total_size} processes: run the script with "
                "plain `python` (no launcher), or use DDP ('ddp'), which is faster anyway."
            )
        if (
            self.zero_stage is not None
            and self.dp_shard_size == 1
            and (self.cp_size or 1) == 1
            and not self._offloads_on_one_process({name: getattr(self, name) or 1 for name in DEGREE_FIELDS})
        ):
            raise ValueError(
                f"zero_stage={self.zero_stage} shards over the dp_shard dimension, but dp_shard_size=1: "
                "there is nothing to shard over. Give dp_shard_size >= 2 (or leave it None to fill the "
                "processes the other degrees leave), or set zero_stage=None."
            )
        for option, value in (
            ("sequence_parallel", self.sequence_parallel or None),
            ("loss_parallel", self.loss_parallel or None),
            ("tp_plan", self.tp_plan),
            ("pp_split_points", self.pp_split_points),
            ("pp_microbatches", self.pp_microbatches),
            ("pp_schedule", self.pp_schedule if self.pp_schedule != "1f1b" else None),  # 1f1b: the default
        ):
            dimension = "pp_size" if option.startswith("pp_") else "tp_size"
            if value is not None and getattr(self, dimension) == 1:
                raise ValueError(
                    f"{option}={value!r} was given but {dimension}=1, so it would be ignored: set "
                    f"{dimension} >= 2, or drop {option}."
                )
        sharded = (self.dp_size > 1 or self.offload) and self.zero_stage in (2, 3)
        if self.zero_blocks is not None and (
            not isinstance(self.zero_blocks, str) or not (sharded or self.activation_checkpointing)
        ):
            raise ValueError(
                f"zero_blocks={self.zero_blocks!r} names the block list that ZeRO-2/3 shard block by block "
                f"(and activation checkpointing recomputes), but this layout is {self.describe()} without "
                "activation checkpointing: give a module or class name (e.g. 'transformer.h') with "
                "zero_stage 2 or 3 or an activation_checkpointing mode, or leave zero_blocks None."
            )
        if self.legacy_data_parallel and self.activation_checkpointing:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} with torch.nn.DataParallel: its "
                "per-GPU replicas copy modules every step, which the checkpoint hooks are not made for. Use "
                "DDP ('ddp') with activation checkpointing, or drop activation_checkpointing."
            )
        if self.tp_plan is not None and self.sequence_parallel:
            raise ValueError(
                "sequence_parallel=True selects the built-in tensor-parallel plan's sequence-parallel "
                "styles, "
                "but tp_plan was given and is used as it is: put SequenceParallel() entries into tp_plan "
                "(see docs/tensor-parallel.md), or drop tp_plan to use the built-in plan."
            )
        if self.pp_split_points is not None:
            self._check_stage_count(len(self.pp_split_points) + 1)
        if self.offload and (
            self.zero_stage not in (2, 3) or (self.tp_size or 1) > 1 or (self.pp_size or 1) > 1
        ):
            raise ValueError(
                f"offload=true keeps ZeRO-2/3's shards in host memory, but this layout is {self.describe()}: "
                "offload works with zero_stage 2 or 3 over dp_shard, without tp_size or pp_size (not yet "
                "supported with them). Use e.g. 'zero3,offload=true', or drop offload."
            )
        if (self.ep_size or 1) > 1:
            self._check_expert_parallel()
        if (self.cp_size or 1) > 1:
            from .context import check_context_parallel_layout

            check_context_parallel_layout(self)

    def _check_expert_parallel(self) -> None:
        """ep_size borrows from dp_shard: it must divide it, beside ZeRO-2/3 alone (not yet beside tensor,
        pipeline or context parallelism, nor offload)."""
        ep = self.ep_size
        others = [
            f"{name}={getattr(self, name)}"
            for name in ("tp_size", "pp_size", "cp_size")
            if (getattr(self, name) or 1) > 1
        ]
        if others or self.offload or self.legacy_data_parallel or self.zero_stage == 1:
            found = (
                others
                + (["offload=true"] if self.offload else [])
                + (["zero_stage=1"] if self.zero_stage == 1 else [])
            )
            raise ValueError(
                f"ep_size={ep} with {', '.join(found) or 'torch.nn.DataParallel'}: expert parallelism "
                "runs beside ZeRO-2/3 over dp_shard (and dp_replicate) only, not yet with tensor, pipeline "
                "or context parallelism, offload or ZeRO-1. Use e.g. 'ep_size=2,dp_shard_size=4', or drop "
                "ep_size."
            )
        if self.dp_shard_size % ep:
            raise ValueError(
                f"ep_size={ep} does not divide dp_shard_size={self.dp_shard_size}: the experts are divided "
                f"over groups of {ep} consecutive dp_shard processes. Choose an ep_size that divides "
                f"{self.dp_shard_size}, or a dp_shard_size that is a multiple of {ep}."
            )

    def _check_stage_count(self, stages: int) -> None:
        if self.pp_schedule == "interleaved":
            if stages % self.pp_size or stages // self.pp_size < 2:
                raise ValueError(
                    f"pp_split_points makes {stages} stages, but the interleaved schedule needs a multiple "
                    f"of pp_size={self.pp_size} with at least 2 stages per rank: give "
                    f"{2 * self.pp_size - 1} split points (or another multiple of {self.pp_size}, minus 1)."
                )
        elif stages != self.pp_size:
            raise ValueError(
                f"pp_split_points makes {stages} stages, but pp_schedule={self.pp_schedule!r} runs one stage "
                f"per rank of pp_size={self.pp_size}: give {self.pp_size - 1} split points, or use "
                "pp_schedule='interleaved' for several stages per rank."
            )

    # -- facts about a validated config ---------------------------------------------------------------
    @property
    def total_size(self) -> int:
        """The product of all degrees (None counts as 1): the processes this layout occupies."""
        return math.prod(getattr(self, name) or 1 for name in DEGREE_FIELDS)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many different batches one step consumes."""
        return (self.dp_replicate_size or 1) * (self.dp_shard_size or 1)

    @property
    def is_plain_data_parallel(self) -> bool:
        """True when only dp_replicate is used: DDP (or a single process), nothing to shard or split."""
        return all((getattr(self, name) or 1) == 1 for name in DEGREE_FIELDS if name != "dp_replicate_size")

    def describe(self) -> str:
        """A short name of the layout for messages, e.g. "dp_shard=4 (ZeRO-3)" or "dp_replicate=2 x tp=2"."""
        used = [
            f"{name[:-5]}={getattr(self, name)}" for name in DEGREE_FIELDS if (getattr(self, name) or 1) > 1
        ]
        if self.legacy_data_parallel:
            return "torch.nn.DataParallel (one process, every visible GPU)"
        text = " x ".join(used) or "single process"
        if (self.ep_size or 1) > 1:
            text += f", ep={self.ep_size}"
        if self.zero_stage is not None:
            text += f" (ZeRO-{self.zero_stage}{', offloaded' if self.offload else ''})"
        if (self.pp_size or 1) > 1:
            text += f", pp_schedule={self.pp_schedule}"
        if self.activation_checkpointing:
            text += f", activation_checkpointing={self.activation_checkpointing}"
        return text


AUTO_OPTIONS = ("global_batch_size", "seq_len", "micro_batch_size")
"""What "auto:k=v,..." may tell the planner about the run, so it picks the fastest layout (the cost model)."""


def is_auto(value: object) -> bool:
    """True for "auto" or "auto:k=v,..." (any case, surrounding spaces): let the planner choose the layout."""
    if not isinstance(value, str):
        return False
    text = value.strip().lower()
    return text == "auto" or text.startswith("auto:")


def auto_options(value: str) -> dict[str, int]:
    """The run facts of "auto:global_batch_size=512,seq_len=4096[,micro_batch_size=2]" (none for "auto").

    With a global batch and a sequence length the planner ranks the layouts that fit by predicted step
    time (docs/planner.md); without, it takes the first that fits in the guide's order.
    """
    _, _, rest = value.strip().partition(":")
    options: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, _, raw = item.partition("=")
        key = key.strip().lower()
        if key not in AUTO_OPTIONS:
            raise ValueError(
                f"parallelism={value!r}: {key!r} is not a fact the planner takes; pass "
                f"{', '.join(AUTO_OPTIONS)}, e.g. 'auto:global_batch_size=512,seq_len=4096'."
            )
        try:
            options[key] = int(raw)
        except ValueError:
            options[key] = 0
        if options[key] < 1:
            raise ValueError(f"parallelism={value!r}: {key}={raw.strip()!r} is not a whole number >= 1.")
    if ("global_batch_size" in options) != ("seq_len" in options) or (
        "micro_batch_size" in options and "seq_len" not in options
    ):
        raise ValueError(
            f"parallelism={value!r}: the planner prices a step from global_batch_size and seq_len together; "
            "give both (e.g. 'auto:global_batch_size=512,seq_len=4096') or neither ('auto')."
        )
    return options


def _parse_bool(text: str, name: str, raw: str) -> bool:
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no"):
        return False
    raise ValueError(f"parallelism={text!r}: {name}={raw!r} is not true or false; pass e.g. {name}=true.")


def _parse_int(text: str, name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"parallelism={text!r}: {name}={raw!r} is not a whole number; pass e.g. {name}=2."
        ) from None
