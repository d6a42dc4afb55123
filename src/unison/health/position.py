"""Where a process is: in which collective (operation, group, sequence number, shapes), at which line of
the user's code. The hang watchdog (`watchdog.py`) and the failure hook (`failure.py`) describe every
rank with it, so a hang is reported as "rank 0 waits in all_reduce #17 of float32[4] at train.py:42;
rank 1 is at data.py:12 in __getitem__" instead of torch's "Timed out waiting 600000ms".

It reads Python frames only (the main thread's, sampled with `sys._current_frames`, or a traceback's),
so it costs nothing until asked: no collective is wrapped. A collective is recognised by the public
function of torch.distributed it was called through (its frame's arguments give the tensors and the
group); a wait elsewhere inside torch.distributed (FSDP's prefetch, pipeline schedules) is reported as
"in torch.distributed" with the innermost function.

DDP's gradient all-reduce is issued from C++ inside backward, under no Python frame of torch.distributed:
the main thread shows only the autograd engine. After each forward of a DDP model, `note_gradient_sync`
records whether its backward will all-reduce and the group's sequence number then; a main thread in the
autograd engine whose group has issued collectives since is in DDP's all-reduce (op DDP_ALL_REDUCE),
waiting for its last buckets, or computing the gradients between two of them. Before that (a backward
under no_sync, or one that has not filled a bucket yet) it is computing, "running". Without it, a rank
whose peer vanished mid-backward looked as if it ran, and only the process group's timeout (the stall
timeout + 60 s) ended it, reported as "never arrived" (seen when a node's link went down, issue 28).
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import threading
import weakref
from dataclasses import asdict, dataclass, field
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DISTRIBUTED_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep
_C10D_FILE = os.path.join(_DISTRIBUTED_DIR, "distributed_c10d.py")
_AUTOGRAD_ENGINE = (os.path.join(_TORCH_DIR, "autograd", "graph.py"), "_engine_run_backward")
"""The frame through which every backward (loss.backward(), torch.autograd.backward/grad) runs the engine:
a private function's name, pinned by tests/test_torch_private_apis.py."""

DDP_ALL_REDUCE = "DDP's gradient all-reduce"
"""Position.op of a rank in a backward that DDP reduces (see the module docstring)."""

_armed_sync: tuple[weakref.ref, int] | None = None
"""(DDP's process group, its sequence number) after the last forward whose backward all-reduces. The
group is held weakly: a reference here kept a destroyed group's gloo threads alive to the interpreter's
end, where they can abort it (docs/failures.md; tests/test_state.py)."""
# the whole package (this module is in its health/ wing): frames there are unison's, not the user's
_UNISON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["platstdlib"] + os.sep})

_TENSOR_ARGUMENTS = (
    "tensor",
    "tensor_list",
    "output_tensor",
    "input_tensor",
    "output_tensor_list",
    "input_tensor_list",
    "output",
    "input",
    "scatter_list",
    "gather_list",
    "object_list",
)
"""Argument names of torch.distributed's collectives whose values describe what is being exchanged."""


SAME_SHAPES_ON_EVERY_RANK = frozenset(
    {
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_reduce_coalesced",
        "all_gather_coalesced",
    }
)
"""Collectives whose tensors must have the same shapes on every rank. The others (scatter and gather,
whose lists exist on one rank only; all_to_all with uneven splits; the object collectives) may differ."""


