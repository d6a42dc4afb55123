"""unison.ops and unison.random: nested-structure helpers in one process, collectives in three.

The single-process tests pin down structure handling (types rebuilt, leaves in place, errors); the
launched test runs every collective in a real 3-process gloo group (tests/workers/ops_worker.py),
where each rank checks its results against values computed from all ranks' known inputs.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch
from launching import WORKERS, launch_ok

from unison import PartialState
from unison.ops import (
    _pad_to,
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)
from unison.random import get_rng_state, set_rng_state, set_seed

Point = namedtuple("Point", "x y")


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    labels: torch.Tensor
    name: str = "batch"


@dataclasses.dataclass(frozen=True)
class Frozen:
    values: torch.Tensor
    doubled: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "doubled", self.values * 2)


class Movable:
    """Not a tensor, but has a .to() without non_blocking (send_to_device must still move it)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def to(self, device):
        return Movable(device)


@pytest.fixture(autouse=True)
def single_process(fresh_state):
    """A plain `python script.py` process on the CPU."""
    PartialState(cpu=True)


def nested(offset: float = 0.0) -> dict:
    return {
        "point": Point(x=torch.arange(4.0) + offset, y=[torch.ones(4, 2) + offset, "tag"]),
        "batch": Batch(inputs=torch.zeros(4, 3) + offset, labels=torch.arange(4) + int(offset)),
        "frozen": Frozen(torch.full((4,), offset)),
        "count": 7,
    }


# -- walking and rebuilding ---------------------------------------------------------------------------
def test_recursively_apply_rebuilds_every_container_type():
    data = nested()
    result = recursively_apply(lambda t: t + 1, data)
    assert type(result["point"]) is Point and type(result["batch"]) is Batch
    assert torch.equal(result["point"].x, torch.arange(4.0) + 1)
    assert torch.equal(result["point"].y[0], torch.full((4, 2), 2.0)) and result["point"].y[1] == "tag"
    assert result["batch"].name == "batch" and torch.equal(result["batch"].labels, torch.arange(4) + 1)
    # a non-init dataclass field is mapped too (not recomputed from the new values by __post_init__)
    assert torch.equal(result["frozen"].values, torch.ones(4)) and torch.equal(
        result["frozen"].doubled, torch.ones(4)
    )
    assert result["count"] == 7
    assert torch.equal(data["point"].x, torch.arange(4.0))  # the input is untouched


def test_recursively_apply_keeps_mapping_subclasses():
    counts = defaultdict(list, {"a": torch.ones(1)})
    result = recursively_apply(lambda t: t * 3, counts)
    assert type(result) is defaultdict and result.default_factory is list and result["missing"] == []
    ordered = recursively_apply(lambda t: t, OrderedDict(b=torch.ones(1), a=torch.zeros(1)))
    assert type(ordered) is OrderedDict and list(ordered) == ["b", "a"]


def test_recursively_apply_errors_and_test_type():
    with pytest.raises(TypeError, match="got a str"):
        recursively_apply(lambda t: t, [torch.ones(1), "x"], error_on_other_type=True)
    # containers are walked before test_type is asked (the Accelerator relies on this to list leaves)
    seen = []
    recursively_apply(lambda leaf: seen.append(leaf), {"a": [1, torch.ones(1)]}, test_type=lambda _: True)
    assert seen[0] == 1 and torch.equal(seen[1], torch.ones(1))


def test_send_to_device_moves_tensors_and_movables():
    batch = {k: v for k, v in nested().items() if k != "frozen"}  # its __post_init__ computes: slow on meta
    data = {"batch": batch, "movable": Movable(), "skip": torch.ones(1), "nested": {"skip": torch.ones(1)}}
    moved = send_to_device(data, "meta", skip_keys="skip")
    assert moved["batch"]["point"].x.device.type == "meta" and moved["batch"]["batch"].labels.is_meta
    assert moved["batch"]["point"].y[1] == "tag" and moved["batch"]["count"] == 7
    assert moved["movable"].device.type == "meta"
    assert moved["skip"].device.type == "cpu" and moved["nested"]["skip"].device.type == "cpu"
    assert send_to_device(data, "meta", skip_keys=["movable"])["movable"].device.type == "cpu"
    assert data["batch"]["point"].x.device.type == "cpu"


def test_find_batch_size_and_slice_tensors():
    assert find_batch_size({"n": 3, "scalar": torch.tensor(1.0), "batch": nested()}) == 4
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        find_batch_size({"n": 3, "scalar": torch.tensor(1.0)})
    sliced = slice_tensors(nested(), slice(1, 3))
    assert torch.equal(sliced["point"].x, torch.tensor([1.0, 2.0])) and sliced["point"].y[1] == "tag"
    assert sliced["batch"].inputs.shape == (2, 3) and sliced["count"] == 7


