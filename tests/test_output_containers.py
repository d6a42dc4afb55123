"""Outputs in containers torch's traversal does not walk (unison.parallel.outputs) under ZeRO-2/3 and DDP.

One launch of tests/workers/output_containers_worker.py on 2 processes (gloo, CPU): five container kinds
under five layouts, each trained against a one-process reference, then the refusal of an object with
__slots__. Without the hooks, ZeRO-3 failed in backward (namespaces, objects), ZeRO-2 and DDP with
static_graph trained to wrong parameters without a word (0.23 and 0.17 away after 3 steps), and DDP with
find_unused_parameters failed ("Expected to mark a variable ready only once"). The walk itself is tested
in-process.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import types

import pytest
import torch
from launching import WORKERS, launch_ok

from unison.parallel.outputs import convert, rebuild

NPROC = 2
KINDS = ("namespace", "object", "dataclass", "frozen_dataclass", "nested")
LAYOUTS = ("zero3", "zero2", "ddp_find_unused", "ddp_static_graph", "ddp")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("output_containers")
    launch_ok(WORKERS / "output_containers_worker.py", NPROC, out, timeout=120)
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(NPROC)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_containers_train_as_one_process_and_come_back(reports, layout):
    for rank, report in enumerate(reports):
        for kind in KINDS:
            run = report["runs"][f"{layout}/{kind}"]
            where = (rank, layout, kind, run)
            assert run["keys_match"], where
            assert run["loss_gap"] < 1e-6, where
            assert run["parameter_gap"] < 1e-6, where
            assert run["evaluation_gap"] < 1e-6, where  # under torch.no_grad()
            assert run["types_kept"] and run["evaluation_types_kept"], where
            assert run.get("unwrapped_types_kept", True), where


@pytest.mark.parametrize("layout", ["zero3", "ddp_find_unused"])
def test_an_object_with_slots_is_refused_on_every_process(reports, layout):
    for report in reports:  # both ranks raised (and neither waited for the other: the launch finished)
        message = report["refusals"][layout]
        assert "Slotted" in message and "__slots__" in message, message
        assert "hidden, logits" in message, message
        assert "tuple, dict, dataclass or NamedTuple" in message, message
    # the unit that returned it: a ZeRO-3 block (its own class name, not FSDP's), DDP's whole model
    assert reports[0]["refusals"]["zero3"].startswith("Block.forward returned"), reports[0]["refusals"]
    assert reports[0]["refusals"]["ddp_find_unused"].startswith("Model.forward returned")


@dataclasses.dataclass(frozen=True, slots=True)
class _FrozenSlotted:
    value: torch.Tensor


def test_walk_converts_only_what_the_engines_miss_and_rebuilds_it():
    leaf = torch.ones(2, requires_grad=True)
    y = leaf * 2
    # untouched, the same object back: tensors, tuples, dicts, NamedTuples, constants, tensors without grad
    pair = collections.namedtuple("pair", "a b")(y, 1)
    for output in (y, (y, [y]), {"a": y}, pair, types.SimpleNamespace(x=torch.ones(2)), None):
        assert convert(output) is output
    namespace = types.SimpleNamespace(y=y, note="n", inner=_FrozenSlotted(y))
    output = {"out": namespace, "t": (y, namespace)}
    converted = convert(output)
    assert converted is not output and type(converted["out"]) is list  # what the engines walk
    back = rebuild(converted)
    assert type(back) is dict and type(back["t"]) is tuple
    for ns in (back["out"], back["t"][1]):
        assert type(ns) is types.SimpleNamespace and ns is not namespace  # a copy: the user's is untouched
        assert ns.y is y and ns.note == "n" and type(ns.inner) is _FrozenSlotted and ns.inner.value is y
    with torch.no_grad():
        assert convert(output) is output  # evaluation: nothing to do


def test_walk_leaves_cycles_and_modules_alone():
    y = torch.ones(2, requires_grad=True) * 2
    namespace = types.SimpleNamespace(y=y, module=torch.nn.Linear(2, 2))
    namespace.me = namespace
    back = rebuild(convert(namespace))
    assert back.y is y and back.module is namespace.module and back.me is namespace
