"""PartialState / AcceleratorState: a real gloo group under `unison launch`, and single-process rules."""

import json
import pickle
from datetime import timedelta

import numpy as np
import pytest
import torch
from launching import launch_ok

from unison import Accelerator, InitProcessGroupKwargs, env_vars
from unison.state import BACKSTOP_SECONDS, AcceleratorState, DistributedType, PartialState, split_for_process

WORKER = "tests/workers/state_worker.py"


def reference_split(items: list, num_processes: int, process_index: int, padding: bool) -> list:
    """np.array_split gives the first len % n parts one extra item: the rule split_between_processes keeps."""
    share = [items[int(i)] for i in np.array_split(np.arange(len(items)), num_processes)[process_index]]
    if padding:
        longest = -(-len(items) // num_processes)
        share += [share[-1] if share else items[-1]] * (longest - len(share))
    return share


@pytest.fixture(scope="module", params=[2, 3], ids=["2proc", "3proc"])
def launched(request, tmp_path_factory):
    """One launch per world size: 2 processes pass PartialState(timeout=33), 3 get UNISON_TIMEOUT=42."""
    nproc = request.param
    out = tmp_path_factory.mktemp(f"state{nproc}")
    if nproc == 2:  # the explicit argument must win over the launch flag
        result = launch_ok(WORKER, nproc, out, "--explicit-timeout", "33", launch_args=["--timeout", "42"])
        expected_timeout = 33.0
    else:
        result = launch_ok(WORKER, nproc, out, env={env_vars.TIMEOUT: "42"})
        expected_timeout = 42.0
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]
    return nproc, records, result, expected_timeout


def test_a_process_group_the_script_formed_is_adopted_with_its_own_timeout(tmp_path):
    """unison cannot change the timeout of a group formed before it: asking for one is an error on
    every rank (not a value silently ignored), and the adopted state says it has none of its own."""
    launch_ok("tests/workers/adopt_group_worker.py", 2, tmp_path)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        explicit = record["explicit_timeout"]
        assert explicit.startswith("ValueError: timeout=30 s cannot apply"), explicit
        assert "init_process_group" in explicit, explicit
        assert record["state_timeout"] is None and record["all_reduce"] == 3.0
        assert record["later_timeout"].startswith("ValueError: timeout=77 cannot apply"), record


def test_real_gloo_group_and_identity(launched):
    nproc, records, _, _ = launched
    for rank, rec in enumerate(records):
        assert rec["dist_initialized"] and rec["backend"] == "gloo"
        assert rec["dist_world_size"] == rec["num_processes"] == rec["env_world_size"] == nproc
        assert rec["dist_rank"] == rec["process_index"] == rec["env_rank"] == rank
        assert rec["local_process_index"] == rec["env_local_rank"] == rank  # one node
        assert rec["is_main_process"] is (rank == 0)
        assert rec["is_local_main_process"] is (rank == 0)
        assert rec["device"] == "cpu"
        assert rec["distributed_type"] == DistributedType.MULTI_CPU.value
        assert rec["all_reduce_rank_plus_one"] == nproc * (nproc + 1) / 2


def test_timeout_reaches_the_process_group(launched):
    """The given timeout is the watchdog's stall timeout; the group's own is longer by the backstop, so
    the watchdog reports a stall before torch's timeout ends the collective (docs/failures.md)."""
    _, records, _, expected = launched
    for rec in records:
        assert rec["state_timeout_s"] == expected
        assert rec["group_timeout_s"] == expected + BACKSTOP_SECONDS


def test_barrier_and_ordering(launched):
    _, records, _, _ = launched
    main = records[0]
    for rec in records[1:]:
        # rank 0 arrived at the barrier 0.5 s late: nobody may have left before it arrived
        assert rec["barrier"]["left"] >= main["barrier"]["arrived"]
        for block in ("main_process_first", "local_main_process_first"):
            # the main process sleeps 0.5 s in the block; the others start only after it has finished
            assert rec[block]["start"] >= main[block]["end"], block
    for block in ("main_process_first", "local_main_process_first"):
        assert main[block]["end"] - main[block]["start"] >= 0.45


