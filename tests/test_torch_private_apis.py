"""The private torch APIs unison relies on, one test each, so a torch that changes one fails here by name.

unison uses torch's public APIs except where only a private one does the job (docs/torch-versions.md
lists them).
If a test here fails after a torch upgrade, the place named in its docstring is what to rewrite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from slowness import budget


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
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=budget(120)
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_pytree_functions():
    """unison.parallel.apply, pipeline_split and stage_blocks walk nested values with torch.utils._pytree."""
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
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=budget(120)
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_group_counts_the_collectives_it_issued():
    """unison.health.position.sequence_number reads ProcessGroup._get_sequence_number_for_group: the hang
    watchdog tells ranks that diverged by it (0 before any collective, +1 per collective, on gloo)."""
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from unison.health.position import sequence_number
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        before = dist.group.WORLD._get_sequence_number_for_group()
        dist.all_reduce(torch.ones(1))
        dist.broadcast(torch.ones(1), src=0)
        assert (before, sequence_number()) == (0, 2), (before, sequence_number())
        dist.destroy_process_group()
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=budget(120)
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_every_backward_runs_the_engine_through_engine_run_backward():
    """unison.health.position recognises a main thread inside backward by its frame of
    torch/autograd/graph.py's private `_engine_run_backward` (there DDP's all-reduce waits): loss.backward()
    and torch.autograd.grad both pass through it."""
    import os
    import sys as system

    from unison.health import position

    seen = []

    def record(grad):
        frame = system._getframe()
        while frame is not None:
            seen.append((frame.f_code.co_filename, frame.f_code.co_name))
            frame = frame.f_back
        return grad

    x = torch.ones(2, requires_grad=True)
    x.register_hook(record)
    (x * 2).sum().backward()
    torch.autograd.grad((x * 3).sum(), x)
    engine = (os.path.join(os.path.dirname(torch.__file__), "autograd", "graph.py"), "_engine_run_backward")
    assert position._AUTOGRAD_ENGINE == engine
    assert seen.count(engine) == 2, seen


def test_torch_dispatch_mode_sees_c10d_collectives():
    """tests/workers/collective_bytes.py (tests and benchmarks only) counts the bytes of collectives with a
    TorchDispatchMode from torch.utils._python_dispatch, reading each c10d op's payload argument."""
    from torch.utils._python_dispatch import TorchDispatchMode

    assert hasattr(TorchDispatchMode, "__torch_dispatch__")
    schema = torch.ops.c10d._allgather_base_.default._schema
    assert [argument.name for argument in schema.arguments][:2] == ["output_tensor", "input_tensor"]
    schema = torch.ops.c10d._reduce_scatter_base_.default._schema
    assert [argument.name for argument in schema.arguments][:2] == ["output_tensor", "input_tensor"]


def test_context_parallel_load_balancing_switch():
    """unison.parallel.context._load_balancing turns off torch's head-tail reordering of the sequence
    through `_cp_options.enable_load_balance`, which `context_parallel` reads to pick its load balancer
    (with it on, the math SDPA kernel's causal mask sees the reordered sequence: wrong outputs on CPU)."""
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _create_default_load_balancer,
    )

    before = _cp_options.enable_load_balance
    try:
        _cp_options.enable_load_balance = True
        assert _create_default_load_balancer(8, 2, "cpu") is not None
        _cp_options.enable_load_balance = False
        assert _create_default_load_balancer(8, 2, "cpu") is None
    finally:
        _cp_options.enable_load_balance = before


def test_composable_checkpoint_keeps_names_and_takes_a_selective_context():
    """unison.parallel.checkpointing applies `torch.distributed._composable.checkpoint(block, context_fn=...)`
    (forward hooks on the block: parameter names unchanged), and its op-level save list names
    `torch.ops._c10d_functional.reduce_scatter_tensor`."""
    from torch.distributed._composable import checkpoint
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2))
    names = [name for name, _ in model.named_parameters()]
    checkpoint(model[0])
    contexts = lambda: create_selective_checkpoint_contexts([torch.ops.aten.addmm.default])  # noqa: E731
    checkpoint(model[2], context_fn=contexts)
    assert [name for name, _ in model.named_parameters()] == names
    model(torch.ones(3, 2, requires_grad=True)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default is not None


def test_torch_dispatch_mode_base_class():
    """unison.planning.activation_memory counts the outputs selective checkpointing caches with a
    `torch.utils._python_dispatch.TorchDispatchMode` subclass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2) @ torch.ones(2)
    assert torch.ops.aten.dot.default in seen


def test_grad_scaler_unscales_through_unscale_grads():
    """unison.precision.LayoutGroupedGradScaler replaces GradScaler._unscale_grads_(optimizer, inv_scale,
    found_inf, allow_fp16), which unscale_ calls and whose per-device flags step() reads."""
    calls = []

    class Counting(torch.amp.GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            calls.append(allow_fp16)
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.full((2,), 4.0)
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = Counting("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    assert calls == [False] and param.grad.tolist() == [2.0, 2.0] and param.tolist() == [-1.0, -1.0]


def test_dtensor_caches_that_hold_device_meshes_can_be_emptied():
    """unison.parallel.engines.release_dtensor_caches: DTensor's sharding-propagation caches (debug.
    _clear_sharding_prop_cache), the redistribution planner's (_redistribute.
    clear_redistribute_planner_cache, _gen_transform_infos) and MeshTopoInfo.build_from_mesh's hold a
    DeviceMesh (and through it the process group) after destroy_process_group; emptied, it is freed."""
    script = textwrap.dedent(
        """
        import gc, weakref, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from unison.parallel.engines import release_dtensor_caches
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        def use_a_mesh():
            mesh = init_device_mesh("cpu", (1,))
            (distribute_tensor(torch.ones(2, 2), mesh, [Shard(0)]) + 1).redistribute(mesh, [Replicate()])
            return weakref.ref(mesh)
        mesh = use_a_mesh()
        dist.destroy_process_group()
        gc.collect()
        assert mesh() is not None, "no cache holds the mesh any more: the release may be unneeded"
        release_dtensor_caches()
        gc.collect()
        assert mesh() is None, gc.get_referrers(mesh())
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=budget(120)
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
