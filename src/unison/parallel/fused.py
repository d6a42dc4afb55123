"""Fused projections (q|k|v, gate|up) under tensor parallelism: rows permuted once, checkpoints unchanged.

A fused projection's output is `parts` blocks side by side, split by the model with `chunk(parts, -1)`.
Under tensor parallelism rank r must compute its heads of every block, [q_r | k_r | v_r], but a plain
column split (`ColwiseParallel`, rows `Shard(0)`) would give rank 0 the first rows: q whole and half
of k at tp 2. So before the plan is applied, `permute_fused_projections` reorders the weight's (and
bias's) rows once, block-major to rank-major:

    [q_0 q_1 | k_0 k_1 | v_0 v_1]  ->  [q_0 k_0 v_0 | q_1 k_1 v_1]      (tp 2, rows of c_attn)

after which the plain column split gives each rank its [q_r | k_r | v_r]: the forward is one local
matmul, as on one device, and the weight and its gradient never cross the wire (the earlier way stored
the plain split and redistributed it to torch's private `_StridedShard` in every forward: an
all-gather of the weight per layer in forward and of its gradient in backward).

The parameter itself now holds permuted rows, so everything that leaves the process translates back
to the user's layout, which is what a checkpoint holds whatever the layout that wrote it:

- the module's `state_dict()` (and so torch's `get_model_state_dict`, DCP saves, `full_state_dict`,
  `save_model`) gives the un-permuted weight, as a DTensor with the parameter's placements;
  `load_state_dict()` (and `set_model_state_dict`, DCP loads) takes the user's layout and permutes it;
- the optimizer's `state_dict()` / `load_state_dict()` do the same for the state of those parameters
  (momentum, Adam's moments), once `keep_user_layout_in_optimizer` registered it (prepare() does).

Translating needs the whole matrix (`full_tensor()`, one all-gather over the TP group, FSDP's too),
so under tensor parallelism these state dicts are collective: every rank of the model calls them, as
all of unison's checkpoint code does. Code that reads `module.weight` directly sees the permuted rows.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import Placement


class FusedColwiseParallel(ColwiseParallel):
    """Column parallel for an nn.Linear whose output is `parts` equal blocks side by side (q|k|v, gate|up).

    Each rank computes its share of every block: the local output is [block_0 share | block_1 share |
    ...], which `chunk(parts, dim=-1)` splits as on one device. Give it to unison
    (`apply_tensor_parallel`, `ParallelismConfig(tp_plan=...)`), which permutes the rows first (see the
    module docstring); torch's `parallelize_module` alone would apply it as a plain ColwiseParallel.
    """

    def __init__(
        self, parts: int = 3, *, input_layouts: Placement | None = None, use_local_output: bool = True
    ):
        super().__init__(input_layouts=input_layouts, use_local_output=use_local_output)
        if parts < 2:
            raise ValueError(
                f"FusedColwiseParallel(parts={parts}): a fused projection has at least 2 blocks; "
                "use ColwiseParallel for a single one."
            )
        self.parts = parts

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(parts={self.parts}, input_layouts={self.input_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


@dataclass(frozen=True)
class RowOrder:
    """How a fused projection's rows are stored: `parts` blocks, each split over `tp` ranks."""

    parts: int
    tp: int

    def _reorder(self, rows: torch.Tensor, outer: int, inner: int) -> torch.Tensor:
        share = rows.shape[0] // (self.parts * self.tp)
        return rows.reshape(outer, inner, share, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)

    def permute(self, rows: torch.Tensor) -> torch.Tensor:
        """User's layout (block-major) -> stored layout (rank-major)."""
        return self._reorder(rows, self.parts, self.tp)

    def unpermute(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored layout (rank-major) -> user's layout (block-major)."""
        return self._reorder(rows, self.tp, self.parts)


@torch.no_grad()
def _translate(value: Any, order: RowOrder, to_user: bool, rows: int) -> Any:
    """`value` (a weight, a bias or their optimizer state) in the other layout, of the same kind: a
    DTensor keeps its mesh and placements, a plain tensor stays plain. Anything not shaped like the
    fused rows (a missing key, a wrong shape torch will report, a meta tensor) is returned unchanged."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
        return value
    if value.device.type == "meta":
        return value
    reorder = order.unpermute if to_user else order.permute
    if not isinstance(value, DTensor):
        return reorder(value.detach())
    whole = reorder(value.detach().full_tensor())
    # every rank holds the whole matrix: each keeps its own shard of it, nothing is sent
    return distribute_tensor(whole, value.device_mesh, value.placements, src_data_rank=None)


_FUSED: weakref.WeakKeyDictionary[nn.Module, RowOrder] = weakref.WeakKeyDictionary()
"""The fused projections whose rows are permuted, for the optimizer's hooks to find their parameters
(by the module: FSDP2 replaces a module's parameters after tensor parallelism)."""


def _module_hooks(module: nn.Linear, order: RowOrder) -> None:
    """State-dict hooks translating `module`'s weight and bias (closures: a copy of the module, such as
    a pipeline stage's, translates too)."""
    rows = module.out_features

    def saved(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + name] = _translate(state_dict[prefix + name], order, True, rows)

    def loading(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + name] = _translate(state_dict[prefix + name], order, False, rows)

    module.register_state_dict_post_hook(saved)
    module.register_load_state_dict_pre_hook(loading)


@torch.no_grad()
def permute_fused_projections(modules: Mapping[str, tuple[nn.Module, int]], tp: int) -> None:
    """Reorder the rows of each name -> (nn.Linear, parts) in place for a `tp`-way column split, and make
    the module's state dicts translate to and from the user's layout. Call before the plan is applied;
    every module is checked before any is changed."""
    for name, (module, _) in modules.items():
        if not isinstance(module, nn.Linear):
            raise TypeError(
                f"FusedColwiseParallel applies to nn.Linear, but {name} is a {type(module).__name__}. "
                "Give it the fused projection (e.g. attn.c_attn)."
            )
        if module in _FUSED:
            raise ValueError(
                f"{name} already had its rows permuted for tensor parallelism (tp={_FUSED[module].tp}): "
                "apply tensor parallelism once per model."
            )
    for module, parts in modules.values():
        order = RowOrder(parts, tp)
        for param in (module.weight, module.bias):
            if param is not None and param.device.type != "meta":
                param.copy_(order.permute(param))
        _module_hooks(module, order)
        _FUSED[module] = order


def _fused_parameters() -> dict[int, tuple[RowOrder, int]]:
    """id(parameter) -> (its row order, its row count) for every permuted projection alive."""
    found = {}
    for module, order in list(_FUSED.items()):
        for param in (module.weight, module.bias):
            if param is not None:
                found[id(param)] = (order, module.out_features)
    return found


def in_stored_layout(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full`, a whole tensor in the user's layout meant for `param`, in the layout `param` stores: its
    rows permuted when `param` is a permuted projection's weight or bias (for a meta-built model filled
    from process 0's weights), else `full` itself."""
    fused = _fused_parameters().get(id(param))
    if fused is None or full.dim() == 0 or full.shape[0] != fused[1]:
        return full
    return fused[0].permute(full)


def _optimizer_state_translated(optimizer: torch.optim.Optimizer, state_dict: dict, to_user: bool) -> dict:
    """`state_dict` (torch's form: state keyed by parameter index) with the permuted parameters' state
    in the other layout. New dicts throughout: the caller's stay as they were."""
    fused = _fused_parameters()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [index for group in state_dict["param_groups"] for index in group["params"]]
    state = dict(state_dict["state"])
    for index, param in zip(indices, params):
        if id(param) in fused and index in state:
            order, rows = fused[id(param)]
            state[index] = {key: _translate(v, order, to_user, rows) for key, v in state[index].items()}
    return {**state_dict, "state": state}


_TRANSLATING: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def keep_user_layout_in_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer`'s state_dict() give, and load_state_dict() take, the state of permuted fused
    projections in the user's layout. Nothing for an optimizer without such parameters (or one that
    already translates)."""
    fused = _fused_parameters()
    if optimizer in _TRANSLATING or not any(
        id(p) in fused for group in optimizer.param_groups for p in group["params"]
    ):
        return
    _TRANSLATING.add(optimizer)
    optimizer.register_state_dict_post_hook(lambda opt, sd: _optimizer_state_translated(opt, sd, True))
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: _optimizer_state_translated(opt, sd, False))
