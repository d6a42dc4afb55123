"""A meta-built model's own init, replayed as the normal build ran it: the same values on any layout.

Built normally, a model's values come from its init drawing on the CPU generator in one order: every
module's `reset_parameters()` as it is constructed, then (nanoGPT's and Hugging Face's convention) the
root's `_init_weights(module)` over the modules in `Module.apply`'s order. Built inside
`unison.init_empty_weights()`, those calls ran on meta tensors, which draw nothing. Running the init
afterwards on each rank's shards would draw each shard from its rank's generator: a valid init, but
another one on every world size and layout (the tiny GPT of examples/gpt at 2 processes: 0.11 from
the one-process model after prepare(), 0.56 after 4 SGD steps).

So every rank replays the whole init on a meta copy of the model taken before sharding (the
"template"), one group of tensors at a time, from the generator state noted when the model's first
tensor was built (`init_empty_weights()` notes it on each tensor, with the module it was created for;
without it, from the current state):

1. a dry pass runs each call in the normal order with only the tensors of the module it is called on
   (and of the modules tied to it) allocated, full size on the CPU, and notes the generator's state
   before it;
2. then, for each group of modules that share a tensor (a tied embedding) in turn, their tensors are
   allocated full on the CPU, filled with NaN, the calls on those modules run again from the states
   noted, and each tensor is handed to `place` (which copies this rank's part into its shard) and
   freed.

Every rank makes the same draws, so every value is the normal build's whatever the layout, and no
rank holds more than its shards and one group of full tensors (the largest module, not the model).
Each call runs twice: the init's compute is doubled, on the CPU of every rank.

A process that holds every tensor whole in host memory (one process: its shards are the full tensors,
as under ZeRO-2/3 with offload=true; or DDP on the CPU) has no part to cut out: the calls run once, in
order, each on its module's tensors bound to this process's own (`held`), so the init writes in place,
as a normal build's does, and nothing is allocated beyond the model. A weight tied after
construction (GPT's `wte.weight = lm_head.weight`) is what the normal build made it: the
`reset_parameters()` of the module that took another's tensor draws into a tensor of its own, dropped.
The CPU generator is put back where the caller left it.

The replay needs each call to touch only the tensors of the module it is called on (true of torch's
Linear, Embedding, LayerNorm, convolutions and of nanoGPT-style `_init_weights`). A call that reaches
another module's tensors (they are on meta during the dry pass), or a root `init_weights()` (one call
over the whole model: torchtitan's and Hugging Face's), cannot be replayed a module at a time; for
those `replay_init` says why and places nothing (in the single pass, what ran has already written
into the held tensors; the caller's fallback fills them again).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

# the attribute init_empty_weights() sets on each tensor registered in its block (a _Built)
BUILT_AT = "_unison_built_at"
_registrations = itertools.count()


class BuildNotes:
    """What one init_empty_weights() block notes on each meta tensor registered in it (`note`, a
    global module registration hook for the block): the module it was created for, and the CPU
    generator's state, where a normal build's draws for it would start (meta draws consume none).

    Models built one after the other from the same state (no seed, no real draw between) start from
    it alike; built normally, each would start where the previous one's init ended. So each replay
    records where it ended (`ends`), and the model registered next starts from there. The last tensor
    registered on each module (`last`) gives the order the modules were built in.
    """

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.since = 0  # the registration that first saw `state`
        self.ends: dict[int, torch.Tensor] = {}  # registration -> the state a normal build reaches there
        # id() of a module -> its first new tensor's (registration, generator state, `since`), and its
        # last new tensor's registration (a tensor since replaced by a tie counts: it was built)
        self.first: dict[int, tuple[int, torch.Tensor, int]] = {}
        self.last: dict[int, int] = {}

    def note(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or not tensor.is_meta or hasattr(tensor, BUILT_AT):
            return  # a tie registers a tensor again: its first registration made it
        order = next(_registrations)
        now = torch.get_rng_state()
        if self.state is None or not torch.equal(self.state, now):
            self.state, self.since = now, order
        self.first.setdefault(id(module), (order, self.state, self.since))
        self.last[id(module)] = order
        setattr(tensor, BUILT_AT, _Built(id(module), self))


@dataclass(frozen=True)
class _Built:
    creator: int  # id() of the module the tensor was first registered on
    notes: BuildNotes  # of the block that built it


@dataclass
class Replay:
    """What the replay needs, taken from the user's model before it is sharded."""

    template: nn.Module  # a meta copy of the unsharded model (no storage)
    start: torch.Tensor | None  # the CPU generator state the model was built at, if known
    # "module.name" of each tensor slot that holds a tensor created for another module (a tie made
    # after construction): that module's reset_parameters() drew into a tensor of its own, since gone
    borrowed: set[str]
    # "module" -> the last tensor registered in its subtree while the block ran: the module's
    # reset_parameters(), at the end of its construction, came after it and before the next one
    constructed: dict[str, int] = field(default_factory=dict)
    ends: tuple[dict[int, torch.Tensor], int] | None = None  # where to record the state it ends at
    caveat: str | None = None  # why `start` may not be where a normal build would have started


