"""Collectives over nested structures: gather, reduce, broadcast and pad every tensor in a batch at once.

Training code passes around lists, tuples, dicts (any Mapping), namedtuples and dataclasses of
tensors; these functions walk such structures, apply one collective per tensor leaf, and rebuild the
structure with its own type. With one process they are identities (or their trivial equivalent), so a
script behaves the same under `python` and under `unison launch`.

Safety: a collective fed tensors of different shapes on different processes hangs or returns garbage.
What each process knows alone is checked on every call for free (every leaf is a tensor). The
cross-process check runs in debug mode only (`unison launch --debug`, UNISON_DEBUG=1, or
`PartialState().debug = True` at run time, as in Accelerate): `gather`,
`reduce`, `broadcast` and `pad_across_processes` then first run ONE tiny collective per call: every
process hashes the description (path, dtype, shape) of all its leaves and one all_reduce(MAX) of
(hash, -hash) tells everyone whether all hashes are equal. When they differ, every process gathers the
full descriptions and raises the same DistributedOperationException naming each rank's shapes, and the
process group stays usable. By default a mismatch is left to the hang watchdog, which reports ranks
blocked in one collective with different shapes within seconds (`watchdog.py`): the check costs an
extra collective and, on CUDA, a `.tolist()` that synchronises the stream every call (see
benchmarks/debug_mode.py for both modes' cost).

Devices: NCCL can only communicate tensors on the process's own GPU, so under NCCL a tensor on
another device (e.g. the CPU) is copied to `PartialState().device` for the collective. Results come
back on the device of the input tensor, so these functions never move your data behind your back
(under NCCL a CPU input therefore costs a host-device round trip; keep tensors on the GPU to avoid
it). Results are detached (collectives are not autograd operations). Inputs are never modified,
except by `broadcast`, which (like torch.distributed.broadcast) writes into the given tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .health.mismatch import DistributedOperationException as DistributedOperationException  # public here
from .state import PartialState

REDUCTIONS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # summed, then divided by the number of processes
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def is_tensor(data: Any) -> bool:
    return isinstance(data, torch.Tensor)


# -- walking nested structures ---------------------------------------------------------------------
def _children(data: Any) -> list[tuple[Any, Any]] | None:
    """(key, child) pairs of a container, in a fixed order; None for a leaf."""
    if isinstance(data, Mapping):
        return list(data.items())
    if isinstance(data, (list, tuple)):
        return list(enumerate(data))
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return [(f.name, getattr(data, f.name)) for f in dataclasses.fields(data)]
    return None


def _rebuild(data: Any, values: list[Any]) -> Any:
    """A container of data's own type holding `values` in place of its children (same order)."""
    if isinstance(data, Mapping):
        items = dict(zip(data.keys(), values))
        if isinstance(data, MutableMapping):  # a copy keeps subclass state (defaultdict's factory, ...)
            rebuilt = copy.copy(data)
            for key, value in items.items():  # item by item: transformers' ModelOutput refuses update()
                rebuilt[key] = value
            return rebuilt
        return type(data)(items)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*values)
    if isinstance(data, (list, tuple)):
        return type(data)(values)
    fields = dataclasses.fields(data)
    new = dict(zip((f.name for f in fields), values))
    rebuilt = dataclasses.replace(data, **{f.name: new[f.name] for f in fields if f.init})
    for f in fields:
        if not f.init:  # not accepted by the constructor: set afterwards (works for frozen ones too)
            object.__setattr__(rebuilt, f.name, new[f.name])
    return rebuilt


def _path(parent: str, key: Any) -> str:
    """A readable leaf address for error messages: "out.logits", "batch.0", "0"."""
    name = key if isinstance(key, str) else repr(key)
    return f"{parent}.{name}" if parent else name


