"""The hang watchdog's reasoning, on positions built by hand and on a real traceback (no processes).

The end-to-end behaviour (real ranks hanging, reports, stack dumps) is tested in tests/test_hangs.py;
these check the rules that decide what is a divergence and how a report reads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from slowness import budget

from unison.health.position import DDP_ALL_REDUCE, Position, traceback_position
from unison.health.watchdog import DIVERGENCE_CHECK_SECONDS, diagnosis, diverged


def in_collective(
    op="all_reduce", seq=3, shapes=("tensor=float32[4]",), group=(), line="train.py:40 in main"
):
    return Position("collective", line, "distributed_c10d.py:1 in wait", op, shapes, group, seq)


LONG = DIVERGENCE_CHECK_SECONDS


def test_the_same_call_on_every_rank_is_not_a_divergence():
    assert diverged({0: (in_collective(), LONG), 1: (in_collective(line="other.py:1 in f"), LONG)}) == []


@pytest.mark.parametrize(
    "other",
    [in_collective(shapes=("tensor=float32[2]",)), in_collective(op="all_gather_single")],
    ids=["shapes", "operation"],
)
def test_the_same_sequence_number_with_another_call_is_a_divergence_at_once(other):
    assert diverged({0: (in_collective(), 0.0), 1: (other, 0.0)}) == [(0, 1)]


def test_collectives_whose_shapes_may_differ_by_rank_are_compared_by_operation_only():
    """all_to_all_single with uneven splits (mixture-of-experts routing), scatter's list on its source."""
    uneven = in_collective(op="all_to_all_single", shapes=("output=float32[3, 8]", "input=float32[5, 8]"))
    other = in_collective(op="all_to_all_single", shapes=("output=float32[5, 8]", "input=float32[3, 8]"))
    assert diverged({0: (uneven, LONG), 1: (other, LONG)}) == []
    assert diverged({0: (uneven, LONG), 1: (in_collective(), LONG)}) == [(0, 1)]  # another operation


def test_other_sequence_numbers_are_a_divergence_only_once_both_ranks_waited_long():
    behind = in_collective(seq=2)
    assert diverged({0: (in_collective(), LONG), 1: (behind, LONG)}) == [(0, 1)]
    assert diverged({0: (in_collective(), LONG), 1: (behind, 0.5)}) == []  # it may be about to move on


def test_ranks_of_other_groups_point_to_point_and_computing_ranks_are_not_compared():
    running = Position("running", "train.py:30 in main", "train.py:30 in main")
    other_group = in_collective(op="broadcast", group=(2, 3))
    send, recv = in_collective(op="send"), in_collective(op="recv")
    positions = {0: (in_collective(), LONG), 1: (running, LONG), 2: (other_group, LONG), 3: None}
    assert diverged(positions) == []
    assert diverged({0: (send, LONG), 1: (recv, LONG)}) == []


def test_ranks_in_ddps_all_reduce_are_not_compared_by_sequence_number():
    """A rank still computing gradients between DDP's buckets has issued fewer all-reduces than one that
    waits for its last: other sequence numbers there are no divergence (a stall there is reported at the
    stall timeout)."""
    waiting, computing = (
        in_collective(op=DDP_ALL_REDUCE, seq=9, shapes=()),
        in_collective(op=DDP_ALL_REDUCE, seq=7, shapes=()),
    )
    assert diverged({0: (waiting, LONG), 1: (computing, LONG)}) == []
    assert diverged({0: (waiting, LONG), 1: (in_collective(seq=9), LONG)}) == []


def test_a_backward_is_in_ddps_all_reduce_once_its_group_issued_collectives_after_the_armed_forward():
    """health.position.note_gradient_sync (called after each forward of a prepared DDP model): a backward
    whose group has issued collectives since is DDP's all-reduce; one that has not, or one whose forward did
    not arm the all-reduce (no_sync), is computing. Checked on the traceback of an error raised inside
    backward, in a one-process gloo group (a subprocess: the group is not left in this one)."""
    script = textwrap.dedent(
        """
        import os
        import torch, torch.distributed as dist
        from unison.health import position

        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")

        def where_backward_raises():
            x = torch.ones(2, requires_grad=True)
            y = x * 2
            y.register_hook(lambda grad: 1 / 0)
            try:
                y.sum().backward()
            except ZeroDivisionError as error:
                found = position.traceback_position(error.__traceback__)
                return found.kind, found.op, found.seq

        group = dist.group.WORLD
        position.note_gradient_sync(group, True)
        print(where_backward_raises())  # nothing issued since the forward: computing
        dist.all_reduce(torch.ones(1))  # what DDP issues from C++ as its buckets fill
        print(where_backward_raises())
        position.note_gradient_sync(group, False)  # a forward under no_sync
        print(where_backward_raises(), flush=True)
        dist.destroy_process_group()
        # gloo's teardown at interpreter exit can abort ("terminate called without an active exception", once
        # in a busy suite run): torch's race, not what this test checks, so the interpreter is not torn down
        os._exit(0)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=budget(120)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "('running', '', None)",
        f"('collective', {DDP_ALL_REDUCE!r}, 1)",
        "('running', '', None)",
    ], result.stdout


def test_a_stall_report_names_who_waits_where_who_never_arrived_and_who_did_not_answer():
    running = Position("running", "data.py:12 in load", "dataloader.py:725 in __next__")
    text = diagnosis("stall", 0, 15.2, {0: (in_collective(), 15.2), 1: (running, 15.0), 2: None})
    lines = text.splitlines()
    assert lines[0].startswith("hang: rank 0 waited 15 s in a collective (the stall timeout); ranks [0] wait")
    assert "ranks [1] never arrived, ranks [2] did not answer." in lines[0]
    assert "raise the timeout (Accelerator(timeout=), --timeout, UNISON_TIMEOUT)" in lines[0]
    assert (
        lines[1]
        == "  rank 0: in all_reduce #3 of tensor=float32[4], called at train.py:40 in main (for 15 s)"
    )
    assert (
        lines[2]
        == "  rank 1: is not in a collective: at data.py:12 in load, inside dataloader.py:725 in __next__"
    )
    assert lines[3].startswith("  rank 2: did not answer")


def test_ranks_in_the_same_place_share_a_line():
    text = diagnosis("divergence", 1, 5, {r: (in_collective(), 5.0) for r in range(3)})
    assert text.startswith("ranks called different collectives (reported by rank 1, after 5 s)")
    assert "  ranks 0, 1, 2: in all_reduce #3" in text


def test_a_collective_is_recognised_from_a_traceback_with_its_shapes_and_the_callers_line():
    assert not dist.is_initialized()
    try:
        dist.all_reduce(torch.zeros(2, 3, dtype=torch.bfloat16))  # raises inside torch.distributed
    except ValueError as error:
        where = traceback_position(error.__traceback__)
    assert where.kind == "collective" and where.op == "all_reduce", where
    assert where.shapes == ("tensor=bfloat16[2, 3]",)
    assert where.call_site.startswith("tests/test_watchdog.py:") and where.call_site.endswith(
        "in test_a_collective_is_recognised_from_a_traceback_with_its_shapes_and_the_callers_line"
    )
    assert Position.from_json(where.to_json()) == where  # as it travels between ranks through the store