def forget_built_at(model: nn.Module) -> None:
    """Drop the notes init_empty_weights() left on `model`'s tensors (read by `replay_of`), so that the
    trained parameters carry nothing of ours (a pickled module would save them)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if hasattr(tensor, BUILT_AT):
            delattr(tensor, BUILT_AT)


def replay_of(model: nn.Module) -> Replay | None:
    """The replay plan of a meta-built `model`, or None when it cannot be copied (deepcopy refuses
    an attribute: a lock, a process group)."""
    try:
        template = copy.deepcopy(model)
    except Exception:
        return None
    notes: BuildNotes | None = None
    borrowed: set[str] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        own = itertools.chain(
            module.named_parameters(recurse=False, remove_duplicate=False),
            module.named_buffers(recurse=False, remove_duplicate=False),
        )
        for name, tensor in own:
            noted = getattr(tensor, BUILT_AT, None)
            if isinstance(noted, _Built):
                notes = notes or noted.notes
                if noted.creator != id(module):
                    borrowed.add(f"{prefix}.{name}" if prefix else name)
    modules = [id(m) for m in model.modules()]
    firsts = [notes.first[m] for m in modules if m in notes.first] if notes else []
    if not firsts:
        return Replay(template, None, borrowed)
    order, state, since = min(firsts, key=lambda first: first[0])
    ends = (notes.ends, max(notes.last[m] for m in modules if m in notes.last) + 1)
    constructed = _constructed(model, notes.last)
    if order == since:
        return Replay(template, state, borrowed, constructed, ends)
    if order in notes.ends:  # built right after a model already replayed: where it ended
        return Replay(template, notes.ends[order], borrowed, constructed, ends)
    caveat = (
        f"{type(model).__name__} was built in an init_empty_weights() block after other tensors, from the "
        "same generator state, and those were not prepared before it: its init starts from that state, "
        "where a normal build would have started after their draws. Seed before building each model, "
        "or prepare the models in the order they were built"
    )
    return Replay(template, state, borrowed, constructed, ends, caveat)


def _constructed(model: nn.Module, last: dict[int, int]) -> dict[str, int]:
    """Each module (by name) whose subtree registered a tensor in the block: the last such
    registration (see `Replay.constructed`)."""
    out: dict[str, int] = {}

    def visit(prefix: str, module: nn.Module) -> int | None:
        mine = [last.get(id(module))]
        for name, child in module.named_children():
            mine.append(visit(f"{prefix}.{name}" if prefix else name, child))
        known = [order for order in mine if order is not None]
        if known:
            out[prefix] = max(known)
        return max(known) if known else None

    visit("", model)
    return out


@dataclass
class _Slot:
    module: nn.Module
    name: str
    is_param: bool
    meta: torch.Tensor
    qualified: str  # "module.name" in the model


class _MetaWatch(TorchFunctionMode):
    """Notes whether any torch function is called on a meta tensor: an init reaching outside the
    module it was called on (whose tensors are the only real ones during the dry pass)."""

    touched = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg in itertools.chain(args, kwargs.values()):
            for value in arg if isinstance(arg, list | tuple) else (arg,):
                if isinstance(value, torch.Tensor) and value.is_meta:
                    self.touched = True
        return func(*args, **kwargs)


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    """The modules in `Module.apply`'s order: children first, each child's subtree in turn."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


@dataclass
class _Call:
    module: nn.Module  # the module it is called on
    run: Callable[[], object]
    constructing: bool  # a reset_parameters() the module's construction ran (before any later tie)


def _calls(root: nn.Module, constructed: dict[str, int]) -> list[_Call] | None:
    """The init calls of a normal build, in order; None when the root has an init_weights() (one call
    over the whole model, not replayable a module at a time).

    The reset_parameters() calls in construction order: `Module.apply`'s (children first, then the
    module holding them, each in the order it was registered), reordered by the registrations the
    block saw (`constructed`) where a module was built before one registered ahead of it."""
    if callable(getattr(root, "init_weights", None)):
        return None
    names = {id(m): n for n, m in root.named_modules()}
    resets: list[tuple[int, _Call]] = []
    seen: set[int] = set()
    key = -1
    for module in _apply_order(root):
        key = constructed.get(names[id(module)], key)  # none noted: right after the one before
        if id(module) not in seen and callable(getattr(module, "reset_parameters", None)):
            seen.add(id(module))
            resets.append((key, _Call(module, module.reset_parameters, True)))
    calls = [call for _, call in sorted(resets, key=lambda pair: pair[0])]  # stable: apply's on ties
    init = getattr(root, "_init_weights", None)
    if callable(init):
        calls.extend(_Call(module, lambda m=module: init(m), False) for module in _apply_order(root))
    return calls


