"""Launched by tests/test_ops.py: every collective of unison.ops in a real gloo group.

Usage: ops_worker.py OUT_DIR. Rank r's inputs are a known function of r, so each rank computes the
expected result of every collective locally (from all ranks' inputs) and asserts on it; it then
records the checks it passed and the error messages it saw in OUT_DIR/rank{r}.json for the test.
"""

import dataclasses
import json
import sys
from collections import namedtuple
from pathlib import Path

import torch
from torch.testing import assert_close

from unison import PartialState, ops
from unison.ops import DistributedOperationException as Mismatch  # a ValueError, Accelerate's name
from unison.ops import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from unison.random import set_seed

Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    labels: torch.Tensor


state = PartialState(cpu=True)
rank, world = state.process_index, state.num_processes
assert world == 3, world
debug_at_start = state.debug  # launched without --debug / UNISON_DEBUG
state.debug = True  # the cross-rank checks, switched on at run time as Accelerate's test_op_checker does
passed: list[str] = []
errors: dict[str, str] = {}


def inputs(r: int) -> dict:
    """Rank r's nested structure: a 0-d tensor, a namedtuple, a dataclass, a list; float, int, bool."""
    return {
        "scalar": torch.tensor(float(r) + 0.5),
        "pair": Pair(x=torch.arange(6.0).reshape(2, 3) + 10 * r, y=torch.full((2,), r, dtype=torch.int64)),
        "out": Out(
            logits=torch.randn(2, 4, generator=torch.Generator().manual_seed(r)), labels=torch.tensor([r, -r])
        ),
        "flags": [torch.tensor([True, r == 1])],
    }


def leaves(d: dict) -> dict:
    """The structure above flattened by hand (an independent reference, not unison's walker)."""
    return {
        "scalar": d["scalar"],
        "x": d["pair"].x,
        "y": d["pair"].y,
        "logits": d["out"].logits,
        "labels": d["out"].labels,
        "flags": d["flags"][0],
    }


def check_structure(result: dict) -> None:
    assert isinstance(result, dict) and list(result) == ["scalar", "pair", "out", "flags"], result
    assert type(result["pair"]) is Pair and type(result["out"]) is Out and type(result["flags"]) is list


everyone = [leaves(inputs(r)) for r in range(world)]
mine = inputs(rank)

# -- gather -------------------------------------------------------------------------------------------
result = gather(mine)
check_structure(result)
got = leaves(result)
for name in got:
    expected = torch.cat([e[name].reshape(1) if e[name].ndim == 0 else e[name] for e in everyone])
    assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), (name, got[name], expected)
assert got["scalar"].shape == (world,)
assert torch.equal(mine["pair"].x, everyone[rank]["x"])  # the input is untouched
noncontiguous = (torch.arange(6.0).reshape(2, 3) + rank).t()
assert_close(
    gather(noncontiguous), torch.cat([(torch.arange(6.0).reshape(2, 3) + r).t() for r in range(world)])
)
ops._gather_into_tensor_works = False  # the all_gather fallback for backends without gather-into-tensor
assert all(torch.equal(a, b) for a, b in zip(leaves(gather(mine)).values(), got.values()))
ops._gather_into_tensor_works = True
passed.append("gather")

# -- gather_object ------------------------------------------------------------------------------------
assert gather_object([f"r{rank}"] * (rank + 1)) == ["r0", "r1", "r1", "r2", "r2", "r2"]
assert gather_object({"rank": rank}) == [{"rank": r} for r in range(world)]
passed.append("gather_object")

# -- reduce -------------------------------------------------------------------------------------------
numeric = {"x": mine["pair"].x, "logits": mine["out"].logits, "labels": mine["out"].labels}
stacked = {name: torch.stack([e[name] for e in everyone]) for name in numeric}
for reduction in ("sum", "mean", "max", "min"):
    result = reduce(numeric, reduction)
    for name, values in stacked.items():
        if reduction == "mean":
            expected = values.sum(0) / world  # integers: exact sum, then true division -> float
        else:
            expected = getattr(values, reduction)(0)
            expected = expected.values if reduction in ("max", "min") else expected
        assert result[name].dtype == expected.dtype, (reduction, name, result[name].dtype, expected.dtype)
        assert_close(result[name], expected, msg=f"{reduction} {name}")
assert reduce(mine["pair"].y, "mean").dtype == torch.float32
assert_close(reduce(mine["out"].logits, "sum", scale=0.5), 0.5 * stacked["logits"].sum(0))
flags = torch.stack([e["flags"] for e in everyone])
assert torch.equal(reduce(mine["flags"][0], "sum"), flags.long().sum(0))
assert torch.equal(reduce(mine["flags"][0], "max"), flags.any(0))
assert torch.equal(reduce(mine["flags"][0], "min"), flags.all(0))
assert torch.equal(mine["pair"].x, everyone[rank]["x"])  # reduce never modifies its input
passed.append("reduce")

