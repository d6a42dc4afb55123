"""Mixed precision under FSDP2 that computes what autocast computes: which parameters a sharded model
gathers in half precision, and which in fp32.

Autocast does not make a model half precision: matmul-type ops (linear, conv, addmm, matmul) cast their
weights to the compute dtype (round to nearest, the cast FSDP2's `param_dtype` all-gather makes), while
norms, embeddings, softmax and losses run on fp32 weights, and the residual stream, the sum of a block's
fp32 input and its half-precision branches, stays fp32. FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)`
on every unit instead gathers embeddings and norms in bf16 and casts each unit's inputs to bf16: the
residual stream becomes bf16. On a 12-block GPT that put the sharded run 3.1e-3 from one-process autocast
after 6 steps, where DDP under autocast is 5.7e-4 (tests/test_sharded_autocast.py). (Keeping the stream
fp32 but the norms' weights bf16 is no middle way: CPU layer_norm refuses fp32 inputs with bf16 weights.)

So the parameters are sorted by what autocast does with them (`computes_in_half`):

- those of matmul-type modules travel in the compute dtype, which halves their all-gathers (the bulk of
  a transformer: its blocks' projections); each block stays one unit, gathered and resharded as before;
- the modules whose parameters are vectors and stay fp32 (every block's norms, the final norm) form one
  fp32 unit for the whole model, gathered when the model's forward starts and kept until backward is
  done: O(width) bytes per block, and one collective per step instead of one per block (a unit of norms
  in each block cost 7-16% more CPU time per step, benchmarks/sharded_precision.py);
- any other fp32 parameter (embeddings, a matmul weight tied to one, as GPT's head and token embedding
  are: the embedding reads it in fp32, the head's matmul casts it itself; a custom module's matrices)
  stays with its unit: the unit gathers in fp32, or, where it also holds matmul-type modules, those
  modules form an fp32 unit inside it;
- no unit casts its inputs (`cast_forward_inputs=False`), so activations keep the dtype autocast gave them;
- gradients are reduced in fp32 everywhere, and the sharded master weights stay fp32.

Autocast still runs on top (precision.py) and makes every per-op choice; FSDP2 only decides the bytes.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .engines import is_fsdp_module

_HALF_MODULES = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
"""Modules whose forward hands every parameter to an op autocast runs in the compute dtype."""


def computes_in_half(module: nn.Module) -> bool:
    """Whether autocast casts all of `module`'s own parameters to the compute dtype where it uses them.

    torch's linear and conv modules as they are (a subclass that overrides `forward` may do anything
    with its weights, so it counts as fp32: still autocast's numbers, only more bytes), and Hugging Face
    transformers' Conv1D (GPT-2's projections: one addmm), recognised by name so transformers need not
    be imported.
    """
    kind = type(module)
    if isinstance(module, _HALF_MODULES):
        return any(kind.forward is base.forward for base in _HALF_MODULES)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers.")


def shard_as_autocast(
    model: nn.Module, blocks: list[nn.Module], compute_dtype: torch.dtype, **shard_kwargs: Any
) -> None:
    """`fully_shard` each of `blocks`, then `model`, gathering in `compute_dtype` only what autocast
    computes in it (see the module's docstring); `shard_kwargs` go to every `fully_shard`."""
    units = [*blocks, model]
    owners = _owners(model)

    def vector_only(module: nn.Module) -> bool:  # a norm: fp32 vectors, in no unit's module itself
        tied = _owners_of(module, owners)
        return all(m not in units and _stays_full(m, owners) and _vectors_only(m) for m in tied)

    held = [m for modules in owners.values() for m in modules]
    vectors = _topmost([m for m in held if m not in units and vector_only(m)])
    if vectors:
        gathered_all_step = {**shard_kwargs, "reshard_after_forward": False}
        fully_shard(vectors, **gathered_all_step, mp_policy=_policy(None))
    for unit in units:
        _shard_unit(unit, compute_dtype, **shard_kwargs)
    if vectors:
        # gathered when the model's forward starts, not only when a norm's forward does: a block that reads
        # its norm's weight itself (a fused add-and-norm kernel) finds it gathered too
        norms = cast(FSDPModule, vectors[0])  # unshard() is idempotent: the norms' own hooks find it done
        model.register_forward_pre_hook(lambda module, args: norms.unshard())


def _shard_unit(unit: nn.Module, compute_dtype: torch.dtype, **shard_kwargs: Any) -> None:
    """`fully_shard(unit)` for the parameters it holds: in the compute dtype where all are matmul-type,
    in fp32 where none is; where both are, the unit takes the compute dtype and its fp32 modules become an
    fp32 unit inside it, unless the unit module owns fp32 parameters itself (it cannot be inside itself):
    then it takes fp32 and its matmul-type modules become the inner unit in the compute dtype."""
    owners = _owners(unit)
    held = list({id(m): m for ms in owners.values() for m in ms}.values())
    half = [m for m in held if m is not unit and not _stays_full(m, owners)]
    full = [m for m in held if m is not unit and _stays_full(m, owners)]
    if (unit in held and _stays_full(unit, owners)) or not half:
        unit_dtype, inner, inner_dtype = None, half, compute_dtype  # None: the parameters' own (fp32)
    else:
        unit_dtype, inner, inner_dtype = compute_dtype, full, None
    if inner:
        fully_shard(_topmost(inner), **shard_kwargs, mp_policy=_policy(inner_dtype))
    fully_shard(unit, **shard_kwargs, mp_policy=_policy(unit_dtype))


def _policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def _owners(unit: nn.Module) -> dict[int, list[nn.Module]]:
    """id(parameter) -> the modules that own it directly, over the parameters `unit` holds: those of
    `unit` and its submodules, less those inside an FSDP2 unit already (they are that unit's)."""
    owners: dict[int, list[nn.Module]] = {}
    stack = [unit]
    while stack:
        module = stack.pop()
        if module is not unit and is_fsdp_module(module):
            continue
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append(module)
        stack.extend(reversed(list(module.children())))
    return owners


def _owners_of(module: nn.Module, owners: dict[int, list[nn.Module]]) -> list[nn.Module]:
    """`module` and every module that shares one of its parameters."""
    return [owner for p in module.parameters(recurse=False) for owner in owners[id(p)]]


def _stays_full(module: nn.Module, owners: dict[int, list[nn.Module]]) -> bool:
    """Whether autocast uses some of `module`'s own parameters in fp32: it is no matmul-type module, or
    one of its parameters is tied to a module that is none."""
    return not all(computes_in_half(owner) for owner in _owners_of(module, owners))


def _vectors_only(module: nn.Module) -> bool:
    """Whether every parameter of `module`'s subtree is a vector or a scalar (a norm's weight and bias)."""
    return all(p.dim() <= 1 for p in module.parameters())


def _topmost(modules: list[nn.Module]) -> list[nn.Module]:
    """`modules` once each, less those inside another of them (an FSDP2 unit takes a module's subtree)."""
    unique = list({id(m): m for m in modules}.values())
    listed = {id(m) for m in unique}
    inside = {id(d) for m in unique for d in m.modules() if d is not m and id(d) in listed}
    return [m for m in unique if id(m) not in inside]