def test_split_between_processes(launched):
    nproc, records, _, _ = launched
    for rank, rec in enumerate(records):
        splits = rec["splits"]
        for n_items in (7, 2):
            items = list(range(10, 10 + n_items))
            for padding in (False, True):
                key = f"{n_items}_{'pad' if padding else 'nopad'}"
                expected = reference_split(items, nproc, rank, padding)
                assert splits[f"list_{key}"] == expected, (rank, key)
                assert splits[f"tuple_{key}"] == {"type": "tuple", "items": expected}, (rank, key)
                assert splits[f"tensor_{key}"] == {"type": "Tensor", "rows": [[i, i] for i in expected]}
                assert splits[f"dict_{key}"] == {"a": expected, "b": [[i, i] for i in expected]}
    # the shares without padding cover the input exactly once, in order
    covered = [i for rec in records for i in rec["splits"]["list_7_nopad"]]
    assert covered == list(range(10, 17))


def test_main_process_only_helpers(launched):
    nproc, records, result, _ = launched
    assert records[0]["on_main_process"] == {"returned": 42, "calls": [21]}
    for rec in records[1:]:
        assert rec["on_main_process"] == {"returned": None, "calls": []}
    printed = [line for line in result.stdout.splitlines() if "PRINTED-BY-STATE" in line]
    assert printed == ["[rank0]: PRINTED-BY-STATE from rank 0"]


def test_conflicting_second_state_fails_on_every_rank(launched):
    _, records, _, _ = launched
    for rec in records:
        errors = rec["conflict_errors"]
        assert "cpu=False conflicts" in errors["cpu"]
        assert "timeout=" in errors["timeout"] and "conflicts" in errors["timeout"]
        assert "'fp16' conflicts" in errors["mixed_precision"] and "'bf16'" in errors["mixed_precision"]
        assert rec["same_settings_ok"]


def test_clean_shutdown_without_warnings(launched):
    _, _, result, _ = launched
    lowered = result.stderr.lower()
    for complaint in ("warn", "destroy_process_group", "terminate called", "leak"):
        assert complaint not in lowered, result.stderr


# -- single process ------------------------------------------------------------------------------


def test_single_process_state(fresh_state):
    state = PartialState(cpu=True)
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.is_main_process and state.is_local_main_process
    assert state.distributed_type == DistributedType.NO and state.device == torch.device("cpu")
    assert not torch.distributed.is_initialized()
    state.wait_for_everyone()  # a no-op, must not need a group
    with state.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]
    assert state.timeout == timedelta(seconds=300)  # the stall timeout after the first step (900 s before)


@pytest.mark.parametrize("source", ["argument", "env"])
def test_timeout_sources(fresh_state, monkeypatch, source):
    if source == "env":
        monkeypatch.setenv(env_vars.TIMEOUT, "12.5")
        state = PartialState(cpu=True)
    else:
        monkeypatch.setenv(env_vars.TIMEOUT, "99")  # the argument wins over the variable
        state = PartialState(cpu=True, timeout=timedelta(seconds=12.5))
    assert state.timeout == timedelta(seconds=12.5)
    with pytest.raises(ValueError, match="conflicts"):
        PartialState(timeout=13)
    PartialState(timeout=12.5)  # the same value again is fine


@pytest.mark.parametrize(
    "timeout, env, match",
    [(0, None, "timeout=0"), (-5, None, "timeout=-5"), (None, "soon", "UNISON_TIMEOUT='soon'")],
)
def test_bad_timeouts(fresh_state, monkeypatch, timeout, env, match):
    if env is not None:
        monkeypatch.setenv(env_vars.TIMEOUT, env)
    with pytest.raises(ValueError, match=match):
        PartialState(cpu=True, timeout=timeout)


@pytest.mark.parametrize(
    "timeout, error, match",
    [
        ("10", TypeError, "timeout='10' is a str: pass the collectives' timeout as a number of seconds"),
        (True, TypeError, "timeout=True is a bool"),
        (float("inf"), ValueError, "timeout=inf seconds is not allowed: collectives need a finite"),
        (float("nan"), ValueError, "timeout=nan seconds"),
    ],
)
def test_timeouts_that_are_no_number_of_seconds(fresh_state, timeout, error, match):
    with pytest.raises(error, match=match):
        Accelerator(cpu=True, timeout=timeout)


def test_bad_launch_variables(fresh_state, monkeypatch):
    monkeypatch.setenv(env_vars.CPU, "maybe")
    with pytest.raises(ValueError, match="UNISON_CPU='maybe'"):
        PartialState()
    monkeypatch.setenv(env_vars.CPU, "1")
    monkeypatch.setenv(env_vars.MIXED_PRECISION, "fp8")
    with pytest.raises(ValueError, match="'fp8' is unknown"):
        AcceleratorState()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("length", [0, 1, 5, 8, 9])
