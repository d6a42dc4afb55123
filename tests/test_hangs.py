"""Hangs end with a diagnosis, not a timeout in silence (issue 13, section 1).

Each test launches real processes (gloo on CPU) into a hang of the kind users meet and checks what the
watchdog (src/unison/health/watchdog.py) reports: which rank waits in which collective, with its shapes and
the line of the script, where the others are, every rank's Python stacks, and an end with exit code 1.
"""

from __future__ import annotations

import re
import time

import pytest
from launching import WORKERS, describe, launch, process_running

WORKER = WORKERS / "hang_worker.py"

# every test here asserts how soon a hang is reported: run alone, after the parallel part (scripts/test.sh)
pytestmark = pytest.mark.serial


def line_of(code: str) -> int:
    """The line number of the worker's line that contains `code` (so the tests survive edits above it)."""
    return next(n for n, line in enumerate(WORKER.read_text().splitlines(), 1) if code in line)


def summary_of(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_a_rank_stuck_in_its_data_loading_is_found_at_the_stall_timeout():
    """Rank 1's DataLoader worker never returns; rank 0 waits in accelerator.reduce. At the 4 s stall
    timeout rank 0 reports, naming its collective and rank 1's line, and every rank dumps its stacks,
    rank 1's data-loader worker included (there the stuck __getitem__ shows)."""
    result = launch(WORKER, 2, "stuck-loader", launch_args=["--timeout", "4"], timeout=120)
    assert result.returncode == 1, describe(result)
    report = result.stderr
    assert "[rank0]: [unison] hang: rank 0 waited 4 s in a collective (the stall timeout)" in report, (
        describe(result)
    )
    assert "ranks [0] wait in collectives, ranks [1] never arrived" in report
    assert (
        "[rank0]:   rank 0: in all_reduce #" in report
        and "of tensor=float32[1] (through CollectiveMethods.reduce), called at "
        f"tests/workers/hang_worker.py:{line_of('return accelerator.reduce')} in step_metric"
        in report
    ), describe(result)
    loop = line_of("for batch in loader")
    assert (
        f"[rank0]:   rank 1: is not in a collective: at tests/workers/hang_worker.py:{loop} in <module>, "
        in (report)
    )
    assert "inside dataloader.py:" in report
    assert "[rank1]: [unison] Python stacks of rank 1 (at the stall reported by rank 0):" in report
    assert f'hang_worker.py", line {line_of("sleep(3600)  # a stuck read")} in __getitem__' in report, (
        "the loader worker's stack is dumped"
    )
    # and every rank's loader workers end with it (rank 1's, stuck, outlived it, reparented to init)
    listed = re.findall(
        r"\[rank(\d)\]: \[unison\] \(stacks of its data-loader worker processes \[([\d, ]+)\]", report
    )
    loader_workers = {int(pid): rank for rank, pids in listed for pid in pids.split(",")}
    assert sorted(set(loader_workers.values())) == ["0", "1"], listed
    assert not [pid for pid in loader_workers if process_running(pid)], loader_workers
    assert summary_of(result).startswith("unison launch: rank 0 (local rank 0, pid "), describe(result)
    assert "failed first: hang: rank 0 waited 4 s" in summary_of(result)
    assert "must not happen" not in result.stdout


def test_ranks_that_call_different_collectives_are_reported_within_seconds():
    """Rank 1 catches an exception and skips the reduce its peer is in, going on to a gather. The timeout
    is the default (900 s before the first step); the divergence is reported within seconds, naming each
    rank's collective, sequence number, shapes and line."""
    result = launch(WORKER, 2, "diverge", timeout=120)
    ended = time.time()
    assert result.returncode == 1, describe(result)
    skipped_at = float(result.stdout.split("[rank1]: skipping at ")[1].split()[0])
    assert ended - skipped_at < 30, f"reported {ended - skipped_at:.0f} s after the divergence"
    report = result.stderr
    assert "ranks called different collectives" in report, describe(result)
    assert "rank 0: in all_reduce #3 of tensor=float32[1] (through CollectiveMethods.reduce)" in report
    assert (
        "rank 1: in all_gather_single #3 of output_tensor=float32[4, 3], input_tensor=float32[2, 3]" in report
    )
    assert f"called at tests/workers/hang_worker.py:{line_of('accelerator.gather(')} in <module>" in report
    assert "ranks called different collectives" in summary_of(result)


def test_a_named_barrier_reports_the_rank_that_never_arrived():
    result = launch(WORKER, 3, "barrier", launch_args=["--timeout", "4"], timeout=120)
    assert result.returncode == 1, describe(result)
    report = result.stderr
    assert "ranks [0, 2] wait in collectives, ranks [1] never arrived" in report, describe(result)
    assert "ranks 0, 2: in barrier #1 (through Accelerator.wait_for_everyone('after-eval'))" in report
    assert (
        f"rank 1: is not in a collective: at tests/workers/hang_worker.py:{line_of('sleep(3600)  # e.g.')}"
        in report
    )


def test_a_rank_missing_from_ddps_all_reduce_in_backward_is_found_at_the_stall_timeout():
    """DDP issues its gradient all-reduce from C++ inside backward, under no Python frame of
    torch.distributed. Rank 0 waits there while rank 1 never reaches its backward: reported at the 4 s stall
    timeout like any collective (before, the process group's timeout ended it 60 s later, and the report
    said rank 0 "never arrived")."""
    launch_args = ["--timeout", "4", "--gradient-accumulation-steps", "2"]
    result = launch(WORKER, 2, "ddp-backward", launch_args=launch_args, timeout=120)
    assert result.returncode == 1, describe(result)
    report = result.stderr
    assert "[rank0]: [unison] hang: rank 0 waited 4 s in a collective (the stall timeout)" in report, (
        describe(result)
    )
    assert "ranks [0] wait in collectives, ranks [1] never arrived" in report, describe(result)
    backward = line_of("accelerator.backward(model(")
    assert (
        "[rank0]:   rank 0: in DDP's gradient all-reduce #" in report
        and f"called at tests/workers/hang_worker.py:{backward} in <module>" in report
    ), describe(result)
    assert (
        f"rank 1: is not in a collective: at tests/workers/hang_worker.py:{line_of('sleep(3600)  # a rank')}"
        in report
    ), describe(result)


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_collectives_of_different_shapes(debug):
    """All-reduces of 1 and 2 elements: by default the watchdog reports them (same collective and sequence
    number, other shapes); with --debug torch checks every collective first, every rank raises at once, and
    the first to fail lists every rank's call and line."""
    result = launch(WORKER, 2, "mismatch", launch_args=["--debug"] if debug else [], timeout=120)
    assert result.returncode == 1, describe(result)
    if debug:
        assert "Detected mismatch between collectives on ranks" in summary_of(result), describe(result)
        assert "ranks called different collectives" not in result.stderr
        line = line_of("dist.all_reduce(torch.ones(rank + 1))")
        for rank, shape in ((0, 1), (1, 2)):  # each rank's call and line, printed once by the first rank
            assert f"  rank {rank}: in all_reduce #0 of tensor=float32[{shape}], called at " in result.stderr
        assert result.stderr.count("Each rank's call:") == 1, describe(result)
        assert f"tests/workers/hang_worker.py:{line} in <module>" in result.stderr
    else:
        assert "rank 0: in all_reduce #1 of tensor=float32[1]" in result.stderr, describe(result)
        assert "rank 1: in all_reduce #1 of tensor=float32[2]" in result.stderr
