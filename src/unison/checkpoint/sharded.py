"""Sharded model and optimizer state in a checkpoint, through torch's distributed checkpoint (DCP).

A model whose state is spread over processes (FSDP2/ZeRO-2/3 and tensor-parallel DTensor parameters,
ZeRO-1's ZeroRedundancyOptimizer, pipeline stages that each hold some of the model's keys) is saved as
a DCP directory per part: `model_<i>/` and `optimizer_<j>/`, each holding one `__<rank>_0.distcp` file
per process and DCP's `.metadata`. Every process writes only its own shards; replicated tensors are
written once (DCP gives each to one process). Keys are the model's fully-qualified parameter names
(FQNs), for the optimizer in torch's flattened form (`state.<fqn>.exp_avg`,
`param_groups.<fqn>.lr`), so a checkpoint loads under any other layout: DCP reads, on each process,
exactly the pieces of the saved tensors that its own shards cover.

Plain and DDP models keep the `model_<i>.pt` / `optimizer_<j>.pt` files of `training_state`: one
torch.save by the main process is the fastest way to write replicated state (benchmarks/checkpoint.py
holds it to 1.2x of a bare torch.save), and those files load into sharded layouts here too
(`apply_full_model_state`, `apply_full_optimizer_state`).

The guarantees of the checkpoint directory hold unchanged: DCP writes into the temporary directory of
`storage.write_checkpoint`, whose manifest lists and checksums every file (each process its own
`__<rank>_0.distcp`). Loading reads into fresh tensors shaped like the live shards while every process
verifies its share of the checksums, and applies them only after every check has passed. Nothing in a
checkpoint is unpickled with code execution: reading goes through dcp_reading's `SafeFileSystemReader` and
`SafeLoadPlanner`.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ..parallel.ddp import unwrap
from .dcp_reading import DCP_METADATA, SafeLoadPlanner, dcp_load
from .errors import CheckpointError, model_keys_error

_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
_OPTIMIZER_STATE_PREFIX = "state."


def _is_zero1(optimizer: object) -> bool:
    """Whether `optimizer` is ZeRO-1's ZeroRedundancyOptimizer, without importing its module: imported
    after the group formed, it binds that group into a default argument and holds it past
    destroy_process_group (docs/failures.md, "Known limits"). None exists unless it was imported."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


# -- which layout is sharded -----------------------------------------------------------------------
@dataclass(frozen=True)
class ModelLayout:
    """How one model's state lies across the processes, agreed on by all of them.

    sharded: its state goes through DCP. True when any process holds a DTensor parameter or buffer
    (FSDP2, tensor parallel), an optimizer of it is a ZeroRedundancyOptimizer (ZeRO-1), or the
    processes do not all hold the same state-dict keys (pipeline stages).
    optimizers: indices (into the list given to `model_layouts`) of the optimizers of its parameters.
    """

    sharded: bool
    optimizers: tuple[int, ...]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside unison's AcceleratedOptimizer (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this process's state: ZeRO-1's per-rank inner optimizer, else itself.

    ZeRO-1 copies its param_groups' hyper-parameters to the inner optimizer only when it steps, so a
    scheduler step since then (the usual loop: optimizer.step(); scheduler.step(); save_state) has not
    reached the inner one yet: they are copied here, as the next step would, before it is read.
    """
    optimizer = _torch_optimizer(optimizer)
    if not _is_zero1(optimizer):
        return optimizer
    _copy_hyper_parameters(optimizer.param_groups, optimizer.optim.param_groups)
    return optimizer.optim


def _copy_hyper_parameters(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Every value of each param group but its parameters, from `source` into `target` (in place)."""
    for source_group, target_group in zip(source, target, strict=True):
        target_group.update((key, value) for key, value in source_group.items() if key != "params")