def test_split_for_process_matches_reference(n, length):
    items = list(range(length))
    tensor = torch.arange(length)
    for rank in range(n):
        assert split_for_process(items, n, rank) == reference_split(items, n, rank, False)
        assert split_for_process(tensor, n, rank).tolist() == reference_split(items, n, rank, False)
        if length:
            padded = reference_split(items, n, rank, True)
            assert split_for_process(items, n, rank, apply_padding=True) == padded
            assert split_for_process(tensor, n, rank, apply_padding=True).tolist() == padded


def test_split_for_process_bad_inputs():
    with pytest.raises(ValueError, match=r"different lengths \[2, 3\]"):
        split_for_process({"a": [1, 2], "b": [1, 2, 3]}, 2, 0)
    with pytest.raises(TypeError, match="cannot split a set"):
        split_for_process({1, 2, 3}, 2, 0)


@pytest.mark.usefixtures("fresh_state")
def test_process_group_options_that_cannot_apply_are_refused():
    """Accelerate's InitProcessGroupKwargs: the backend follows the device and the group forms from the
    launcher's environment, so another backend or an init_method is refused, naming the fix."""
    with pytest.raises(ValueError, match=r"backend='nccl'\): this run's process group uses 'gloo'"):
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="nccl")])
    with pytest.raises(ValueError, match=r"init_method='tcp://10.0.0.1:23456'.*--master-addr"):
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(init_method="tcp://10.0.0.1:23456")])
    accepted = [InitProcessGroupKwargs(backend="gloo", init_method="env://")]
    assert Accelerator(cpu=True, kwargs_handlers=accepted).state.backend == "gloo"


@pytest.mark.usefixtures("fresh_state")
def test_a_reset_state_says_what_happened_when_the_accelerator_uses_it():
    accelerator = Accelerator(cpu=True)
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError, match=r"no attribute `device`: the shared state is empty\. This"):
        accelerator.prepare(torch.nn.Linear(1, 1))


@pytest.mark.parametrize("variable", [None, env_vars.DEBUG, "ACCELERATE_DEBUG_MODE"])
def test_debug_starts_from_the_environment_and_is_switched_at_run_time(fresh_state, monkeypatch, variable):
    """`state.debug` is the switch the ops read (Accelerate's PartialState.debug): the launch flag or
    variable gives its first value, a script may set it later, through either state object."""
    monkeypatch.delenv("ACCELERATE_DEBUG_MODE", raising=False)
    if variable is not None:
        monkeypatch.setenv(variable, "1")
    accelerator = Accelerator(cpu=True)
    assert PartialState().debug is (variable is not None)
    accelerator.state.debug = False
    assert PartialState().debug is False and AcceleratorState().debug is False
    PartialState().debug = True
    assert accelerator.state.debug is True


def test_destroy_process_group_works_after_the_state_was_reset(fresh_state):
    """As Accelerate's test scripts end: the state object kept, the shared state reset, then the group
    ended through it (here a one-process gloo group the script formed, which the state adopts)."""
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    try:
        state = Accelerator(cpu=True).state
        AcceleratorState._reset_state()
        state.destroy_process_group()
        assert not torch.distributed.is_initialized()
        AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate's argument: both states go
        assert not PartialState._shared_state
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_the_state_describes_itself_as_accelerates_does(fresh_state):
    """transformers' *_no_trainer scripts log `accelerator.state`: Accelerate's lines, not an address."""
    accelerator = Accelerator(cpu=True)
    text = str(accelerator.state)
    assert text == repr(PartialState()) + "\nMixed precision type: no\n"
    assert "Num processes: 1\nProcess index: 0\n" in text and "Device: cpu" in text
    AcceleratorState._reset_state()
    assert "empty" in repr(accelerator.state)


def test_an_accelerator_pickled_and_loaded_back_has_the_same_state(fresh_state):
    """Accelerate's test_pickle_accelerator: a copy made by pickle (as a DataLoader worker or a
    multiprocessing queue gets one) holds the same state. It held another PartialState object, which
    compared by identity, so the copy's state differed from the original's."""
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.utils.data.DataLoader(list(range(32)), batch_size=4))
    copy = pickle.loads(pickle.dumps(accelerator))
    assert copy.state.__dict__ == accelerator.state.__dict__
    assert PartialState() == copy.state.partial and PartialState() != object()


def test_destroy_process_group_ends_the_gloo_group_while_the_interpreter_is_whole(tmp_path):
    """A gloo group that outlives the script aborts it at random (docs/failures.md): once nothing of the
    script holds the group, destroy_process_group must have ended gloo's worker threads."""
    launch_ok("tests/workers/group_release_worker.py", 2, tmp_path)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["before"] > 0, record  # the thread name this test counts is still torch's
        assert record["after"] == 0, record