def _leaves(data: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every non-container value, in the order recursively_apply visits them."""
    children = _children(data)
    if children is None:
        yield path, data
        return
    for key, child in children:
        yield from _leaves(child, _path(path, key))


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply `func(leaf, *args, **kwargs)` to every leaf of `data` that passes `test_type`.

    Containers (lists, tuples, Mappings, namedtuples, dataclasses) are walked first and rebuilt with
    their own type; other leaves are returned unchanged, or raise TypeError with error_on_other_type.
    """
    children = _children(data)
    if children is not None:
        return _rebuild(
            data,
            [
                recursively_apply(
                    func, child, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
                )
                for _, child in children
            ],
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(
            f"{getattr(func, '__name__', func)} got a {type(data).__name__}: only nested lists, tuples, "
            "dicts, namedtuples and dataclasses of objects passing "
            f"{getattr(test_type, '__name__', test_type)} are supported."
        )
    return data


# -- local helpers ---------------------------------------------------------------------------------
def send_to_device(
    data: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | Sequence[str] | None = None,
) -> Any:
    """Move every tensor (and every object with a `.to` method) in `data` to `device`.

    Objects with `.to` are moved whole (a BatchEncoding moves itself); values under a Mapping key in
    `skip_keys` are left where they are; other leaves pass through unchanged.
    """
    skip = frozenset((skip_keys,) if isinstance(skip_keys, str) else skip_keys or ())
    return _move(data, device, non_blocking, skip)


def _move(obj: Any, device: Any, non_blocking: bool, skip: frozenset) -> Any:
    # Tensors and plain tuples, lists and dicts first, without the generic walk: this runs on every
    # batch a prepared DataLoader yields, and its cost shows in the loader's throughput.
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    kind = type(obj)
    if kind is tuple or kind is list:
        return kind([_move(child, device, non_blocking, skip) for child in obj])
    if kind is dict:
        return {k: v if k in skip else _move(v, device, non_blocking, skip) for k, v in obj.items()}
    if hasattr(obj, "to"):
        try:
            return obj.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to() that does not take non_blocking
            return obj.to(device)
    children = _children(obj)
    if children is None:
        return obj
    keep = isinstance(obj, Mapping)
    moved = [
        child if keep and key in skip else _move(child, device, non_blocking, skip) for key, child in children
    ]
    return _rebuild(obj, moved)


def find_batch_size(data: Any) -> int:
    """Size of dim 0 of the first tensor leaf that has a dimension (the batch size of a batch)."""
    for _, leaf in _leaves(data):
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            return leaf.shape[0]
    raise ValueError(
        f"find_batch_size found no tensor with a batch dimension in this {type(data).__name__}: "
        "the batch must contain at least one tensor of one or more dimensions."
    )


def slice_tensors(data: Any, tensor_slice: slice | int | Sequence[Any]) -> Any:
    """`tensor[tensor_slice]` for every tensor leaf; other leaves pass through unchanged."""
    return recursively_apply(lambda tensor: tensor[tensor_slice], data)


def concatenate(data: Sequence[Any], dim: int = 0) -> Any:
    """One structure like `data[0]` whose tensor leaves are the leaves of every item concatenated on `dim`.

    Other leaves must be equal in every item and are kept (else TypeError).
    """
    if len(data) == 0:
        raise ValueError("concatenate got an empty list: pass at least one structure to concatenate.")
    first = data[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    children = _children(first)
    if children is None:  # not a tensor: kept when every item holds the same value (e.g. a name)
        if all(item is first or (type(item) is type(first) and (item == first) is True) for item in data):
            return first
        raise TypeError(
            f"concatenate can only join tensors, but got {type(first).__name__} values that differ between "
            f"items: {list(data)!r:.200}. Convert them to tensors, or collect them separately."
        )
    keys = [key for key, _ in children]
    columns = []
    for item in data:
        item_children = _children(item)
        if item_children is None or [key for key, _ in item_children] != keys:
            raise ValueError(
                f"concatenate needs every item to have the same structure as the first (keys {keys}), "
                f"but got a {type(item).__name__} with {[k for k, _ in item_children or []]}."
            )
        columns.append([child for _, child in item_children])
    return _rebuild(first, [concatenate(list(column), dim=dim) for column in zip(*columns)])


# -- agreement check -------------------------------------------------------------------------------
class _Leaf(NamedTuple):
    """What the processes must agree on about one leaf before a collective."""

    path: str
    kind: str  # the dtype of a tensor, the type name of anything else
    shape: tuple[int, ...] | None  # None: not a tensor


def _describe(data: Any) -> list[_Leaf]:
    return [
        _Leaf(path, str(leaf.dtype), tuple(leaf.shape))
        if isinstance(leaf, torch.Tensor)
        else _Leaf(path, type(leaf).__name__, None)
        for path, leaf in _leaves(data)
    ]


def _comm(tensor: torch.Tensor, state: PartialState) -> torch.Tensor:
    """The tensor on a device the process group can communicate (NCCL: this process's GPU)."""
    if state.backend == "nccl" and tensor.device != state.device:
        return tensor.to(state.device)
    return tensor


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_gather_into_tensor_works = True


def _all_gather_into(output: torch.Tensor, tensor: torch.Tensor, num_processes: int) -> None:
    """Gather into one buffer (no list of copies), falling back to all_gather where gloo lacks it."""
    global _gather_into_tensor_works
    if _gather_into_tensor_works:
        try:
            _all_gather_single(output, tensor)
            return
        except (RuntimeError, NotImplementedError) as error:
            if not backend_lacks_gather_into_tensor(error):
                raise
            _gather_into_tensor_works = False
    dist.all_gather(list(output.view(num_processes, *tensor.shape).unbind(0)), tensor)


def backend_lacks_gather_into_tensor(error: BaseException) -> bool:
    """Whether `error` says the backend has no gather-into-one-tensor (older gloo), so every rank meets
    the same error at the same call and all switch to all_gather together.

    Anything else (a CUDA out-of-memory error, a peer that went away) happens on some ranks only:
    switching collectives there would leave the peers in a different one, a hang or garbage, so it
    propagates instead.
    """
    if isinstance(error, (dist.DistError, torch.cuda.OutOfMemoryError)):
        return False
    return isinstance(error, NotImplementedError) or "no support for _allgather_base" in str(error)


def _digest(description: list[Any]) -> int:
    """A 62-bit hash (so that it and its negation fit in an int64), the same in every process."""
    return int.from_bytes(hashlib.blake2b(repr(description).encode(), digest_size=8).digest(), "little") >> 2


def _check_agreement(
    op: str, data: Any, state: PartialState, compare: Callable[[_Leaf], Any] | None = None
) -> list[_Leaf]:
    """In debug mode, raise the same ValueError on every process unless the leaves' descriptions (path,
    dtype, shape), or what `compare` keeps of them, agree on every process; in any mode, refuse leaves
    that are not tensors.

    The hash also covers `op`, so processes calling different collectives are caught too.
    One all_reduce(MAX) of (hash, -hash) when all is well: the hashes agree iff max == min. On
    disagreement one more all_gather_object of the descriptions, so the message can name each rank's
    shapes. Returns this process's description.
    """
    description = _describe(data)
    if state.num_processes > 1 and state.debug:
        agreed = description if compare is None else [compare(leaf) for leaf in description]
        digest = _digest([op, agreed])
        extremes = _comm(torch.tensor([digest, -digest], dtype=torch.int64), state)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        highest, minus_lowest = extremes.tolist()
        if highest != -minus_lowest:
            calls: list[Any] = [None] * state.num_processes
            dist.all_gather_object(calls, (op, description))
            raise DistributedOperationException(_mismatch_message(calls))
    for path, kind, shape in description:
        if shape is None:
            raise TypeError(
                f"{op} got a {kind} at {path or 'the top level'}: it works on tensors (in nested lists, "
                f"tuples, dicts, namedtuples, dataclasses) only. Convert it with torch.tensor(...), or use "
                f"{'broadcast_object_list' if op == 'broadcast' else 'gather_object'} for Python objects."
            )
    return description


def _per_rank(descriptions: list[list[_Leaf]], indices: list[int], show_shape: bool) -> str:
    """Each rank's leaves at `indices`: "rank 0: (4, 3), ..." alone, "rank 0: {x: (4, 3)}, ..." nested."""

    def show(leaf: _Leaf) -> str:
        return str(leaf.shape) if show_shape and leaf.shape is not None else leaf.kind

    def one_rank(leaves: list[_Leaf]) -> str:
        if len(leaves) == 1 and leaves[0].path == "":
            return show(leaves[0])
        return "{" + ", ".join(f"{leaf.path}: {show(leaf)}" for leaf in leaves) + "}"

    return ", ".join(f"rank {r}: {one_rank([d[i] for i in indices])}" for r, d in enumerate(descriptions))


def _mismatch_message(calls: list[tuple[str, list[_Leaf]]]) -> str:
    """The error every process raises: what differs (operation, structure, shapes, dtypes), per rank."""
    ops = [op for op, _ in calls]
    if len(set(ops)) > 1:
        listing = ", ".join(f"rank {r}: {op}" for r, op in enumerate(ops))
        return (
            f"processes called different collectives at the same time: {listing}. Every process must call "
            "the same collectives in the same order (check for collectives inside rank-dependent branches)."
        )
    op, descriptions = ops[0], [description for _, description in calls]
    paths = [[leaf.path for leaf in d] for d in descriptions]
    if any(p != paths[0] for p in paths):
        shown = [", ".join(path or "<top level>" for path in p) for p in paths]
        listing = ", ".join(f"rank {r}: [{leaves}]" for r, leaves in enumerate(shown))
        return (
            f"{op} got different nested structures across processes: {listing}. Every process must pass the "
            "same structure (same keys in the same order, same number of tensors)."
        )
    indices = range(len(paths[0]))
    shapes_differ = [i for i in indices if len({d[i].shape for d in descriptions}) > 1]
    if shapes_differ:
        fix = _shape_fix(op, [[d[i] for i in shapes_differ] for d in descriptions])
        listing = _per_rank(descriptions, shapes_differ, show_shape=True)
        return f"{op} got tensors of different shapes across processes: {listing}; {fix}"
    dtypes_differ = [i for i in indices if len({d[i].kind for d in descriptions}) > 1]
    listing = _per_rank(descriptions, dtypes_differ, show_shape=False)
    return f"{op} got tensors of different dtypes across processes: {listing}; cast them to one dtype first."


def _shape_fix(op: str, differing: list[list[_Leaf]]) -> str:
    """How to fix it: for gather, name the one dimension to pad when only one dimension differs."""
    if op == "pad_across_processes":
        return (
            "it can pad one dimension but needs tensors with the same number of dimensions on every process."
        )
    if op == "gather":
        dims: set[int] = set()
        for leaf_on_each_rank in zip(*differing):
            shapes = [leaf.shape for leaf in leaf_on_each_rank]
            if any(shape is None or len(shape) != len(shapes[0]) for shape in shapes):
                dims = set()
                break
            dims |= {i for i in range(len(shapes[0])) if len({shape[i] for shape in shapes}) > 1}
        if len(dims) == 1:
            return f"pad them first with pad_across_processes(x, dim={dims.pop()})."
    return f"{op} needs tensors of the same shape on every process."


def _check_from_process(from_process: int, state: PartialState) -> None:
    if not 0 <= from_process < state.num_processes:
        raise ValueError(
            f"from_process={from_process} is out of range: there are {state.num_processes} processes, "
            f"numbered 0 to {state.num_processes - 1}."
        )


# -- collectives -----------------------------------------------------------------------------------
def gather(data: Any) -> Any:
    """Every process's tensors, concatenated on dim 0 in process order, for each tensor leaf.

    A 0-d tensor becomes shape (num_processes,) (also with one process, so shapes never depend on
    how the script was launched). Shapes and dtypes must match across processes (ValueError on every
    process otherwise: pad first with pad_across_processes).
    """
    state = PartialState()
    _check_agreement("gather", data, state)

    def gather_one(tensor: torch.Tensor) -> torch.Tensor:
        work = tensor.detach()[None] if tensor.ndim == 0 else tensor.detach()
        if state.num_processes == 1:
            return work
        work = _comm(work, state).contiguous()
        output = work.new_empty((state.num_processes * work.shape[0], *work.shape[1:]))
        _all_gather_into(output, work, state.num_processes)
        return output.to(tensor.device)

    return recursively_apply(gather_one, data)


def gather_object(obj: Any) -> list[Any]:
    """Every process's picklable `obj`, in process order: the items of every list flattened into one
    list, or a list of one object per process for anything that is not a list."""
    state = PartialState()
    if state.num_processes == 1:
        everyone = [obj]
    else:
        everyone = [None] * state.num_processes
        dist.all_gather_object(everyone, obj)
    if isinstance(obj, list):
        return [item for items in everyone for item in items]
    return everyone


def reduce(data: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Each tensor leaf reduced element-wise across processes: "sum", "mean", "max" or "min".

    Every process's values are multiplied by `scale` first. "mean" of integer or bool tensors is a
    floating-point tensor (torch's true division); bool tensors are summed as integers (sum counts the
    True values, mean gives their fraction), and max / min of bools are any / all. Shapes and dtypes
    must match across processes (ValueError on every process otherwise).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction={reduction!r} is unknown: choose one of {', '.join(map(repr, REDUCTIONS))}."
        )
    state = PartialState()
    _check_agreement("reduce", data, state)

    def reduce_one(tensor: torch.Tensor) -> torch.Tensor:
        dtype = torch.int64 if tensor.dtype == torch.bool else tensor.dtype
        device = state.device if state.backend == "nccl" else tensor.device
        work = tensor.detach().to(
            device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format
        )
        if scale != 1.0:
            work = work * scale
        if state.num_processes > 1:
            dist.all_reduce(work, op=REDUCTIONS[reduction])
        if reduction == "mean":
            work = work / state.num_processes
        elif tensor.dtype == torch.bool and reduction in ("max", "min"):
            work = work.bool()
        return work.to(tensor.device)

    return recursively_apply(reduce_one, data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Overwrite every tensor leaf with the values of process `from_process`, and return `data`.

    The receiving processes must pass tensors of the same shapes and dtypes (e.g. torch.empty_like),
    else ValueError on every process.
    """
    state = PartialState()
    _check_from_process(from_process, state)
    _check_agreement("broadcast", data, state)
    if state.num_processes == 1:
        return data

    def broadcast_one(tensor: torch.Tensor) -> torch.Tensor:
        work = _comm(tensor.detach(), state).contiguous()
        dist.broadcast(work, src=from_process)
        if work.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(work)
        return tensor

    return recursively_apply(broadcast_one, data)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of `object_list` (in place) with those of process `from_process`; returns it."""
    state = PartialState()
    _check_from_process(from_process, state)
    if state.num_processes > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor leaf along `dim` to its largest size over all processes, so it can be gathered.

    The new entries hold `pad_index`, at the end (or at the start with pad_first). Tensors with too
    few dimensions to have `dim` are left as they are. One all_reduce(MAX) of the sizes, after the
    agreement check on the structure and the number of dimensions.
    """
    state = PartialState()
    description = _check_agreement("pad_across_processes", data, state, compare=_path_and_ndim)
    if state.num_processes == 1:
        return data
    sizes = torch.tensor(
        [leaf.shape[dim] if -len(leaf.shape) <= dim < len(leaf.shape) else 0 for leaf in description],
        dtype=torch.int64,
    )
    sizes = _comm(sizes, state)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    targets = iter(sizes.tolist())
    return recursively_apply(lambda tensor: _pad_to(tensor, dim, next(targets), pad_index, pad_first), data)


def _path_and_ndim(leaf: _Leaf) -> tuple[str, int | None]:
    """What must agree for padding: sizes may differ, the structure and number of dimensions may not."""
    return leaf.path, None if leaf.shape is None else len(leaf.shape)


def _pad_to(tensor: torch.Tensor, dim: int, size: int, pad_index: int, pad_first: bool) -> torch.Tensor:
    """`tensor` grown along `dim` to `size` with `pad_index` values (unchanged if it has no such dim)."""
    if not -tensor.ndim <= dim < tensor.ndim or tensor.shape[dim] >= size:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size - tensor.shape[dim]
    padding = tensor.new_full(shape, pad_index)
    return torch.cat([padding, tensor] if pad_first else [tensor, padding], dim=dim)
