"""Where this process sits in the run's layout, under Accelerate's property names: its coordinate in
each parallel dimension of the DeviceMesh, the mesh and config themselves, and which engine holds the
replicas. A mixin of the Accelerator, which provides `parallelism`, `device_mesh`, `use_distributed`
and `distributed_type`."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from ..state import DistributedType
from .apply import data_parallel_engine
from .config import ParallelismConfig


class LayoutProperties:
    """parallelism_config / torch_device_mesh / *_parallel_rank / is_fsdp2 / multi_device."""

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The layout (`Accelerator.parallelism`); None until prepare() when parallelism="auto"."""
        return self.parallelism

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        return self.device_mesh

    @property
    def is_fsdp2(self) -> bool:
        """Whether the data-parallel replicas are held by FSDP2 (ZeRO-2/3, HSDP, or beside TP/PP)."""
        return data_parallel_engine(self._layout_needed("is_fsdp2")) == "fsdp"

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def multi_device(self) -> bool:
        """Several processes, each with its own GPU."""
        return self.use_distributed and self.distributed_type == DistributedType.MULTI_GPU

    @property
    def data_parallel_rank(self) -> int:
        """This process's coordinate among the replicas (dp_replicate); 0 without replicas."""
        return self._coordinate("dp_replicate")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's coordinate among the shards (dp_shard); 0 without sharding."""
        return self._coordinate("dp_shard")

    @property
    def tensor_parallel_rank(self) -> int:
        return self._coordinate("tp")

    @property
    def pipeline_parallel_rank(self) -> int:
        return self._coordinate("pp")

    @property
    def context_parallel_rank(self) -> int:
        """This process's coordinate in its context-parallel group (cp); 0 without cp."""
        return self._coordinate("cp")

    def _coordinate(self, dimension: str) -> int:
        self._layout_needed(f"{dimension} rank")
        mesh = self.device_mesh
        if mesh is None or dimension not in (mesh.mesh_dim_names or ()):
            return 0
        return mesh.get_local_rank(dimension)
