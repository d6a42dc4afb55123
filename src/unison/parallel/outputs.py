"""A model's output in any container under FSDP2 (ZeRO-2/3) and DDP: the engines see its tensors, the
user gets the container back.

Both engines act on the tensors of a forward's output, and find them by walking the output: FSDP2
registers its pre-backward hook (which gathers a ZeRO-3 unit's parameters again for backward, and queues
the end-of-backward work) on the grad-requiring tensors inside dicts, lists, tuples, NamedTuples and
dataclasses (torch 2.13's `collect_grad_tensors`; earlier versions walked it with torch's pytree, which has
no dataclasses), and DDP, with find_unused_parameters=True or static_graph=True, searches the graph from
the tensors it finds (`_find_tensors`) and runs them through its `_DDPSink` (torch's pytree again), which
replaces them by clones. A tensor held in an attribute of another object (a `types.SimpleNamespace`, a
class of the user's) is invisible to them: ZeRO-3 crashed in the first backward ("setStorage: sizes [...]
out of bounds for storage of size 0": the unit's parameters were never gathered again), ZeRO-2 and DDP
under static_graph (dataclasses too) trained to wrong parameters without a word, and DDP with
find_unused_parameters failed with "Expected to mark a variable ready only once".

So a forward hook that runs before the engine's own (`convert`) replaces each such object, where it holds
a tensor that requires grad, by a plain list `[_Recipe, value, ...]` the engines walk, and a second hook
that runs after the engine's (`rebuild`) turns each list back into a shallow copy of the user's object
with its attributes set to the values found there (DDP's clones, where DDP replaced them). Only torch's
public module hooks are used: no type is registered with torch's pytree (private, and global).

- FSDP2 (`hook_sharded_outputs`): on every module `fully_shard` was applied to. `fully_shard` registers its
  post-forward hook when it is applied, so `convert`, registered afterwards with prepend=True, runs before
  it, and `rebuild`, appended, after it: each unit's parent sees the user's objects.
- DDP (`hook_ddp_outputs`): only with find_unused_parameters or static_graph (otherwise DDP ignores the
  output). `rebuild` is a forward hook on the DistributedDataParallel wrapper; `convert` is on the user's
  module, registered at the first forward through the wrapper, so after the hooks prepare() adds to that
  module (autocast's output conversion sees the user's objects, as on one process), and acts only inside
  the wrapper's forward: the unwrapped module called on its own returns its objects untouched.

Outputs without such objects (tensors, tuples, dicts, Hugging Face ModelOutputs, NamedTuples) come back
as they were, at the cost of one walk. Nothing is converted under `torch.no_grad()` (neither engine acts
on the output then), so evaluation costs nothing more. A forward that runs again in backward (activation
checkpointing) converts and rebuilds as the first did; FSDP2's post-forward then only casts.

An object is rebuilt from `copy.copy` with its `__dict__` entries (a dataclass: its fields, so frozen
and slotted dataclasses too) set by `object.__setattr__`. One that keeps grad-requiring tensors in
`__slots__` (no `__dict__` entry to set) is refused at its first forward, on every process (each runs
the same forward), with what to return instead.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
_OPAQUE = (nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
"""Never entered: a module (its parameters are no output), a class, a function."""

_HOOKED = "_unison_output_containers"
"""Set on a module (FSDP2 unit or DDP wrapper) whose outputs are hooked here: it is hooked once."""


class _Recipe:
    """The first item of the list that stands for a user's object: the shallow copy to fill and the
    names of its attributes that the list's other items hold, in order. No dataclass, tuple or dict:
    the engines leave it alone (a leaf)."""

    __slots__ = ("names", "target")

    def __init__(self, target: Any, names: list[str]) -> None:
        self.target, self.names = target, names

    def fill(self, values: list[Any]) -> Any:
        for name, value in zip(self.names, values, strict=True):
            object.__setattr__(self.target, name, value)  # a frozen dataclass too
        return self.target


def convert(output: Any, producer: str = "the model") -> Any:
    """`output` with every object the engines do not walk that holds a grad-requiring tensor replaced by a
    `[_Recipe, value, ...]` list (recursively), and the containers on the way rebuilt; `output` itself
    when there is none. Raises TypeError for such an object that cannot be rebuilt, naming `producer`."""
    if not torch.is_grad_enabled():
        return output
    return _convert(output, set(), producer)[0]


def rebuild(output: Any) -> Any:
    """`output` with each `[_Recipe, value, ...]` list `convert` made turned back into the user's object."""
    return _rebuild(output)


