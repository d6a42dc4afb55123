"""One torch `DeviceMesh` for the whole run, with named dimensions in torchtitan's order.

Every strategy (FSDP2, DTensor tensor parallel, pipelining, DCP) takes its process groups from this one
mesh: FSDP2 refuses parameters that live on a different mesh object than the one it shards over (see
the engine notes), so the mesh is built once and its sub-meshes are handed out by name.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelismConfig
from .one_process_group import form_one_process_group

MESH_DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Outermost first: pipeline stages talk least (across nodes), tensor parallel most (inside a node)."""

DATA_PARALLEL_DIM = "dp"
"""The flattened dp_replicate x dp_shard dimension: ranks that read different batches."""

DATA_CP_DIM = "dp_cp"
"""The flattened dp_replicate x (dp_shard) x cp dimension: every process whose gradients are averaged
together (without dp_replicate, that is SHARD_CP_DIM)."""

SHARD_CP_DIM = "dp_shard_cp"
"""The flattened dp_shard x cp dimension FSDP2 shards over (torchtitan's name): context-parallel ranks
hold different parts of the same sequences, so their gradients are averaged like data-parallel ones."""


def mesh_layout(config: ParallelismConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(dim names, shape) of the mesh for a validated config: only dimensions of size > 1, in order, and
    dp_shard of size 1 under offload (ZeRO-2/3 offloading on one process runs FSDP2 over it)."""
    sizes = {
        "pp": config.pp_size,
        "dp_replicate": config.dp_replicate_size,
        "dp_shard": config.dp_shard_size,
        "cp": config.cp_size,
        "tp": config.tp_size,
    }
    kept = [
        (name, sizes[name] or 1)
        for name in MESH_DIM_ORDER
        if (sizes[name] or 1) > 1 or (name == "dp_shard" and config.offload)
    ]
    return tuple(name for name, _ in kept), tuple(size for _, size in kept)


def build_device_mesh(config: ParallelismConfig, device_type: str) -> DeviceMesh | None:
    """The run's DeviceMesh (None when every degree is 1, except ZeRO-2/3 offloading on one process,
    for which it forms a process group of that one process). Call on every rank: it creates groups.

    `config` is validated against the world size here too (a pure check, the same on every rank).
    When both data-parallel dimensions are used, their flattened view "dp" is created as well; fetch it
    with `data_parallel_mesh`.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    names, shape = mesh_layout(config.validate(world_size))
    if not names:
        return None
    if not dist.is_initialized():  # one process offloading ZeRO-2/3 to the host: FSDP2 needs a group
        form_one_process_group()
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    if "dp_replicate" in names and "dp_shard" in names:
        # private, the one way to name a flattened dimension (tests/test_torch_private_apis.py)
        mesh["dp_replicate", "dp_shard"]._flatten(DATA_PARALLEL_DIM)
    if "dp_shard" in names and "cp" in names:
        mesh["dp_shard", "cp"]._flatten(SHARD_CP_DIM)  # private, as above
    if "dp_replicate" in names and "cp" in names:
        dims = _data_and_cp_dims(names)
        mesh[dims]._flatten(DATA_CP_DIM)  # private, as above
    return mesh


def _data_and_cp_dims(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for name in ("dp_replicate", "dp_shard", "cp") if name in names)


def loss_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D mesh of every process whose gradients are averaged together: the data-parallel ranks and,
    with context parallelism, their cp peers (each holds its own part of the sequences); None when there
    is no such dimension. What a loss normalised by a token count sums its counts over."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "cp" not in names:
        return data_parallel_mesh(mesh)
    dims = _data_and_cp_dims(names)
    if len(dims) == 1:
        return mesh["cp"]
    return mesh[dims]._flatten(DATA_CP_DIM if "dp_replicate" in dims else SHARD_CP_DIM)


def gradient_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp_shard (with cp folded in: dp_shard_cp, or cp alone), or
    dp_replicate alone; (dp_replicate, that) for HSDP. `mesh` has a data-parallel or cp dimension."""
    names = mesh.mesh_dim_names or ()
    shard = [name for name in ("dp_shard", "cp") if name in names]
    if "dp_replicate" not in names:
        return mesh[shard[0]] if len(shard) == 1 else mesh["dp_shard", "cp"]._flatten(SHARD_CP_DIM)
    if not shard:
        return mesh["dp_replicate"]
    if len(shard) == 1:
        return mesh["dp_replicate", shard[0]]
    with warnings.catch_warnings():  # torch warns that slicing a flattened dim will change; no other way
        warnings.simplefilter("ignore", UserWarning)
        return mesh["dp_replicate", SHARD_CP_DIM]


def data_parallel_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The (sub-)mesh over which ranks read different batches, or None without data parallelism.

    torch deprecates slicing a flattened dim from the root mesh (`mesh["dp"]`); `_flatten` with the
    same name returns the view `build_device_mesh` created, without creating a new group.
    """
    if mesh is None or mesh.mesh_dim_names is None:
        return None
    dims = [name for name in ("dp_replicate", "dp_shard") if name in mesh.mesh_dim_names]
    if len(dims) == 1:
        return mesh[dims[0]]
    if len(dims) == 2:
        return mesh["dp_replicate", "dp_shard"]._flatten(DATA_PARALLEL_DIM)
    return None


def data_parallel_representatives(
    mesh: DeviceMesh | None, peers: tuple[str, ...] = ("pp", "cp", "tp")
) -> list[int] | None:
    """One global rank per data-parallel rank, in data-parallel order: the first of its tensor-parallel,
    context-parallel group and pipeline (which all read the same batch; `peers` names the dims to fold).
    None when every process is its own dp rank.

    What a gather over all processes keeps to count each sample once.
    """
    if mesh is None or mesh.mesh_dim_names is None:
        return None
    extra = [i for i, name in enumerate(mesh.mesh_dim_names) if name in peers]
    if not extra:
        return None
    ranks = mesh.mesh
    for dim in sorted(extra, reverse=True):
        ranks = ranks.select(dim, 0)
    return ranks.flatten().tolist()