def optimizers_by_model(
    models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> list[tuple[int, ...]]:
    """For each model, the indices of the optimizers whose parameters are its parameters.

    An optimizer belongs to the model that holds its first parameter; an optimizer without
    parameters belongs to none.
    """
    owner_of = {id(p): i for i, model in enumerate(models) for p in unwrap(model).parameters()}
    owned: list[list[int]] = [[] for _ in models]
    for j, optimizer in enumerate(optimizers):
        params = [p for group in _torch_optimizer(optimizer).param_groups for p in group["params"]]
        if params and id(params[0]) in owner_of:
            owned[owner_of[id(params[0])]].append(j)
    return [tuple(indices) for indices in owned]


def model_layouts(
    models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer] = ()
) -> list[ModelLayout]:
    """The layout of each model (see ModelLayout). Collective: every process calls it, in the same order.

    One all_gather_object of a few bytes per model (a flag and a hash of the state-dict keys) makes
    every process take the same decision, which DCP's collectives require.
    """
    owned = optimizers_by_model(models, optimizers)
    local = []
    for model, indices in zip(models, owned):
        module = unwrap(model)
        tensors = [*module.parameters(), *module.buffers()]
        zero1 = any(_is_zero1(_torch_optimizer(optimizers[j])) for j in indices)
        keys = hashlib.sha256("\n".join(sorted(module.state_dict())).encode()).hexdigest()
        local.append((zero1 or any(isinstance(t, DTensor) for t in tensors), keys))
    everyone = [local]
    if _distributed():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
    layouts = []
    for i, indices in enumerate(owned):
        same_keys = len({facts[i][1] for facts in everyone}) == 1
        sharded = not same_keys or any(facts[i][0] for facts in everyone)
        if sharded:
            _check_optimizers_stay_in_model(models[i], [optimizers[j] for j in indices])
        layouts.append(ModelLayout(sharded=sharded, optimizers=indices))
    return layouts


def _check_optimizers_stay_in_model(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """A sharded optimizer state is keyed by its model's parameter names: all its parameters need one."""
    names = {id(p) for p in unwrap(model).parameters()}
    for optimizer in optimizers:
        inner = _torch_optimizer(optimizer)
        foreign = sum(id(p) not in names for group in inner.param_groups for p in group["params"])
        if foreign:
            raise ValueError(
                f"a {type(inner).__name__} holds {foreign} parameters of another model besides those of "
                f"{type(unwrap(model)).__name__}: a sharded checkpoint keys optimizer state by the model's "
                "parameter names, so each optimizer must optimize one model. Create one optimizer per model."
            )


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    """Fresh tensors shaped (and, for DTensors, sharded) like `state`'s, to load into before applying."""
    return {
        key: torch.empty_like(value) if isinstance(value, torch.Tensor) else value
        for key, value in state.items()
    }


@contextlib.contextmanager
def _grads_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """No gradients while torch's state-dict helpers run: they take a zero-learning-rate step to create a
    fresh optimizer's state only when no gradient is present, and read or load no state otherwise."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    return any(optimizer.state.values())


def _any_process(flag: bool) -> bool:
    if not _distributed():
        return flag
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return any(flags)


# -- saving ----------------------------------------------------------------------------------------
def save_model_state(model: nn.Module, directory: Path) -> None:
    """Write `model`'s state (its shards on each process) as a DCP directory. Collective."""
    write_part(model_state(model), directory)


def save_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Write `optimizer`'s state, keyed by `model`'s parameter names, as a DCP directory. Collective."""
    write_part(optimizer_state(model, optimizer), directory)


def write_part(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None = None) -> None:
    """Write a part's state (this process's shards) as a DCP directory, agreeing over `group` (None: the
    default group; an asynchronous save writes from its own thread over a group of its own). Collective."""
    dcp.save(state, storage_writer=FileSystemWriter(directory), process_group=group)


def model_state(model: nn.Module) -> dict[str, Any]:
    """`model`'s state as a sharded part holds it: its parameter names, this process's shards (live)."""
    return get_model_state_dict(unwrap(model))


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer`'s state as a sharded part holds it, keyed by `model`'s parameter names. Collective.

    An optimizer that has not stepped yet has hyper-parameters but no state: torch's helper would create
    state by taking a zero-learning-rate step (Adam's step counter then reads 1), so that state is
    dropped from the live optimizer again and only the hyper-parameters are kept.
    """
    local = _local_optimizer(optimizer)
    stepped = _any_process(_has_state(local))
    state: dict[str, Any] = {}
    if any(group["params"] for group in local.param_groups):  # ZeRO-1 can leave a process none
        with _grads_set_aside(local):
            state = get_optimizer_state_dict(unwrap(model), local, options=_FLAT_OPTIMIZER)
        if not stepped:
            state = {k: v for k, v in state.items() if not k.startswith(_OPTIMIZER_STATE_PREFIX)}
            local.state.clear()
        state = _with_tied_aliases(unwrap(model), state)
    return state


