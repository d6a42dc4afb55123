"""A process group of one process, formed only for the layout that needs one on a single process.

`PartialState` forms no group at world size 1: plain training needs none. ZeRO-2/3 with offload=true
on one process (one GPU, a model bigger than it) still runs FSDP2, which shards over a DeviceMesh, and a
mesh needs a process group. This one is formed in memory (a HashStore: no rendezvous, no port, no
launcher) with the process state's backend and device, and is torn down at exit like the group of a
launched run.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

from ..state import PartialState, destroy_process_group_at_exit, import_group_defaults_before_the_group


def form_one_process_group() -> None:
    """Form the default process group of this single process (rank 0 of 1), unless one exists."""
    state = PartialState()  # in a launched run, this forms the run's own group
    if dist.is_initialized():
        return
    backend, kwargs = state.backend, {}
    if backend == "nccl":
        # gloo beside NCCL for the CPU tensors of offloaded shards (the gradient norm of clipping is a
        # collective over them), as torchtitan forms its group under CPU offload
        backend, kwargs = "cuda:nccl,cpu:gloo", {"device_id": state.device}
    import_group_defaults_before_the_group()  # see state.py: else the group outlives destroy at exit
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    atexit.register(destroy_process_group_at_exit)
