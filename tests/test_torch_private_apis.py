"""The private torch APIs unison relies on, one test each, so a torch that changes one fails here by name.

unison uses torch's public APIs except where only a private one does the job (the README lists them).
If a test here fails after a torch upgrade, the place named in its docstring is what to rewrite.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import torch
from torch.distributed.tensor.parallel import ColwiseParallel


def test_device_mesh_flatten_names_a_flattened_dp_dimension():
    """unison.parallel.mesh: `mesh["dp_replicate", "dp_shard"]._flatten("dp")`, HSDP's data-parallel group."""
    script = textwrap.dedent(
        """
        import os, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        assert flat.mesh_dim_names == ("dp",) and flat.size() == 1, flat
        again = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        assert again.get_group() is flat.get_group()  # the same view, no new group
        dist.destroy_process_group()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_strided_shard_placement():
    """unison.parallel.tensor.FusedColwiseParallel redistributes a fused q|k|v weight to _StridedShard."""
    from torch.distributed.tensor.placement_types import _StridedShard

    placement = _StridedShard(0, split_factor=3)
    assert placement.dim == 0 and placement.split_factor == 3


def test_colwise_parallel_hooks_that_fused_colwise_parallel_overrides_and_calls():
    """FusedColwiseParallel subclasses ColwiseParallel: it overrides `_apply` (ParallelStyle's abstract
    method, which parallelize_module calls) and calls `_partition_linear_fn` and `_prepare_input_fn`."""
    assert list(inspect.signature(ColwiseParallel._apply).parameters) == ["self", "module", "device_mesh"]
    assert "_apply" in torch.distributed.tensor.parallel.style.ParallelStyle.__abstractmethods__
    partition = inspect.signature(ColwiseParallel._partition_linear_fn).parameters
    assert list(partition) == ["self", "name", "module", "device_mesh"]
    prepare = list(inspect.signature(ColwiseParallel._prepare_input_fn).parameters)
    assert prepare[-4:] == ["desired_input_layouts", "mod", "inputs", "device_mesh"]
    style = ColwiseParallel()
    assert hasattr(style, "input_layouts") and hasattr(style, "desired_input_layouts")


def test_pytree_functions():
    """unison.parallel.apply and pipeline_split walk nested batches with torch.utils._pytree."""
    from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

    batch = {"x": torch.ones(2), "y": (torch.zeros(1), [3])}
    leaves, spec = tree_flatten(batch)
    assert len(leaves) == 3 and tree_unflatten(leaves, spec)["y"][1] == [3]
    assert tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, batch)["x"].tolist() == [2.0, 2.0]


def test_foreach_mul_by_a_tensor_scale():
    """unison.item_count scales every gradient of a device in one call: torch._foreach_mul_(grads, t)."""
    grads = [torch.ones(3), torch.full((2,), 2.0)]
    torch._foreach_mul_(grads, torch.tensor(0.5))
    assert grads[0].tolist() == [0.5] * 3 and grads[1].tolist() == [1.0, 1.0]


def test_compiled_module_keeps_the_original_as_orig_mod():
    """unison.parallel.ddp.unwrap / wrapper_prefix find the user's module inside torch.compile's
    OptimizedModule through its `_orig_mod` attribute (the key prefix torch.compile adds)."""
    user = torch.nn.Linear(2, 2)
    compiled = torch.compile(user, backend="eager")
    assert compiled._orig_mod is user
    assert set(compiled.state_dict()) == {"_orig_mod.weight", "_orig_mod.bias"}


def test_module_compile_keeps_its_compiled_call_in_compiled_call_impl():
    """unison.parallel.compiling.compile_model tells a module the user already compiled in place by
    `nn.Module.compile()`'s `_compiled_call_impl` attribute (None until compile() sets it)."""
    module = torch.nn.Linear(2, 2)
    assert module._compiled_call_impl is None
    module.compile(backend="eager")
    assert module._compiled_call_impl is not None
    assert set(module.state_dict()) == {"weight", "bias"}  # in place: the names stay


def test_async_collective_tensor_becomes_a_plain_tensor_with_its_gradient_path_on_a_copy():
    """unison.parallel.compiling._wait_for_collective_inputs: a tensor-parallel block's input may be
    torch.distributed._functional_collectives.AsyncCollectiveTensor; its clone() is a plain tensor that
    keeps the autograd history."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    collective = AsyncCollectiveTensor(torch.ones(2)).requires_grad_()
    waited = collective.clone()
    assert type(waited) is torch.Tensor and waited.grad_fn is not None
    (2 * waited).sum().backward()
    assert collective.grad.tolist() == [2.0, 2.0]


def test_ddp_says_whether_its_forward_armed_the_backward_all_reduce():
    """unison.parallel.ddp.trigger_sync_in_backward reads DDP's `require_forward_param_sync` (undocumented):
    True after a forward outside no_sync (the backward all-reduces), False after one inside."""
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
        ddp(torch.ones(1, 2))
        armed = ddp.require_forward_param_sync
        with ddp.no_sync():
            ddp(torch.ones(1, 2))
        assert armed is True and ddp.require_forward_param_sync is False
        dist.destroy_process_group()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_group_counts_the_collectives_it_issued():
    """unison.position.sequence_number reads ProcessGroup._get_sequence_number_for_group: the hang
    watchdog tells ranks that diverged by it (0 before any collective, +1 per collective, on gloo)."""
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from unison.position import sequence_number
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        before = dist.group.WORLD._get_sequence_number_for_group()
        dist.all_reduce(torch.ones(1))
        dist.broadcast(torch.ones(1), src=0)
        assert (before, sequence_number()) == (0, 2), (before, sequence_number())
        dist.destroy_process_group()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