def _with_tied_aliases(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The state of a tied weight under each of its names, not only the first.

    torch keys a tied parameter's optimizer state by its first name (`transformer.wte.weight`); a
    pipeline stage that holds the same weight under another name (the head, `lm_head.weight`) finds
    its state under that name too. Loading reads only the names the live optimizer has.
    """
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    aliases = dict(state)
    for first, *others in (group for group in names.values() if len(group) > 1):
        for section in ("state.", "param_groups."):
            prefix = f"{section}{first}."
            for key in [key for key in state if key.startswith(prefix)]:
                aliases.update((f"{section}{other}.{key[len(prefix) :]}", state[key]) for other in others)
    return aliases


# -- loading ---------------------------------------------------------------------------------------
def is_sharded_part(directory: Path) -> bool:
    """Whether `directory` (e.g. checkpoint/model_0) holds a part saved through DCP."""
    return (directory / DCP_METADATA).is_file()


def model_keys_everywhere(models: Sequence[nn.Module]) -> list[frozenset[str]]:
    """For each model, the state-dict keys it has on any process (a pipeline stage holds only its own
    modules' keys): what a checkpoint's keys are checked against. Collective."""
    local = [sorted(get_model_state_dict(unwrap(model))) for model in models]
    everyone = [local]
    if _distributed():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
    return [frozenset(key for keys in everyone for key in keys[i]) for i in range(len(models))]


def read_model_state(
    model: nn.Module,
    directory: Path,
    strict: bool = True,
    model_keys: frozenset[str] | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """Read a DCP model part into new tensors laid out like `model`'s own (nothing applied). Collective.

    strict: the checkpoint must hold exactly the model's keys (`model_keys`, see model_keys_everywhere;
    None: this process's, which every layout but pipeline stages holds whole). strict=False reads the keys
    both have; the model's others are left out of the result, to keep their values.
    prefix: what the part puts before each name (Accelerate's FSDP folders save `model.<name>`).
    """
    state = {prefix + key: value for key, value in _empty_like(get_model_state_dict(unwrap(model))).items()}
    wanted = frozenset(prefix + key for key in model_keys) if model_keys else frozenset(state)
    planner = SafeLoadPlanner(strict=strict, model_keys=wanted)
    dcp_load(state, directory, planner)
    for key in planner.missing:  # not in the checkpoint: DCP left the empty tensor, not to be applied
        del state[key]
    return {key.removeprefix(prefix): value for key, value in state.items()}


def apply_model_state(model: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Copy what `read_model_state` read into the model's parameters and buffers (strict=False: those
    it read; the others keep their values)."""
    set_model_state_dict(unwrap(model), state, options=StateDictOptions(strict=strict))


@dataclass
class OptimizerState:
    """What `read_optimizer_state` read: flattened, FQN-keyed state; has_state False for an optimizer
    that was saved before its first step (hyper-parameters only)."""

    state: dict[str, Any]
    has_state: bool


def empty_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """New tensors laid out like this process's optimizer state, flattened and keyed by `model`'s names
    (`state.<name>.exp_avg`, `param_groups.<name>.lr`), to read a checkpoint into. Collective.

    The live optimizer is left as it was (a fresh one stays without state).
    """
    local = _local_optimizer(optimizer)
    if not any(group["params"] for group in local.param_groups):  # ZeRO-1 can leave a process none
        return {}
    fresh = not _has_state(local)
    with _grads_set_aside(local):
        state = _empty_like(get_optimizer_state_dict(unwrap(model), local, options=_FLAT_OPTIMIZER))
    if fresh:
        local.state.clear()
    return state


def read_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> OptimizerState:
    """Read a DCP optimizer part into new tensors laid out like this process's optimizer state. Collective.

    The live optimizer is left as it was (a fresh one stays without state).
    """
    state = empty_optimizer_state(model, optimizer)
    planner = SafeLoadPlanner(optional_prefix=_OPTIMIZER_STATE_PREFIX)
    dcp_load(state, directory, planner)
    return OptimizerState(state, planner.found_optional or not state)


def apply_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: OptimizerState) -> None:
    """Put what `read_optimizer_state` read into the optimizer (ZeRO-1: this process's share)."""
    local = _local_optimizer(optimizer)
    if loaded.state:
        with _grads_set_aside(local):
            set_optimizer_state_dict(unwrap(model), local, loaded.state, options=_FLAT_OPTIMIZER)
        if not loaded.has_state:
            local.state.clear()
    _sync_zero_param_groups(optimizer)


def _sync_zero_param_groups(optimizer: torch.optim.Optimizer) -> None:
    """ZeRO-1 copies hyper-parameters from its own param_groups to the inner optimizer at every step, so
    what was loaded into the inner one must reach the outer groups too (schedulers read those)."""
    outer = _torch_optimizer(optimizer)
    if _is_zero1(outer):
        _copy_hyper_parameters(outer.optim.param_groups, outer.param_groups)


def check_full_model_state(
    model: nn.Module, state: dict[str, torch.Tensor], model_keys: frozenset[str] | None = None
) -> None:
    """Raise CheckpointError unless `state` (a whole-model state dict) has every key `model` holds on
    this process, and, given `model_keys` (the model's keys on any process), none beyond them."""
    wanted = model_keys if model_keys is not None else get_model_state_dict(unwrap(model))
    missing = sorted(key for key in wanted if key not in state)
    unexpected = [] if model_keys is None else sorted(set(state) - model_keys)
    if missing or unexpected:
        raise model_keys_error(missing, unexpected)


def streamed_parts(names: set[str], model_parts: dict[str, tuple[nn.Module, Any]]) -> set[str]:
    """Of the whole files (a plain or DDP run's) to load into a sharded layout, those the main process
    alone reads and sends on one tensor at a time: every model file, and the optimizer files but
    ZeRO-1's (ZeroRedundancyOptimizer loads the whole state on every process itself)."""
    return {
        name
        for name in names
        if model_parts[name][1] is model_parts[name][0]
        or not _is_zero1(_torch_optimizer(model_parts[name][1]))
    }


def apply_full_model_state(
    model: nn.Module, state: dict[str, torch.Tensor] | None, strict: bool = True, streamed: bool = False
) -> None:
    """Load a consolidated state dict (a plain or DDP run's `model_<i>.pt`) into any layout.

    Each process keeps the slices its shards cover; a pipeline stage takes only its own keys.
    strict=False loads the keys both have and leaves the model's others as they are.
    Collective under sharded layouts (the full tensors are distributed to the shards).
    streamed: only the main process has `state` (the others pass None; its keys were checked against
    every process's with check_full_model_state); it is broadcast one tensor at a time, so no other
    process ever holds more than its shards and one full tensor (torch's broadcast_from_rank0).
    """
    if streamed and _distributed():
        # every key is sent (each process keeps its own), so the load itself cannot be strict
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(unwrap(model), state or {}, options=options)
        return
    if strict:
        check_full_model_state(model, state)
    module = unwrap(model)
    own = {key: state[key] for key in get_model_state_dict(module) if key in state}
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, own, options=options)


def check_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Raise CheckpointError unless a plain optimizer state dict (keyed by parameter position) has
    as many parameters and groups as `optimizer`, whose positions it is read by."""
    outer = _torch_optimizer(optimizer)
    live = [len(group["params"]) for group in outer.param_groups]
    saved = [len(group["params"]) for group in state["param_groups"]]
    if live != saved:
        raise CheckpointError(
            f"the checkpoint's optimizer state has parameter groups of {saved} parameters, this process's "
            f"optimizer {live}: a plain or DDP run's optimizer state is keyed by parameter position, so it "
            "loads into an optimizer over the same parameters (any layout but a pipeline stage). Save it "
            "again under a sharded layout (keyed by parameter name), or build the optimizer as the saving "
            "run did."
        )


def apply_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any] | None, streamed: bool = False
) -> None:
    """Load a plain optimizer state dict (keyed by parameter position) into any layout's optimizer.

    As torch's own `load_state_dict`, this relies on the optimizer listing its parameters in the same
    order as the one that saved it (the same code building it). ZeRO-1's optimizer reads the plain form
    itself; others get it keyed by parameter name and sliced to their shards.
    streamed: only the main process has `state` (checked there); it is broadcast one tensor at a time.
    """
    outer = _torch_optimizer(optimizer)
    if streamed and _distributed():
        by_name = _by_name(unwrap(model), outer, state) if state is not None else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        with _grads_set_aside(outer):
            set_optimizer_state_dict(unwrap(model), outer, by_name, options=options)
        return
    check_full_optimizer_state(optimizer, state)
    if _is_zero1(outer) or not state["state"]:
        outer.load_state_dict(state)
        return
    apply_named_optimizer_state(model, optimizer, _by_name(unwrap(model), outer, state))


def apply_named_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a whole optimizer state dict keyed by `model`'s parameter names (what FSDP's FULL_STATE_DICT
    saves) into any layout's optimizer, each process keeping the slices of its shards."""
    outer = _torch_optimizer(optimizer)
    with _grads_set_aside(outer):
        set_optimizer_state_dict(unwrap(model), outer, state, options=StateDictOptions(full_state_dict=True))


def _by_name(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A plain optimizer state dict keyed by the names of `optimizer`'s parameters in `module`."""
    live = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [index for group in state["param_groups"] for index in group["params"]]
    name_of = {id(p): name for name, p in module.named_parameters()}
    fqn = {index: name_of[id(p)] for index, p in zip(saved, live)}
    return {
        "state": {fqn[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [fqn[i] for i in group["params"]]} for group in state["param_groups"]
        ],
    }
