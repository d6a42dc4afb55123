"""Bytes each collective moves, counted where torch dispatches it (tests and benchmarks only).

A TorchDispatchMode sees every c10d op that Python-level code issues (FSDP2's all-gathers and
reduce-scatters, DTensor redistributions, torch.distributed calls): the same interception as torch's
public CommDebugMode, which counts calls but not their sizes. `TorchDispatchMode` lives in the private
torch.utils._python_dispatch (pinned by tests/test_torch_private_apis.py). Collectives issued from
C++ (DDP's reducer) are not seen.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# c10d op -> which argument is the payload this rank sends: all-gathers send their input (argument 1),
# reduce-scatters their input too; all-reduce and broadcast their one tensor list (argument 0).
_PAYLOAD_ARGUMENT = {
    "_allgather_base_": 1,
    "allgather_": 1,
    "allgather_into_tensor_coalesced_": 1,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "broadcast_": 0,
    "alltoall_base_": 1,  # all_to_all_single: (output, input, ...)
}


class CollectiveBytes(TorchDispatchMode):
    """Within `with CollectiveBytes() as counted:`, `counted.sent` maps a kind ("all_gather",
    "reduce_scatter", "all_reduce", "broadcast", "all_to_all") to the bytes this rank put into it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if func.namespace == "c10d" and name in _PAYLOAD_ARGUMENT:
            payload = [t for t in tree_leaves(args[_PAYLOAD_ARGUMENT[name]]) if isinstance(t, torch.Tensor)]
            self.sent[_kind(name)] += sum(t.numel() * t.element_size() for t in payload)
        return func(*args, **(kwargs or {}))


def _kind(op: str) -> str:
    for kind in ("allgather", "reduce_scatter", "allreduce", "broadcast", "alltoall"):
        if kind in op:
            return {"allgather": "all_gather", "allreduce": "all_reduce", "alltoall": "all_to_all"}.get(
                kind, kind
            )
    raise AssertionError(op)