def test_concatenate_nested_structures():
    parts = [
        {"p": Point(torch.zeros(2, 3), [torch.zeros(2)]), "b": Batch(torch.zeros(2, 1), torch.zeros(2))},
        {"p": Point(torch.ones(1, 3), [torch.ones(1)]), "b": Batch(torch.ones(1, 1), torch.ones(1))},
    ]
    result = concatenate(parts)
    assert type(result["p"]) is Point and type(result["b"]) is Batch
    assert torch.equal(result["p"].x, torch.cat([torch.zeros(2, 3), torch.ones(1, 3)]))
    assert torch.equal(result["p"].y[0], torch.tensor([0.0, 0.0, 1.0]))
    assert concatenate([torch.zeros(2, 1), torch.ones(2, 2)], dim=1).shape == (2, 3)
    with pytest.raises(ValueError, match="empty"):
        concatenate([])
    with pytest.raises(ValueError, match="same structure"):
        concatenate([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    assert result["b"].name == "batch" and concatenate([1, 1]) == 1  # equal non-tensor leaves are kept
    with pytest.raises(TypeError, match=r"got str values that differ between items: \['a', 'b'\]"):
        concatenate(["a", "b"])


@pytest.mark.parametrize("pad_first", [False, True])
def test_pad_to(pad_first):
    ids = torch.tensor([[1, 2], [3, 4]])
    padded = _pad_to(ids, dim=1, size=4, pad_index=-1, pad_first=pad_first)
    fill = torch.full((2, 2), -1)
    assert torch.equal(padded, torch.cat([fill, ids] if pad_first else [ids, fill], dim=1))
    rows = _pad_to(ids, dim=-2, size=3, pad_index=9, pad_first=pad_first)
    assert torch.equal(rows[0 if pad_first else 2], torch.tensor([9, 9]))
    flags = _pad_to(torch.tensor([True]), dim=0, size=2, pad_index=0, pad_first=pad_first)
    assert flags.dtype == torch.bool and flags.tolist() == ([False, True] if pad_first else [True, False])
    scalar = torch.tensor(5)  # has no dim 0: left unchanged
    assert _pad_to(scalar, dim=0, size=3, pad_index=0, pad_first=pad_first) is scalar


# -- collectives with one process ---------------------------------------------------------------------
def test_single_process_collectives():
    data = {"x": torch.arange(6.0).reshape(2, 3), "loss": torch.tensor(2.5), "ids": torch.tensor([1, 2])}
    gathered = gather(data)
    assert torch.equal(gathered["x"], data["x"]) and gathered["loss"].shape == (1,)  # 0-d -> (num_processes,)
    mean = reduce(data)
    assert torch.equal(mean["x"], data["x"]) and mean["ids"].dtype == torch.float32  # integer mean is float
    total = reduce(data["ids"], "sum")
    assert torch.equal(total, data["ids"]) and total.dtype == torch.int64
    assert torch.equal(reduce(data["x"], "max", scale=2.0), data["x"] * 2)
    assert reduce(torch.tensor([True, False]), "sum").tolist() == [1, 0]
    assert reduce(torch.tensor([True, False]), "max").dtype == torch.bool
    assert broadcast(data) is data and pad_across_processes(data) is data
    assert gather_object(["a", "b"]) == ["a", "b"] and gather_object({"k": 1}) == [{"k": 1}]
    assert broadcast_object_list([1, "two"]) == [1, "two"]


def test_single_process_errors():
    with pytest.raises(
        ValueError, match=r"reduction='median' is unknown: choose one of 'sum', 'mean', 'max', 'min'"
    ):
        reduce(torch.ones(1), "median")
    with pytest.raises(ValueError, match="from_process=1 is out of range: there are 1 processes"):
        broadcast(torch.ones(1), from_process=1)
    with pytest.raises(ValueError, match="from_process=-1"):
        broadcast_object_list([1], from_process=-1)
    for op in (gather, reduce, broadcast, pad_across_processes):
        with pytest.raises(TypeError, match=r"got a str at name: .*torch.tensor"):
            op({"loss": torch.ones(1), "name": "x"})


# -- random -------------------------------------------------------------------------------------------
def draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def test_set_seed_is_reproducible_and_device_specific(monkeypatch):
    set_seed(123)
    first = draw()
    set_seed(123)
    assert draw() == first
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    set_seed(121, device_specific=True)  # rank 2 of 3: seeds 121 + 2
    assert draw() == first
    with pytest.raises(TypeError, match="seed=1.5 is a float"):
        set_seed(1.5)
    with pytest.raises(ValueError, match=r"seed=-1 \(plus process index 0\) is outside \[0, 2\*\*32\)"):
        set_seed(-1)


def test_set_seed_deterministic():
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        set_seed(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_rng_state_round_trip_through_a_weights_only_checkpoint(tmp_path):
    set_seed(7)
    draw()
    torch.save(get_rng_state(), tmp_path / "rng.pt")
    expected = draw()
    set_seed(99)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draw() == expected
    with pytest.raises(ValueError, match=r"unknown entries \['pyton'\]"):
        set_rng_state({"pyton": None})


# -- collectives with three processes -----------------------------------------------------------------
def test_collectives_across_three_processes(tmp_path):
    """Run in debug mode, switched on at run time (`state.debug = True`, as Accelerate's test_op_checker
    does; launched without --debug): the cross-rank agreement check (every rank raises the same error,
    the group stays usable) runs there only; by default the hang watchdog reports a mismatch
    (tests/test_hangs.py)."""
    launch_ok(WORKERS / "ops_worker.py", 3, tmp_path)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert record["debug_at_start"] is False
        assert record["passed"] == [
            "gather",
            "gather_object",
            "reduce",
            "broadcast",
            "pad_across_processes",
            "set_seed",
            "errors",
        ]
        assert record["errors"] == records[0]["errors"], "every rank raises the same error"
    errors = records[0]["errors"]
    assert errors["gather_shapes"] == (
        "gather got tensors of different shapes across processes: rank 0: (4, 3), rank 1: (5, 3), "
        "rank 2: (6, 3); pad them first with pad_across_processes(x, dim=0)."
    )
    assert "rank 0: {loss: (3, 1)}, rank 1: {loss: (3, 2)}, rank 2: {loss: (3, 3)}" in errors["reduce_shapes"]
    assert errors["reduce_shapes"].startswith("reduce got tensors of different shapes")
    assert "rank 0: (1,), rank 1: (2,), rank 2: (3,)" in errors["broadcast_shapes"]
    assert "different dtypes" in errors["gather_dtypes"]
    assert (
        "rank 0: {a: torch.float32}, rank 1: {a: torch.int64}, rank 2: {a: torch.float32}"
        in errors["gather_dtypes"]
    )
    assert "rank 1: [a], rank 2: [a, b]" in errors["reduce_structure"]
    assert "rank 0: (2,), rank 1: (2, 2), rank 2: (2, 2, 2)" in errors["pad_ndim"]
    assert "rank 1: {0: float}" in errors["gather_one_rank_not_tensor"]
    assert (
        "different collectives at the same time: rank 0: gather, rank 1: reduce, rank 2: reduce"
        in (errors["different_ops"])
    )
    assert "gather_object" in errors["gather_not_tensor"]
    assert "median" in errors["reduce_unknown"] and "from_process=3" in errors["broadcast_from_out_of_range"]


def test_only_a_backend_without_gather_into_tensor_switches_collectives():
    """The fallback to all_gather is taken only on an error every rank meets alike (the backend lacks
    the collective); an out-of-memory error or a communication failure on one rank propagates, since
    switching there alone would leave its peers waiting in the other collective."""
    from unison.ops import backend_lacks_gather_into_tensor

    assert backend_lacks_gather_into_tensor(
        RuntimeError("no support for _allgather_base in Gloo process group")
    )
    assert backend_lacks_gather_into_tensor(NotImplementedError("all_gather_into_tensor"))
    assert not backend_lacks_gather_into_tensor(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")
    )
    assert not backend_lacks_gather_into_tensor(torch.distributed.DistError("Connection closed by peer"))
    assert not backend_lacks_gather_into_tensor(RuntimeError("CUDA error: an illegal memory access"))


def test_a_transformers_model_output_is_rebuilt_item_by_item():
    """transformers' ModelOutput refuses update(); converting a bf16 model's outputs without a loss (every
    forward without labels under mixed_precision="bf16") used it and failed."""
    outputs = pytest.importorskip("transformers.modeling_outputs")
    output = outputs.MoeCausalLMOutputWithPast(
        logits=torch.ones(2, dtype=torch.bfloat16), aux_loss=torch.tensor(1.0, dtype=torch.bfloat16)
    )
    converted = recursively_apply(lambda t: t.float(), output)
    assert type(converted) is type(output) and output.logits.dtype == torch.bfloat16
    assert converted.logits.dtype == converted["aux_loss"].dtype == torch.float32
