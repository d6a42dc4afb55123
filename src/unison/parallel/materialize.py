"""Models built on the meta device: shard first, then give each rank its own shards only.

A model too big for one device cannot be moved there whole before it is sharded. Built inside
`unison.init_empty_weights()` (torch's meta device: shapes, no storage), `prepare()` shards it as it
is (FSDP2 `fully_shard`, DTensor `parallelize_module` and the pipeline split all work on meta modules),
then allocates each rank's local shards on its device (`Module.to_empty`) and fills them, as torchtitan
and Accelerate do. Two sources of values, chosen by where the model's parameters are on each process
(one all-gather of a code per process at prepare()):

- "init": every process built the model on meta. The values are the model's own init, replayed as
  the normal build ran it (unison/parallel/init_replay.py): every process draws every tensor in full,
  one module (or group of tied modules) at a time, from the CPU generator's state when the model was
  built, and keeps its part (a process holding every tensor whole in host memory, as one process does,
  runs each call once, writing into its own tensors); so the values do not depend on the world size or
  the layout, and a model whose init is its modules' reset_parameters() (and the root's
  `_init_weights(module)`, nanoGPT's and Hugging Face's convention) gets the very values of the model
  built normally with the same seed.
  The CPU generator is left where the user's code left it. A model whose init cannot be replayed a
  module at a time (a root `init_weights()`, torchtitan's and Hugging Face's name, or an init that
  reaches other modules' tensors) is filled as before, with a warning: the init run on this
  process's shards, so each shard is drawn from its own rank's generator (on CUDA, DTensor's random
  tracker makes the shards one draw of the full tensor), another valid init on each layout. Before
  either, every floating tensor is filled with NaN, so a tensor the init does not reach is found and
  refused by name, not trained from uninitialised memory.
- "rank0": process 0 holds the real weights (in its CPU memory, e.g. loaded from a file), the others
  built the model on meta (Accelerate's `cpu_ram_efficient_loading`). Process 0's tensors are set
  aside, its model moved to meta like the others', and after sharding each tensor is broadcast in turn
  and every process copies its part into its shard in place (torch's `distribute_tensor` with
  `src_data_rank=None` slices locally): each process holds its shards plus one full tensor in flight,
  never the whole model. (torch's `set_model_state_dict(..., broadcast_from_rank0=True)` does the same
  for DTensors, but keeps every received plain tensor, a pipeline stage's whole share, until the end.)
  Non-persistent buffers and weights tied under several names travel the same way.

Buffers that are not on meta (a causal mask built outside `init_empty_weights`) are kept as given.
Layouts that hold the whole model on every process (one process, DDP, ZeRO-1) materialise it before
wrapping: there is nothing to shard, and DDP broadcasts real tensors at construction.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .apply import data_parallel_engine
from .config import ParallelismConfig
from .ddp import unwrap
from .engines import is_dtensor
from .init_replay import Replay, fill_unset, forget_built_at, is_unset, replay_init, replay_of

logger = logging.getLogger("unison")

META = torch.device("meta")
_NO_META, _ALL_META, _SOME_META = 0, 1, 2


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _meta_code(model: nn.Module) -> int:
    """How many of `model`'s parameters are on the meta device: none, all, or some (refused)."""
    on_meta = [_local(p).is_meta for p in model.parameters()]
    if not any(on_meta):
        return _NO_META
    return _ALL_META if all(on_meta) else _SOME_META


def _codes_of_every_process(code: int, device: torch.device) -> list[int]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [code]
    mine = torch.tensor([code], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(c.item()) for c in everyone]


def _source(codes: list[int], model: nn.Module) -> str | None:
    """None (nothing on meta), "init" or "rank0"; the same answer or the same error on every process."""
    if all(code == _NO_META for code in codes):
        return None
    name = type(model).__name__
    partial = [rank for rank, code in enumerate(codes) if code == _SOME_META]
    if partial:
        raise ValueError(
            f"{name} has some parameters on the meta device and others not (on process(es) {partial}): "
            "prepare() cannot tell which values to keep. Build the whole model inside "
            "unison.init_empty_weights(), or none of it."
        )
    if all(code == _ALL_META for code in codes):
        return "init"
    if codes[0] == _NO_META:
        return "rank0"
    real = [rank for rank, code in enumerate(codes) if code == _NO_META]
    raise ValueError(
        f"{name} was built on the meta device on process 0 but with real weights on process(es) {real}: "
        "the weights of a model built on meta come from process 0 (or from the model's own init when "
        "every process built it on meta). Load the weights on process 0 only, or build the model inside "
        "unison.init_empty_weights() on every process."
    )


def _holds_whole_model(config: ParallelismConfig) -> bool:
    """One process, DDP, ZeRO-1, DataParallel: every process holds the whole model (nothing to shard)."""
    engine = data_parallel_engine(config)
    return engine in ("ddp", "dataparallel") or (
        engine == "none" and (config.tp_size or 1) == 1 and (config.pp_size or 1) == 1
    )