@dataclass(frozen=True)
class Position:
    """One rank's whereabouts; JSON-friendly (the watchdog passes it between ranks through the store).

    kind: "collective" (inside a torch.distributed collective, `op` names it), "distributed" (waiting
    somewhere else inside torch.distributed) or "running" (anywhere else: computing, loading data).
    """

    kind: str
    call_site: str  # innermost frame of the user's code: "train.py:42 in main"
    innermost: str  # the library frame that call site is in ("dataloader.py:725 in __next__")
    op: str = ""
    shapes: tuple[str, ...] = ()
    group_ranks: tuple[int, ...] = ()  # empty: every process (the default group)
    seq: int | None = None  # the group's sequence number after this collective was issued
    via: str = ""  # unison's function the call went through, e.g. "wait_for_everyone('eval')"
    frames: tuple[str, ...] = field(default=(), compare=False)  # every frame, for "did it move?"

    @property
    def waiting(self) -> bool:
        return self.kind in ("collective", "distributed")

    def same_call(self, other: Position) -> bool:
        """Whether two ranks can be in the very same collective call (what a healthy group does): the
        same operation, group and sequence number, and the same shapes where the operation needs them
        equal on every rank (scatter, gather, all-to-all and the object collectives legitimately differ)."""
        if (self.op, self.group_ranks, self.seq) != (other.op, other.group_ranks, other.seq):
            return False
        return self.op not in SAME_SHAPES_ON_EVERY_RANK or self.shapes == other.shapes

    def describe(self) -> str:
        if self.kind == "collective":
            seq = f" #{self.seq}" if self.seq is not None else ""
            group = f" over ranks {list(self.group_ranks)}" if self.group_ranks else ""
            via = f" (through {self.via})" if self.via else ""
            shapes = f" of {', '.join(self.shapes)}" if self.shapes else ""
            return f"in {self.op}{seq}{shapes}{group}{via}, called at {self.call_site}"
        if self.kind == "distributed":
            return f"waiting inside torch.distributed ({self.innermost}), called at {self.call_site}"
        return f"at {self.call_site}" + (
            f", inside {self.innermost}" if self.innermost != self.call_site else ""
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Position:
        return cls(
            **{
                **data,
                "shapes": tuple(data.get("shapes", ())),
                "group_ranks": tuple(data.get("group_ranks", ())),
                "frames": tuple(data.get("frames", ())),
            }
        )


def note_gradient_sync(group: Any, armed: bool) -> None:
    """After a forward of a DDP model over `group`: `armed` says its backward all-reduces the gradients
    (DDP's require_forward_param_sync: outside no_sync, with gradients enabled)."""
    global _armed_sync
    _armed_sync = (weakref.ref(group), sequence_number(group) or 0) if armed else None


def main_thread_position() -> Position | None:
    """Where the main thread is now (None if it has no Python frame, e.g. during shutdown).

    Garbage collection is off during sys._current_frames: on Python 3.11 the call holds the interpreter's
    thread-list lock, and a collection inside it (a finalizer) can release the GIL; a fork by the main
    thread then (a DataLoader starting its workers) gives the child that lock held, and it deadlocks
    after the fork (seen in 1 of 21 soak runs with num_workers=2; CPython gh-106883).
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        frames = sys._current_frames()
    finally:
        if collecting:
            gc.enable()
    frame = frames.get(threading.main_thread().ident)
    if frame is None:
        return None
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return locate(frames[::-1])


def traceback_position(tb: TracebackType | None) -> Position | None:
    """Where an exception was raised, from its traceback (outermost frame first)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return locate(frames) if frames else None


def locate(frames: list[FrameType]) -> Position:
    """Describe a stack, given outermost first."""
    user = [i for i, f in enumerate(frames) if _is_user_code(f.f_code.co_filename)]
    call_site = _show(frames[user[-1]]) if user else _show(frames[-1])
    # what the user's line called (e.g. "dataloader.py:725 in __next__"), more telling than the
    # innermost frame of all (a selector's poll, a lock)
    innermost = _show(frames[user[-1] + 1]) if user and user[-1] + 1 < len(frames) else _show(frames[-1])
    lines = tuple(_show(f) for f in frames)
    via = next((_unison_call(f) for f in frames if f.f_code.co_filename.startswith(_UNISON_DIR)), "")
    collective = next((f for f in frames if _is_c10d_api(f)), None)
    if collective is not None:
        arguments = collective.f_locals
        group = arguments.get("group")
        return Position(
            kind="collective",
            call_site=call_site,
            innermost=innermost,
            op=collective.f_code.co_name,
            shapes=tuple(s for name in _TENSOR_ARGUMENTS if (s := _shape_of(name, arguments.get(name)))),
            group_ranks=_group_ranks(group),
            seq=sequence_number(group),
            via=via,
            frames=lines,
        )
    sync = _armed_sync
    if sync is not None and any(_is_autograd_engine(f) for f in frames):
        group, armed_at = sync[0](), sync[1]
        seq = None if group is None else sequence_number(group)
        if seq is not None and seq > armed_at:  # this backward has issued DDP's all-reduce
            return Position(
                kind="collective",
                call_site=call_site,
                innermost=innermost,
                op=DDP_ALL_REDUCE,
                group_ranks=_group_ranks(group),
                seq=seq,
                via=via,
                frames=lines,
            )
    in_distributed = [f for f in frames if f.f_code.co_filename.startswith(_DISTRIBUTED_DIR)]
    if in_distributed:
        return Position("distributed", call_site, _show(in_distributed[-1]), via=via, frames=lines)
    return Position("running", call_site, innermost, via=via, frames=lines)


def sequence_number(group: Any = None) -> int | None:
    """How many collectives `group` (None: the default group) has issued on this rank.

    Private torch API (ProcessGroup._get_sequence_number_for_group), pinned by
    tests/test_torch_private_apis.py: ranks that issued different numbers of collectives on one group
    have diverged, whatever the collectives were. None where torch does not offer it.
    """
    try:
        pg = group if group is not None else dist.group.WORLD
        return int(pg._get_sequence_number_for_group())
    except Exception:  # not initialised, a group this rank is not in, a torch without it
        return None


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return ()
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:
        return ()


def _is_c10d_api(frame: FrameType) -> bool:
    return frame.f_code.co_filename == _C10D_FILE and not frame.f_code.co_name.startswith("_")


def _is_autograd_engine(frame: FrameType) -> bool:
    return (frame.f_code.co_filename, frame.f_code.co_name) == _AUTOGRAD_ENGINE


def _is_user_code(filename: str) -> bool:
    if filename.startswith("<frozen") or filename.startswith(_TORCH_DIR) or filename.startswith(_UNISON_DIR):
        return False
    return not filename.startswith(_STDLIB_DIRS) or "site-packages" in filename


def _show(frame: FrameType) -> str:
    """ "train.py:42 in main": the user's files relative to the working directory, others by base name."""
    filename = frame.f_code.co_filename
    shown = os.path.relpath(filename) if _is_user_code(filename) else os.path.basename(filename)
    return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"


def _unison_call(frame: FrameType) -> str:
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    label = frame.f_locals.get("name")
    return f"{name}({label!r})" if isinstance(label, str) and label else name


def _shape_of(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{name}={_tensor(value)}"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return f"{name}={len(value)}x{_tensor(value[0])}"
    if isinstance(value, (list, tuple)) and name == "object_list":
        return f"{name}={len(value)} objects"
    return ""


def _tensor(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