# -- broadcast ----------------------------------------------------------------------------------------
data = inputs(rank)
x_before = data["pair"].x
result = broadcast(data, from_process=1)
check_structure(result)
for name, value in leaves(result).items():
    assert torch.equal(value, everyone[1][name]), (name, value, everyone[1][name])
assert result["pair"].x is x_before and torch.equal(x_before, everyone[1]["x"])  # written in place
base = torch.arange(6.0).reshape(2, 3) * (rank + 1)
broadcast(base.t(), from_process=2)  # a non-contiguous view: the values land in `base`
assert torch.equal(base, torch.arange(6.0).reshape(2, 3) * 3)
assert broadcast_object_list([f"from {rank}", {"r": rank}], from_process=2) == ["from 2", {"r": 2}]
passed.append("broadcast")

# -- pad_across_processes -----------------------------------------------------------------------------
ragged = {
    "ids": torch.arange(rank + 1) + 100 * rank,
    "mask": torch.ones(2, rank + 1) * rank,
    "n": torch.tensor(rank),
}
longest = world  # rank r has r + 1 rows
for pad_first in (False, True):
    padded = pad_across_processes(ragged, dim=0, pad_index=-1, pad_first=pad_first)
    fill = torch.full((longest - rank - 1,), -1)
    expected_ids = torch.cat([fill, ragged["ids"]] if pad_first else [ragged["ids"], fill])
    assert torch.equal(padded["ids"], expected_ids), (pad_first, padded["ids"], expected_ids)
    assert torch.equal(padded["mask"], ragged["mask"]) and torch.equal(padded["n"], ragged["n"])
    gathered = gather(padded["ids"])
    rows = []
    for r in range(world):
        fill_r = torch.full((longest - r - 1,), -1)
        ids_r = torch.arange(r + 1) + 100 * r
        rows.append(torch.cat([fill_r, ids_r] if pad_first else [ids_r, fill_r]))
    assert torch.equal(gathered, torch.cat(rows)), (gathered, rows)
padded = pad_across_processes(ragged["mask"], dim=1)
assert padded.shape == (2, longest) and torch.equal(padded[:, : rank + 1], ragged["mask"])
assert torch.all(padded[:, rank + 1 :] == 0)
assert torch.equal(pad_across_processes(ragged["mask"], dim=-1), padded)
passed.append("pad_across_processes")

# -- set_seed -----------------------------------------------------------------------------------------
set_seed(42)
draws = gather(torch.rand(1, 3))
assert all(torch.equal(draws[0], row) for row in draws), draws
set_seed(42, device_specific=True)
draw = torch.rand(3)
assert torch.equal(draw, torch.rand(3, generator=torch.Generator().manual_seed(42 + rank)))
assert len({tuple(row.tolist()) for row in gather(draw[None])}) == world
passed.append("set_seed")


# -- errors on every rank, and the group still works afterwards --------------------------------------
def expect_error(name: str, exception: type, call) -> None:
    try:
        call()
    except exception as error:
        errors[name] = str(error)
    else:
        raise AssertionError(f"{name}: no {exception.__name__} on rank {rank}")
    after = gather(torch.tensor([rank, len(errors)]))
    assert after.tolist() == [v for r in range(world) for v in (r, len(errors))], after


expect_error("gather_shapes", Mismatch, lambda: gather(torch.zeros(rank + 4, 3)))
expect_error("reduce_shapes", Mismatch, lambda: reduce({"loss": torch.zeros(3, rank + 1)}, "sum"))
expect_error("broadcast_shapes", Mismatch, lambda: broadcast(torch.zeros(rank + 1)))
expect_error(
    "gather_dtypes",
    Mismatch,
    lambda: gather({"a": torch.zeros(2, dtype=torch.int64 if rank == 1 else torch.float32)}),
)
expect_error(
    "reduce_structure",
    Mismatch,
    lambda: reduce({"a": torch.zeros(2), **({"b": torch.zeros(2)} if rank == 2 else {})}),
)
expect_error("pad_ndim", Mismatch, lambda: pad_across_processes(torch.zeros([2] * (rank + 1))))
expect_error("different_ops", Mismatch, lambda: (gather if rank == 0 else reduce)(torch.zeros(2)))
expect_error("gather_one_rank_not_tensor", Mismatch, lambda: gather([1.5 if rank == 1 else torch.zeros(2)]))
expect_error("gather_not_tensor", TypeError, lambda: gather({"loss": torch.zeros(1), "name": "x"}))
expect_error("reduce_unknown", ValueError, lambda: reduce(torch.zeros(1), "median"))
expect_error("broadcast_from_out_of_range", ValueError, lambda: broadcast(torch.zeros(1), from_process=world))
passed.append("errors")

Path(sys.argv[1], f"rank{rank}.json").write_text(
    json.dumps({"rank": rank, "passed": passed, "errors": errors, "debug_at_start": debug_at_start})
)