@dataclass
class DeferredModel:
    """A model prepare() found on the meta device, and where its values will come from."""

    source: str  # "init" or "rank0"
    device: torch.device
    whole: bool  # materialised before wrapping (the layout holds the whole model)
    tp_mesh: DeviceMesh | None = None
    offload: bool = False  # ZeRO-2/3 with offload=true: the shards in host memory, buffers on the device
    # process 0's parameters and buffers (non-persistent ones too), a tied tensor once, "rank0" only,
    # and the other names of each tied one
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    kept_buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # real buffers, kept as given
    root: nn.Module | None = None
    replay: Replay | None = None  # "init" only: how to replay the model's init (init_replay.py)

    def before_parallelize(self, model: nn.Module) -> nn.Module:
        """Take process 0's weights aside (its model goes to meta like the others'); materialise now a
        model that the layout holds whole. Call after noting the model's parameters, before wrapping."""
        self.root = model
        if self.source == "rank0" and _meta_code(model) == _NO_META:
            self.weights, self.aliases = _tensors_once(model)
            with _in_place():
                model.to(device=META)
        else:
            self.kept_buffers = {n: b for n, b in model.named_buffers() if not b.is_meta}
        if self.source == "init":
            self.replay = replay_of(model)
        forget_built_at(model)
        if self.whole:
            self._materialize(model)
        return model

    def after_parallelize(self, prepared: nn.Module) -> None:
        """Allocate this process's shards of the wrapped model and fill them (collective for "rank0")."""
        if not self.whole:
            self._materialize(prepared)

    def _materialize(self, model: nn.Module) -> None:
        with _in_place():
            # FSDP2's CPU offload keeps the shards in host memory and refuses, at the first forward,
            # shards materialised on a GPU ("FSDP parameters should be materialized on CPU"): there, a
            # model bigger than the GPU fits; the buffers go to the device, where forward uses them.
            model.to_empty(device=torch.device("cpu") if self.offload else self.device)
        module = unwrap(model)
        buffers = dict(module.named_buffers(remove_duplicate=False))  # a pipeline stage: its own only
        with torch.no_grad():
            for name, buffer in self.kept_buffers.items():
                if name in buffers:
                    _local(buffers[name]).copy_(buffer)
        if self.source == "rank0":
            self._load(module)
        else:
            self._init(module)
        if self.offload:  # filled in host memory first: the init then runs once, in place (_init)
            _buffers_to(model, self.device)
        if self.tp_mesh is not None:  # hooks registered on meta went with the meta storage (tensor.py)
            from .tensor import keep_gradients_in_parameter_layout

            keep_gradients_in_parameter_layout(module)
        self.weights = {}
        self.replay = None

    def _load(self, module: nn.Module) -> None:
        """Process 0's tensors, broadcast one at a time; each process copies its part of each into its
        own (already allocated) shard in place and drops the rest, so none holds more than its shards
        and one full tensor in flight. Every process calls it, in the same order (process 0's)."""
        rank = dist.get_rank()
        order = [[(n, t.shape, t.dtype, self.aliases.get(n, [])) for n, t in self.weights.items()]]
        dist.broadcast_object_list(order, src=0)
        local = dict(
            itertools.chain(
                module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
            )
        )
        for name, shape, dtype, aliases in order[0]:
            if rank == 0:
                full = self.weights.pop(name).to(self.device)  # process 0's copy goes as it is sent
            else:
                full = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(full, src=0)
            for target in {id(local[n]): local[n] for n in [name, *aliases] if n in local}.values():
                _copy_part(in_stored_layout(target, full), target)  # a fused q|k|v's rows are permuted

    def _init(self, module: nn.Module) -> None:
        """The model's own init: replayed whole on every process (each keeps its part), or where that
        cannot be done, run on this process's shards; a tensor it leaves unfilled is refused."""
        root = self.root if self.root is not None else module
        why = "it could not be copied before sharding" if self.replay is None else None
        if why is None:
            local = dict(
                itertools.chain(
                    module.named_parameters(remove_duplicate=False),
                    module.named_buffers(remove_duplicate=False),
                )
            )

            def place(names: list[str], full: torch.Tensor) -> None:
                full = full.to(self.device)
                for target in {id(local[n]): local[n] for n in names if n in local}.values():
                    _copy_part(in_stored_layout(target, full), target)

            # a process holding every tensor whole on the CPU runs the init once, in place; a fused
            # projection's permuted rows (parallel/fused.py) exist under tensor parallel only
            held = _held_locally(local) if self.tp_mesh is None else None
            why, left = replay_init(self.replay, place, held)
            if why is None:
                if self.replay.caveat:
                    logger.warning(self.replay.caveat)
                _refuse_unset(root, left)  # every process replayed every tensor: the same names on all
                return
        logger.warning(
            "%s was built on the meta device and its init cannot be replayed as the normal build ran it "
            "(%s): it runs on each process's shards, so its values depend on the layout and the world size",
            type(root).__name__,
            why,
        )
        self._init_shards(module, root)

    def _init_shards(self, module: nn.Module, root: nn.Module) -> None:
        """The init run on this process's shards (each drawn from this rank's generator)."""
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        fresh = {n: t for n, t in tensors.items() if n not in self.kept_buffers}
        with torch.no_grad():
            for tensor in fresh.values():
                fill_unset(_local(tensor))
        with torch.no_grad():  # as torchtitan calls init_weights: in-place fills of leaf parameters
            if callable(getattr(root, "init_weights", None)):
                root.init_weights()
            else:
                for sub in module.modules():
                    if callable(getattr(sub, "reset_parameters", None)):
                        sub.reset_parameters()
                if callable(getattr(root, "_init_weights", None)):
                    root.apply(root._init_weights)
        left = [n for n, t in fresh.items() if is_unset(_local(t))]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()  # pipeline stages hold different tensors:
            dist.all_gather_object(everyone, left)  # every process raises, naming all of them
            left = sorted({name for names in everyone for name in names})
        _refuse_unset(root, left)
        if self.tp_mesh is not None:  # replicated tensors of a TP group: the group's first rank's values
            from .tensor import _broadcast_replicated

            _broadcast_replicated(module, self.tp_mesh)
        # a weight tied across pipeline stages (GPT's wte / lm_head) was drawn on each holding rank:
        # the first holder's copy for all (unison.parallel.pipeline's groups of the ranks holding each)
        for params, group in getattr(module, "_tie_groups", ()):
            for param in params:
                dist.broadcast(_local(param).detach(), src=dist.get_global_rank(group, 0), group=group)