def _groups(root: nn.Module) -> tuple[list[list[_Slot]], dict[int, int]]:
    """Each module's own meta tensors, in groups of modules that share one (a tied weight), and the
    group of each module holding one."""
    slots: dict[int, list[_Slot]] = {}
    for prefix, module in root.named_modules():
        qualified = (prefix + ".") if prefix else ""
        own = [
            _Slot(module, name, True, p, qualified + name)
            for name, p in module.named_parameters(recurse=False, remove_duplicate=False)
            if p.is_meta
        ] + [
            _Slot(module, name, False, b, qualified + name)
            for name, b in module.named_buffers(recurse=False, remove_duplicate=False)
            if b.is_meta
        ]
        if own:
            slots[id(module)] = own
    parent = {key: key for key in slots}

    def find(key: int) -> int:
        while parent[key] != key:
            key = parent[key]
        return key

    holder: dict[int, int] = {}
    for key, own in slots.items():
        for slot in own:
            other = holder.setdefault(id(slot.meta), key)
            parent[find(key)] = find(other)
    members: dict[int, list[_Slot]] = {}
    for key, own in slots.items():
        members.setdefault(find(key), []).extend(own)
    index = {root_key: i for i, root_key in enumerate(members)}
    return list(members.values()), {key: index[find(key)] for key in slots}


def _full(slot: _Slot) -> torch.Tensor:
    data = torch.empty(slot.meta.shape, dtype=slot.meta.dtype, device="cpu")
    fill_unset(data)
    return nn.Parameter(data, requires_grad=slot.meta.requires_grad) if slot.is_param else data


@contextlib.contextmanager
def _allocated(
    slots: list[_Slot], apart: Collection[str] = (), bound: Mapping[int, torch.Tensor] | None = None
) -> Iterator[dict[int, torch.Tensor]]:
    """The slots' tensors, put in place of the meta ones for the block: `bound`'s (by the id of the
    meta tensor), else full size on the CPU, NaN-filled (a tied one once); what they held back
    afterwards, so the full ones can be freed. A slot named in `apart` gets a tensor of its own, not
    returned (drawn into and dropped)."""
    fresh: dict[int, torch.Tensor] = {}
    held = [getattr(slot.module, slot.name) for slot in slots]
    for slot in slots:
        if slot.qualified in apart:
            tensor = _full(slot)
        else:
            tensor = fresh.get(id(slot.meta))
            if tensor is None:
                tensor = bound[id(slot.meta)] if bound is not None else _full(slot)
                fresh[id(slot.meta)] = tensor
        setattr(slot.module, slot.name, tensor)
    try:
        yield fresh
    finally:
        for slot, tensor in zip(slots, held, strict=True):
            setattr(slot.module, slot.name, tensor)


def _bound(
    groups: list[list[_Slot]], names: dict[int, list[str]], held: Mapping[str, torch.Tensor]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] | None:
    """For each meta tensor of the template (by id): the tensor to bind in its slots, a Parameter
    sharing the storage of this process's own where the slot is a parameter's, and that own tensor.
    None unless `held` has every tensor whole in host memory, a tied one as one tensor."""
    bound: dict[int, torch.Tensor] = {}
    targets: dict[int, torch.Tensor] = {}
    for slot in itertools.chain.from_iterable(groups):
        key = id(slot.meta)
        if key in targets:
            continue
        mine = {id(held[n]): held[n] for n in names[key] if n in held}
        if len(mine) != 1 or len(names[key]) != sum(n in held for n in names[key]):
            return None  # a name this process lacks (a pipeline stage's), or a tie it does not keep
        (target,) = mine.values()
        if target.device.type != "cpu" or target.shape != slot.meta.shape or target.dtype != slot.meta.dtype:
            return None  # a shard of the tensor, or on a device whose generator is not the CPU's
        targets[key] = target
        plain = target.detach()
        bound[key] = nn.Parameter(plain, requires_grad=slot.meta.requires_grad) if slot.is_param else plain
    return bound, targets