def _convert(value: Any, path: set[int], producer: str) -> tuple[Any, bool]:
    """(value converted, whether it holds a tensor that requires grad)."""
    if isinstance(value, torch.Tensor):
        return value, value.requires_grad
    if isinstance(value, _ATOMS) or isinstance(value, _OPAQUE) or id(value) in path:
        return value, False  # an object met again on its own path (a cycle) is left as it is
    path.add(id(value))
    try:
        if isinstance(value, dict):  # OrderedDict, defaultdict, ModelOutput too: walked by both engines
            converted = {key: _convert(item, path, producer) for key, item in value.items()}
            found = any(grad for _, grad in converted.values())
            return _replace_items(value, {key: item for key, (item, _) in converted.items()}), found
        if isinstance(value, list | tuple):  # NamedTuples and torch.return_types too
            pairs = [_convert(item, path, producer) for item in value]
            return _replace_sequence(value, [item for item, _ in pairs]), any(grad for _, grad in pairs)
        return _convert_object(value, path, producer)
    finally:
        path.discard(id(value))


def _convert_object(value: Any, path: set[int], producer: str) -> tuple[Any, bool]:
    if dataclasses.is_dataclass(value):  # its fields, as torch walks it (slotted and frozen ones too)
        names = [field.name for field in dataclasses.fields(value)]
    else:
        _refuse_tensors_in_slots(value, path, producer)
        if not hasattr(value, "__dict__"):
            return value, False
        names = list(vars(value))
    pairs = [_convert(getattr(value, name), path, producer) for name in names]
    if not any(grad for _, grad in pairs):
        return value, False
    kept = [(name, item) for name, (item, grad) in zip(names, pairs, strict=True) if grad]
    return [_Recipe(copy.copy(value), [name for name, _ in kept]), *(item for _, item in kept)], True


def _slot_names(kind: type) -> list[str]:
    """The attributes `kind`'s instances keep in slots (private names mangled as Python stores them)."""
    names = []
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            names.append(name)
    return names


def _refuse_tensors_in_slots(value: Any, path: set[int], producer: str) -> None:
    """Raise TypeError if `value` holds a grad-requiring tensor in a slot (no `__dict__` entry to replace)."""
    holding = [
        name
        for name in _slot_names(type(value))
        if hasattr(value, name) and _convert(getattr(value, name), path, producer)[1]
    ]
    if holding:
        kind = type(value)
        raise TypeError(
            f"{producer} returned a {kind.__module__}.{kind.__qualname__} holding tensors that require grad "
            f"in its slot attribute(s) {', '.join(holding)}: FSDP2 (ZeRO-2/3) and DDP with "
            "find_unused_parameters or static_graph see only the tensors in tuples, lists, dicts, "
            "dataclasses and NamedTuples, and unison can hand them another object's tensors only through "
            "its __dict__, which a class with __slots__ lacks (left alone, ZeRO-3 would fail in backward, "
            "ZeRO-2 and DDP would compute wrong gradients or fail). Return these tensors in a tuple, dict, "
            "dataclass or NamedTuple instead (or give the class a __dict__)."
        )


def _replace_items(mapping: dict, items: dict) -> dict:
    if all(items[key] is value for key, value in mapping.items()):
        return mapping
    if type(mapping) is dict:
        return items
    replaced = copy.copy(mapping)  # its own type (a ModelOutput keeps its attributes in step)
    for key, value in items.items():
        if value is not mapping[key]:
            replaced[key] = value
    return replaced