def _held_locally(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This process's part of each tensor by name (a DTensor's local tensor), one object per tensor
    held under several names (a tied weight)."""
    parts: dict[int, torch.Tensor] = {}
    for tensor in tensors.values():
        if id(tensor) not in parts:
            parts[id(tensor)] = _local(tensor)
    return {name: parts[id(tensor)] for name, tensor in tensors.items()}


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move every buffer of `model` to `device` (parameters stay where they are)."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(device))  # re-registers it, persistent or not as it was


@contextlib.contextmanager
def _in_place() -> Iterator[None]:
    """Module.to / to_empty that keep each parameter object (torch's public swap_tensors switch).

    By default a move to or from the meta device makes a new Parameter per module that holds it, so
    a tied weight (GPT's wte.weight is lm_head.weight) would become two, and an optimizer built from
    the model would hold neither. Swapping keeps one object, on the new device.
    """
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _tensors_once(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Every parameter and buffer of `model` by name, a tensor held under several names (a tied weight)
    once, under its first name; and those other names."""
    first: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    named = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for name, tensor in named:
        if id(tensor) in first:
            aliases.setdefault(first[id(tensor)], []).append(name)
        else:
            first[id(tensor)] = name
            tensors[name] = tensor.detach()
    return tensors, aliases


def in_stored_layout(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` as `target` stores it (see parallel/fused.py); fused.py loads only where TP was applied."""
    fused = sys.modules.get("unison.parallel.fused")
    return full if fused is None else fused.in_stored_layout(target, full)


@torch.no_grad()
def _copy_part(full: torch.Tensor, target: torch.Tensor) -> None:
    """Copy into `target` its part of `full`: all of it, or a DTensor's local shard (sliced locally by
    torch's distribute_tensor without communication, src_data_rank=None)."""
    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        part = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(full)


def _refuse_unset(root: nn.Module, left: list[str]) -> None:
    """The same error on every process for tensors the model's init left unset (NaN-filled)."""
    if not left:
        return
    raise ValueError(
        f"{type(root).__name__} was built on the meta device and its own init left "
        f"{len(left)} tensor(s) unset: {', '.join(left[:5])}{' ...' if len(left) > 5 else ''}. "
        "prepare() fills a model built inside unison.init_empty_weights() with the root's "
        "init_weights(), else each submodule's reset_parameters() and the root's "
        "_init_weights(module). Give the model an init_weights() that sets every tensor, or "
        "build these buffers outside init_empty_weights(), or load real weights on process 0."
    )


def deferred_model(
    model: nn.Module, config: ParallelismConfig, mesh: DeviceMesh | None, device: torch.device
) -> DeferredModel | None:
    """What prepare() must do for a model built (on some process) on the meta device; None when no
    process did. Collective: every process calls it, and gets the same decision or the same error."""
    source = _source(_codes_of_every_process(_meta_code(model), device), model)
    if source is None:
        return None
    tp_mesh = mesh["tp"] if (config.tp_size or 1) > 1 and mesh is not None else None
    deferred = DeferredModel(
        source=source,
        device=device,
        whole=_holds_whole_model(config),
        tp_mesh=tp_mesh,
        offload=config.offload,
    )
    logger.info(
        "%s is on the meta device: sharded first, then each process materialises its own shards (%s)",
        type(model).__name__,
        "weights broadcast from process 0" if source == "rank0" else "the model's own init",
    )
    return deferred