def replay_init(
    replay: Replay,
    place: Callable[[list[str], torch.Tensor], None],
    held: Mapping[str, torch.Tensor] | None = None,
) -> tuple[str | None, list[str]]:
    """Replay the init of `replay.template` (see the module docstring) from the CPU generator state
    `replay.start` (the current one when None), handing each full tensor with all its names to `place`;
    or, when `held` (this process's tensors by name, a DTensor's local part) has every tensor whole in
    host memory, in one pass writing into those. The CPU generator is left as it was. Returns (why the
    init cannot be replayed, or None; the names of the tensors the init left unset). When it cannot,
    nothing has been placed (in place, what ran before the call that could not be replayed has written
    into `held`: the caller fills it again)."""
    template = replay.template
    calls = _calls(template, replay.constructed)
    if calls is None:
        return f"{type(template).__name__} has its own init_weights(), one call over the whole model", []
    groups, group_of = _groups(template)
    names: dict[int, list[str]] = {}
    for name, tensor in itertools.chain(
        template.named_parameters(remove_duplicate=False), template.named_buffers(remove_duplicate=False)
    ):
        names.setdefault(id(tensor), []).append(name)
    module_names = {id(m): n for n, m in template.named_modules(remove_duplicate=False)}
    in_place = _bound(groups, names, held) if held is not None else None

    def borrowed(call: _Call) -> list[_Slot]:  # what a constructing call drew into and lost to a tie
        if not call.constructing or id(call.module) not in group_of:
            return []
        group = groups[group_of[id(call.module)]]
        return [s for s in group if s.module is call.module and s.qualified in replay.borrowed]

    before = torch.get_rng_state()
    try:
        if replay.start is not None:
            torch.set_rng_state(replay.start)
        states = []
        filled: set[int] = set()  # in place: the tensors NaN-filled so far, each when first bound
        with torch.no_grad():
            # the dry pass (or, in place, the only one): the generator's state before each call
            for call in calls:
                states.append(torch.get_rng_state())
                group = groups[group_of[id(call.module)]] if id(call.module) in group_of else []
                apart = borrowed(call)
                if in_place is not None:  # filled as late as a normal build allocates: the same peak
                    for key in {id(s.meta) for s in group} - filled:
                        fill_unset(in_place[1][key])
                        filled.add(key)
                with (
                    _allocated(group, bound=in_place[0] if in_place is not None else None),
                    _allocated(apart, {s.qualified for s in apart}),
                    _MetaWatch() as watch,
                ):
                    call.run()
                if watch.touched:
                    where = module_names.get(id(call.module)) or "the root"
                    kind = type(call.module).__name__
                    return f"the init called on {where} ({kind}) reaches other modules' tensors", []
            if replay.ends is not None:  # the next model built in the block starts here
                replay.ends[0][replay.ends[1]] = torch.get_rng_state()
            if in_place is not None:
                return None, _written(*in_place, names, filled)
            unset: list[str] = []
            for index, group in enumerate(groups):
                with _allocated(group) as fresh:
                    for call, state in zip(calls, states, strict=True):
                        if group_of.get(id(call.module)) == index:
                            torch.set_rng_state(state)
                            apart = borrowed(call)
                            with _allocated(apart, {s.qualified for s in apart}):
                                call.run()
                    for key, tensor in fresh.items():
                        if is_unset(tensor):
                            unset.extend(names[key][:1])
                        else:
                            place(names[key], tensor.detach())
                del fresh, tensor  # freed before the next group is allocated
    finally:
        torch.set_rng_state(before)
    return None, unset


def _written(
    bound: dict[int, torch.Tensor],
    targets: dict[int, torch.Tensor],
    names: dict[int, list[str]],
    filled: set[int],
) -> list[str]:
    """After the pass in place: the names of the tensors it left unset (no call bound them, or NaN is
    left). An init that gave a parameter new storage (`weight.data = ...`) wrote there, not into this
    process's tensor: copied over."""
    unset: list[str] = []
    for key, target in targets.items():
        if key in filled and bound[key].data_ptr() != target.data_ptr():
            target.copy_(bound[key])
        if key not in filled or is_unset(target):
            unset.extend(names[key][:1])
    return unset


def fill_unset(tensor: torch.Tensor) -> None:
    """NaN (or the integer minimum) in every element: a tensor no init reaches is then found."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def is_unset(tensor: torch.Tensor) -> bool:
    """Whether `tensor` still holds what fill_unset wrote (a NaN, or all integer minimum)."""
    if tensor.numel() == 0:
        return False
    if tensor.is_floating_point():  # amax propagates NaN: one reduction, no mask of the tensor's size
        return bool(torch.isnan(tensor.amax()))
    if tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    if tensor.dtype == torch.bool:
        return False
    return bool((tensor == torch.iinfo(tensor.dtype).min).all())