def _replace_sequence(sequence: list | tuple, items: list) -> list | tuple:
    if all(new is old for new, old in zip(items, sequence, strict=True)):
        return sequence
    if type(sequence) is list or type(sequence) is tuple:
        return type(sequence)(items)
    if hasattr(sequence, "_fields"):  # a NamedTuple
        return type(sequence)(*items)
    return type(sequence)(items)


def _rebuild(value: Any) -> Any:
    if isinstance(value, torch.Tensor) or isinstance(value, _ATOMS):
        return value
    if isinstance(value, list) and value and type(value[0]) is _Recipe:
        return value[0].fill([_rebuild(item) for item in value[1:]])
    if isinstance(value, dict):
        return _replace_items(value, {key: _rebuild(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return _replace_sequence(value, [_rebuild(item) for item in value])
    return value


class _ShardedUnitHooks:
    """`convert` before FSDP2's post-forward on one unit, `rebuild` after it (see the module docstring).
    Nothing runs between the two but FSDP2's hook, so one flag says whether the second has work."""

    def __init__(self, producer: str) -> None:
        self.producer = producer
        self.converted = False

    def before_engine(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.converted = False
        converted = convert(output, self.producer)
        if converted is output:
            return None
        self.converted = True
        return converted

    def after_engine(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self.converted:
            return None
        self.converted = False
        return rebuild(output)


def hook_sharded_outputs(model: nn.Module) -> None:
    """Hook the outputs of every FSDP2 unit in `model` (call after the last `fully_shard` on it); a unit
    hooked already is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule) and not hasattr(module, _HOOKED):
            # the user's class: the first in the MRO of fully_shard's FSDP<name> class that is not FSDP's
            user_class = next(kind for kind in type(module).__mro__ if not issubclass(kind, FSDPModule))
            hooks = _ShardedUnitHooks(f"{user_class.__name__}.forward")
            handles = [
                module.register_forward_hook(torch.compiler.disable(hooks.before_engine), prepend=True),
                module.register_forward_hook(torch.compiler.disable(hooks.after_engine)),
            ]
            setattr(module, _HOOKED, handles)


class _DDPHooks:
    """`convert` on the user's module inside DDP's forward, `rebuild` on the wrapper after it."""

    def __init__(self) -> None:
        self.inside = 0  # forwards of the wrapper under way
        self.converted = False
        self.handle: Any = None

    def enter(self, wrapper: DistributedDataParallel, args: Any) -> None:
        if self.handle is None:  # now, after the hooks prepare() put on the user's module
            self.handle = wrapper.module.register_forward_hook(torch.compiler.disable(self.before_engine))
        self.inside += 1
        self.converted = False

    def before_engine(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self.inside:
            return None  # the user's module called on its own
        converted = convert(output, f"{type(module).__name__}.forward")
        if converted is output:
            return None
        self.converted = True
        return converted

    def after_engine(self, wrapper: DistributedDataParallel, args: Any, output: Any) -> Any:
        self.inside = max(self.inside - 1, 0)  # called also when the forward failed, even before `enter`
        if not self.converted:
            return None
        self.converted = False
        return rebuild(output)


def hook_ddp_outputs(wrapper: DistributedDataParallel) -> None:
    """Hook the outputs of a DDP `wrapper` that acts on them (find_unused_parameters or static_graph)."""
    if hasattr(wrapper, _HOOKED) or not (wrapper.find_unused_parameters or wrapper.static_graph):
        return
    hooks = _DDPHooks()
    handles = [
        wrapper.register_forward_pre_hook(torch.compiler.disable(hooks.enter)),
        wrapper.register_forward_hook(torch.compiler.disable(hooks.after_engine), always_call=True),
    ]
    setattr(wrapper, _HOOKED, handles)
