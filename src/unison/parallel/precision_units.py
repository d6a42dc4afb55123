"""Mixed precision under FSDP2 that computes what autocast computes: which parameters a sharded unit
gathers in half precision, and which in fp32.

Autocast does not make a model half precision: matmul-type ops (linear, conv, addmm, matmul) cast their
weights to the compute dtype (round to nearest, the cast FSDP2's `param_dtype` all-gather makes), while
norms, embeddings, softmax and losses run on fp32 weights, and the residual stream, the sum of a block's
fp32 input and its half-precision branches, stays fp32. FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)`
on every unit instead gathers embeddings and norms in bf16 and casts each unit's inputs to bf16: the
residual stream becomes bf16. On a 12-block GPT that tripled the distance to one-process autocast
(1.65e-3 after 6 steps, DDP under autocast 4.9e-4; tests/test_sharded_autocast.py).

So each unit is split by what autocast does with its parameters:

- the parameters of matmul-type modules (`computes_in_half`) travel in the compute dtype, which halves
  their all-gather (the bulk of a transformer: its blocks' projections);
- the rest (norms, embeddings, any other module, and a matmul's weight tied to one of those, as GPT's
  head and token embedding are: the embedding reads it in fp32, the head's matmul casts it itself)
  travel in fp32, as one extra FSDP2 unit inside the unit (`fully_shard` of the list of those modules);
- no unit casts its inputs (`cast_forward_inputs=False`), so activations keep the dtype autocast gave them;
- gradients are reduced in fp32 everywhere, and the sharded master weights stay fp32.

Autocast still runs on top (precision.py) and makes every per-op choice; FSDP2 only decides the bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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


def shard_as_autocast(unit: nn.Module, compute_dtype: torch.dtype, **shard_kwargs) -> None:
    """`fully_shard(unit, **shard_kwargs)` gathering in `compute_dtype` only what autocast computes in it.

    The parameters `unit` holds (those not in an FSDP2 unit inside it already) are sorted by the module
    that owns them. Where both kinds are present, the unit takes the compute dtype and the modules whose
    parameters stay fp32 become one fp32 unit inside it; where the unit module owns parameters itself
    that stay fp32 (a block's own scale vector), it cannot be inside itself, so it takes fp32 and the
    matmul-type modules become the inner unit in the compute dtype.
    """
    half, full, unit_is_full = _split(unit)
    if unit_is_full or not half:
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


def _split(unit: nn.Module) -> tuple[list[nn.Module], list[nn.Module], bool]:
    """(modules whose parameters autocast casts, modules whose parameters stay fp32, whether the unit
    module's own parameters stay fp32), over the modules below `unit` that own parameters it holds.
    A parameter tied across modules stays fp32 unless every module that owns it computes in half."""
    owners: dict[int, list[nn.Module]] = {}
    for module in _held_modules(unit):
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append(module)

    def stays_full(module: nn.Module) -> bool:
        own = module.parameters(recurse=False)
        return not all(computes_in_half(owner) for p in own for owner in owners[id(p)])

    holders = list({id(m): m for ms in owners.values() for m in ms}.values())
    half = [m for m in holders if m is not unit and not stays_full(m)]
    full = [m for m in holders if m is not unit and stays_full(m)]
    return half, full, unit in holders and stays_full(unit)


def _held_modules(unit: nn.Module) -> list[nn.Module]:
    """`unit` and its submodules in model order, less those inside an FSDP2 unit already (their
    parameters are that unit's)."""
    held: list[nn.Module] = []
    stack = [unit]
    while stack:
        module = stack.pop()
        if module is not unit and is_fsdp_module(module):
            continue
        held.append(module)
        stack.extend(reversed(list(module.children())))
    return held


def _topmost(modules: list[nn.Module]) -> list[nn.Module]:
    """`modules` less those inside another of them (an FSDP2 unit takes a module's whole subtree)."""
    listed = {id(m) for m in modules}
    inside = {id(d) for m in modules for d in m.modules() if d is not m and id(d) in listed}
    return [m for m in modules if id(m) not in inside]
