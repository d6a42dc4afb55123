"""Type checks for torch's heavier distributed engines that do not import them.

torch.distributed.tensor (DTensor), FSDP2, pipelining and distributed checkpoint (with torch._dynamo,
which they pull in) take about a second to import on the 2-core build machine. Imported up front,
they made `import unison` 1.1 s slower than `import torch`, and every `unison` command paid that:
`unison launch` before it starts a worker, `unison plan` / `env` / `estimate-memory` before they
print a line. (A training process pays most of it anyway, since torch's optimizers import
torch._dynamo when they are built; the launcher and the tools build none.) So the modules that need
an engine import it where they use it, and code that only has to recognise an engine's objects asks
here. A tensor cannot be a DTensor, nor a module an FSDP2 module, unless that engine's package was
imported, so looking the class up in sys.modules answers correctly without importing anything.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

_DTENSOR_MODULE = "torch.distributed.tensor"
_FSDP_MODULE = "torch.distributed.fsdp"


def _loaded_class(module: str, name: str) -> type | None:
    """`module.name` if `module` is imported already, else None (nothing of it can exist yet)."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a torch DTensor (sharded or replicated over a DeviceMesh)."""
    dtensor = _loaded_class(_DTENSOR_MODULE, "DTensor")
    return dtensor is not None and isinstance(value, dtensor)


def is_fsdp_module(module: torch.nn.Module) -> bool:
    """Whether `module` was sharded by FSDP2's `fully_shard` (it is then an FSDPModule)."""
    fsdp_module = _loaded_class(_FSDP_MODULE, "FSDPModule")
    return fsdp_module is not None and isinstance(module, fsdp_module)


def release_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation and redistribution caches, which hold DeviceMeshes.

    A DeviceMesh keeps its process groups (by name, in a registry of its own), and DTensor caches the
    meshes of every op it propagated (FSDP2's `fully_shard` runs such ops: a ZeRO-3 `prepare()` is
    enough) in a thread-local cache and in a C++ one, neither reachable from any module, and those of
    every redistribution in three module-level ones, so
    destroy_process_group leaves the gloo group, and its threads, alive into the interpreter's teardown
    (docs/failures.md, "Known limits"). No public API clears them; the private ones are pinned in
    tests/test_torch_private_apis.py. A torch that lacks them keeps the caches: nothing else changes.
    """
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor was made: nothing cached
        return
    with contextlib.suppress(ImportError, AttributeError):
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        _redistribute.clear_redistribute_planner_cache()
        _redistribute._gen_transform_infos.cache_clear()
        MeshTopoInfo.build_from_mesh.cache_clear()
