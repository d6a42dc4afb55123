"""Saving and restoring a prepared loader's position: exact mid-epoch resume, on any number of processes.

In one process, other processes are simulated with prepare_data_loader's num_processes /
process_index; the launched 2-process worker (tests/workers/data_resume_worker.py) checks the same
in a real gloo group, for DataLoaderShard and DataLoaderDispatcher, through torch.save/torch.load.
"""

import json

import pytest
import torch
from launching import WORKERS, launch_ok
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

from unison.data import DataLoaderDispatcher, prepare_data_loader, skip_first_batches


class Counting(Dataset):
    """Counts reads (skipped batches must not be loaded); with workers, returns the worker's seed too."""

    def __init__(self, size):
        self.size, self.reads = size, 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.reads += 1
        info = get_worker_info()
        return torch.tensor([index, -1 if info is None else info.seed % 2**31])


def prepared(size, n, p, batch_size=3, shuffle=True, data_seed=None, seedable=False, **loader_kwargs):
    loader = DataLoader(Counting(size), batch_size=batch_size, shuffle=shuffle, **loader_kwargs)
    return prepare_data_loader(
        loader, num_processes=n, process_index=p, data_seed=data_seed, use_seedable_sampler=seedable
    )


def indices(batches):
    return [batch[:, 0].tolist() for batch in batches]


def round_order(per_process):
    """The samples of every step, each step's batches concatenated in process order (as gather does)."""
    return [i for step in zip(*per_process) for batch in step for i in batch]


# -- one process, simulated ranks -----------------------------------------------------------------------
@pytest.mark.parametrize("seedable", [False, True])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_restored_loader_yields_exactly_the_remaining_batches_unread(n, shuffle, seedable):
    full = []
    for p in range(n):  # each simulated process starts from the same global RNG, as set_seed would
        torch.manual_seed(5)
        reference = prepared(26, n, p, shuffle=shuffle, seedable=seedable)
        full.append([indices(reference), indices(reference)])  # epochs 0 and 1
    k = 2
    for p in range(n):
        torch.manual_seed(5)
        original = prepared(26, n, p, shuffle=shuffle, seedable=seedable)
        iterator = iter(original)
        assert indices(next(iterator) for _ in range(k)) == full[p][0][:k]
        saved, saved_rng = original.state_dict(), torch.get_rng_state()
        assert saved["epoch"] == 0 and saved["samples_consumed"] == k * 3 * n
        assert saved["end_of_epoch"] is False
        if seedable:
            assert saved["seed"] == (5 if shuffle else None) and saved["pass_states"] is None
        else:  # where the pass's draws began: the order is replayed from there, not drawn again
            assert saved["seed"] is None and (saved["pass_states"]["shuffle"] is not None) == shuffle

        torch.manual_seed(77)  # another global seed: the restored order must come from the state
        fresh = prepared(26, n, p, shuffle=shuffle, seedable=seedable)
        fresh.load_state_dict(saved)
        assert len(fresh) == len(full[p][0]), "len() stays the epoch's length"
        fresh.dataset.reads = 0
        remaining = indices(fresh)
        assert remaining == full[p][0][k:], f"process {p}: not the remaining batches in order"
        assert fresh.dataset.reads == sum(map(len, remaining)), "skipped batches were loaded"
        assert fresh.epoch == 1 and fresh.state_dict()["samples_consumed"] == 0
        torch.set_rng_state(saved_rng)  # as load_state restores it: the next pass draws from there
        assert indices(fresh) == full[p][1], "the epoch after the resumed one is complete"


LOADER_KINDS = ("shuffle", "shuffle+generator", "seedable", "weighted", "weighted+generator", "subset")


def loader_of(kind, seed, n=1, p=0, num_workers=0):
    """A prepared loader of `kind` over 14 samples in batches of 2 (7 per epoch on one process); `seed`
    seeds the global RNG first and every generator the user builds, as a script's set_seed would."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed) if kind.endswith("+generator") else None
    options = {"batch_size": 2, "num_workers": num_workers}
    if kind.startswith("weighted"):
        options["sampler"] = WeightedRandomSampler(torch.linspace(1, 4, 14), 14, generator=generator)
    elif kind == "subset":
        options["sampler"] = SubsetRandomSampler(range(1, 13))
    else:
        options.update(shuffle=True, generator=generator)
    return prepare_data_loader(
        DataLoader(Counting(14), **options),
        num_processes=n,
        process_index=p,
        use_seedable_sampler=kind == "seedable",
    )


def epochs_from(loader, epochs, start=None):
    """The documented loop from where `loader` stands to the end of `epochs` (or, with `start`, a loop
    that counts epochs itself and calls set_epoch from there): each epoch's batches."""
    seen = []
    for epoch in range(loader.epoch if start is None else start, epochs):
        loader.set_epoch(epoch)
        seen.append(indices(loader))
    return seen


def accelerate_style(loader, epochs, batches_done):
    """Accelerate's examples/by_feature/checkpointing.py: the first epoch and the batches to skip in it
    computed from the batches done, `skip_first_batches` in that epoch, no set_epoch anywhere."""
    first, skip = divmod(batches_done, len(loader))
    seen = []
    for epoch in range(first, epochs):
        active = skip_first_batches(loader, skip) if epoch == first else loader
        seen.append(indices(active))
    return first, seen


@pytest.mark.parametrize("kind", LOADER_KINDS)
@pytest.mark.parametrize("n", [1, 2])
def test_resume_from_every_position_of_every_epoch_draws_the_uninterrupted_order(kind, n):
    """Saved after every batch of 3 epochs (the last batch of each epoch included), the state and the
    global RNG loaded into a loader built afresh under another seed: the rest of the run is the
    uninterrupted run's, batch for batch, in the three loops users write: the documented one
    (range(loader.epoch, ...) with set_epoch), one that counts epochs itself from the saved epoch, and
    Accelerate's (the position computed from the batches done, skip_first_batches, no set_epoch)."""
    epochs, compared = 3, 0
    for p in range(n):
        whole = epochs_from(loader_of(kind, 5, n, p), epochs)
        assert whole[0] != whole[1] != whole[2], "each epoch draws a new order"
        length = len(whole[0])
        for epoch in range(epochs):
            for k in range(1, length + 1):
                original = loader_of(kind, 5, n, p)
                epochs_from(original, epoch)  # the epochs before the saved one
                iterator = iter(original)
                for _ in range(k):
                    next(iterator)
                state, rng = original.state_dict(), torch.get_rng_state()
                for loop in ("documented", "own count", "accelerate"):
                    resumed = loader_of(kind, 77, n, p)
                    resumed.load_state_dict(state)
                    torch.set_rng_state(rng)  # as load_state restores it
                    if loop == "accelerate":
                        first, seen = accelerate_style(resumed, epochs, epoch * length + k)
                        expected = [epoch_batches[k % length :] for epoch_batches in whole[first : first + 1]]
                        expected += whole[first + 1 :]
                    else:
                        seen = epochs_from(resumed, epochs, start=epoch if loop == "own count" else None)
                        expected = [whole[epoch][k:]] + whole[epoch + 1 :]
                        if loop == "documented" and k == length:  # the loader stands at the next epoch
                            expected = expected[1:]
                    assert seen == expected, (kind, n, p, epoch, k, loop)
                    compared += 1
    assert compared == 3 * n * epochs * length


def test_a_sampler_of_the_users_own_resumes_with_workers_and_leaves_the_global_rng_as_restored():
    """Samples and the worker seeds that loaded them, as the uninterrupted run had them."""
    reference = loader_of("weighted", 3, num_workers=2)
    whole = [[batch.tolist() for batch in reference] for _ in range(2)]
    original = loader_of("weighted", 3, num_workers=2)
    iterator = iter(original)
    next(iterator), next(iterator)
    state, rng = original.state_dict(), torch.get_rng_state()
    resumed = loader_of("weighted", 8, num_workers=2)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    iterator = iter(resumed)
    first = next(iterator).tolist()
    assert torch.equal(torch.get_rng_state(), rng), "the replay drew from the restored global RNG"
    assert [first, *(batch.tolist() for batch in iterator)] == whole[0][2:]
    assert [batch.tolist() for batch in resumed] == whole[1]


def test_a_state_with_other_generators_is_refused_naming_the_counts():
    state = loader_of("weighted+generator", 1).state_dict()
    with pytest.raises(ValueError, match="holds 1 generator states, but this loader draws from 0"):
        loader_of("weighted", 1).load_state_dict(state)


@pytest.mark.parametrize("seedable", [False, True])
def test_state_is_plain_and_loads_with_weights_only(tmp_path, seedable):
    loader = prepared(20, 2, 1, seedable=seedable)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    passed = state.pop("pass_states")
    assert state.pop("generators") == [] and state.pop("sampler_draws") is None, "no generator of the user's"
    assert all(value is None or type(value) in (int, bool, str) for value in state.values()), state
    assert (passed is None) == seedable
    if passed is not None:
        assert all(type(value) is torch.Tensor and value.device.type == "cpu" for value in passed.values())
    torch.save({**state, "pass_states": passed}, tmp_path / "loader.pt")
    loaded = torch.load(tmp_path / "loader.pt", weights_only=True)
    assert {key: value for key, value in loaded.items() if key != "pass_states"} == state
    if passed is not None:
        assert all(torch.equal(loaded["pass_states"][key], value) for key, value in passed.items())

    weighted = WeightedRandomSampler(torch.ones(20), 20, generator=torch.Generator().manual_seed(1))
    users = prepare_data_loader(
        DataLoader(Counting(20), batch_size=2, sampler=weighted, generator=torch.Generator().manual_seed(2)),
        num_processes=2,
        process_index=1,
        use_seedable_sampler=seedable,
    )
    next(iter(users))
    state = users.state_dict()
    torch.save(state, tmp_path / "users.pt")
    loaded = torch.load(tmp_path / "users.pt", weights_only=True)
    assert len(loaded["generators"]) == 2, "the DataLoader's generator and the sampler's"
    assert all(torch.equal(a, b) for a, b in zip(loaded["generators"], state["generators"]))
    (draws,) = loaded["sampler_draws"]
    assert torch.equal(draws["torch"], state["sampler_draws"][0]["torch"])
    assert torch.equal(draws["generator"], state["sampler_draws"][0]["generator"])


def test_position_counts_yielded_batches_not_the_one_read_ahead():
    loader = prepared(12, 2, 0, batch_size=2, shuffle=False)  # 3 steps of 4 samples
    iterator = iter(loader)
    assert loader.state_dict()["samples_consumed"] == 0
    next(iterator)  # the loader has read batch 2 ahead already
    assert loader.state_dict()["samples_consumed"] == 4
    next(iterator)
    assert loader.state_dict()["samples_consumed"] == 8
    next(iterator)
    assert loader.end_of_dataloader and loader.state_dict()["end_of_epoch"] is True
    assert next(iterator, None) is None
    assert loader.state_dict() | {"worker_seed": 0} == {
        "epoch": 1,
        "samples_consumed": 0,
        "end_of_epoch": False,
        "order": "torch",
        "seed": None,
        "pass_states": None,  # the next epoch's pass has not begun: it draws afresh
        "worker_seed": 0,
        "total_batch_size": 4,
        "sampler_draws": None,
        "generators": [],
    }


def test_saved_on_the_last_batch_resumes_at_the_next_epoch_on_any_split():
    """12 samples, global batch 6 (2 x 3): the final position 12 is no multiple of 4 x 3 but still loads."""
    reference = prepared(12, 2, 0, data_seed=1)
    epoch0, epoch1 = indices(reference), indices(reference)
    original = prepared(12, 2, 0, data_seed=1)
    for _ in original:
        state = original.state_dict()  # saved inside the loop, on the last step
    assert state["epoch"] == 0 and state["end_of_epoch"] and state["samples_consumed"] == 12
    fresh = prepared(12, 2, 0, data_seed=9)
    fresh.load_state_dict(state)
    assert fresh.epoch == 1 and fresh.state_dict()["samples_consumed"] == 0, "epoch 0 was complete"
    assert indices(fresh) == epoch1
    assert epoch0 != epoch1
    again = prepared(12, 2, 0, data_seed=9)
    again.load_state_dict(state)
    again.set_epoch(0)
    assert indices(again) == [] and again.epoch == 1, "epoch 0 named again: its empty remainder"
    assert indices(again) == epoch1
    four = [prepared(12, 4, p, data_seed=9) for p in range(4)]
    for loader in four:
        loader.load_state_dict(state)
        assert loader.epoch == 1


@pytest.mark.parametrize("n", [1, 2, 4])
def test_position_converts_across_world_sizes(n):
    """Saved with 2 processes x 3 after 4 steps (24 samples): 1 process skips 8 batches, 4 skip 2."""
    saved_run = [prepared(48, 2, p, data_seed=4) for p in range(2)]
    whole = round_order([indices(loader) for loader in saved_run])
    original = prepared(48, 2, 0, data_seed=4)
    iterator = iter(original)
    for _ in range(4):
        next(iterator)
    state = original.state_dict()
    assert state["samples_consumed"] == 24

    loaders = [prepared(48, n, p, data_seed=123) for p in range(n)]
    for loader in loaders:
        loader.load_state_dict(state)
    per_process = [indices(loader) for loader in loaders]
    assert round_order(per_process) == whole[24:], "the remaining samples in the saved run's order"
    assert all(len(batches) == 24 // (3 * n) for batches in per_process)


def test_indivisible_position_is_a_value_error_naming_both_numbers():
    original = prepared(48, 2, 0, seedable=True)
    iterator = iter(original)
    next(iterator)
    state = original.state_dict()  # 6 samples
    target = prepared(48, 4, 0, seedable=True)  # 12 per step
    before = target.state_dict()
    with pytest.raises(ValueError, match=r"samples_consumed=6.*total_batch_size=12") as error:
        target.load_state_dict(state)
    assert "saved loader's was 6" in str(error.value)
    assert target.state_dict() == before, "a refused state changes nothing"

    with pytest.raises(ValueError, match=r"lacks \['samples_consumed'"):
        target.load_state_dict({"epoch": 0})
    unshuffled = prepared(48, 4, 0, shuffle=False, seedable=True)
    with pytest.raises(ValueError, match="comes from a loader that shuffled, but this one does not"):
        unshuffled.load_state_dict(prepared(48, 4, 0, seedable=True).state_dict())
    began = prepared(48, 4, 0)
    next(iter(began))
    with pytest.raises(ValueError, match="comes from a loader that shuffled, but this one does not"):
        prepared(48, 4, 0, shuffle=False).load_state_dict(began.state_dict())
    with pytest.raises(
        ValueError, match=r"use_seedable_sampler=False, but this one has use_seedable_sampler=True"
    ):
        unshuffled.load_state_dict(began.state_dict())


def test_set_epoch_keeps_the_restored_position_only_for_its_epoch():
    reference = prepared(30, 1, 0, data_seed=2)
    epochs = [indices(reference) for _ in range(4)]
    original = prepared(30, 1, 0, data_seed=2)
    original.set_epoch(1)
    iterator = iter(original)
    next(iterator), next(iterator), next(iterator)
    state = original.state_dict()
    assert (state["epoch"], state["samples_consumed"]) == (1, 9)

    resumed = prepared(30, 1, 0, data_seed=8)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    seen = []
    for epoch in range(resumed.epoch, 4):  # the loop the docs tell users to write
        resumed.set_epoch(epoch)
        seen.append(indices(resumed))
    assert seen == [epochs[1][3:], epochs[2], epochs[3]]

    other = prepared(30, 1, 0, data_seed=8)
    other.load_state_dict(state)
    other.set_epoch(2)
    assert indices(other) == epochs[2], "another epoch starts from its beginning"
    other.set_epoch(1)
    assert indices(other) == epochs[1], "and the restored position is gone"


def test_break_keeps_the_position_for_a_save_and_a_new_pass_starts_afresh():
    loader = prepared(30, 1, 0, data_seed=2)
    for step, _ in enumerate(loader):
        if step == 4:
            break  # e.g. max_steps reached mid-epoch, then save_state
    assert loader.state_dict()["samples_consumed"] == 15 and loader.epoch == 0
    epoch0 = indices(loader)
    assert len(epoch0) == 10, "a new iter() without a restore starts the epoch from its beginning"


def test_skip_first_batches_copy_reports_the_position_through_the_original():
    loader = prepared(30, 1, 0, data_seed=2)
    whole = indices(loader)
    loader.set_epoch(0)
    resumed = skip_first_batches(loader, 4)
    iterator = iter(resumed)
    assert next(iterator)[:, 0].tolist() == whole[4]
    assert loader.state_dict()["samples_consumed"] == 15, "4 skipped + 1 handed out, 3 samples each"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_seedable_iterating_never_touches_the_global_rng_and_worker_seeds_follow_seed_and_epoch(num_workers):
    torch.manual_seed(3)
    loader = prepared(12, 1, 0, data_seed=6, num_workers=num_workers)
    before = torch.get_rng_state()
    epoch0 = [batch.tolist() for batch in loader]
    iter(loader)
    assert torch.equal(torch.get_rng_state(), before), "a prepared loader drew from the global RNG"
    assert loader.generator is not None and loader.generator.initial_seed() != torch.initial_seed()

    user_generator = torch.Generator().manual_seed(6)
    users = prepare_data_loader(
        DataLoader(Counting(12), 3, shuffle=True, generator=user_generator, num_workers=num_workers),
        use_seedable_sampler=True,
    )
    user_state = user_generator.get_state()
    users.set_epoch(0)
    assert [batch.tolist() for batch in users] == epoch0, "the user's generator seed decides, as data_seed"
    assert torch.equal(user_generator.get_state(), user_state), "the user's generator is left as it was"

    resumed = prepared(12, 1, 0, data_seed=0, num_workers=num_workers)
    resumed.load_state_dict({**loader.state_dict(), "epoch": 0, "samples_consumed": 6})
    assert [batch.tolist() for batch in resumed] == epoch0[2:], "same samples and same worker seeds"
    if num_workers:
        assert len({seed for batch in epoch0 for _, seed in batch}) == num_workers


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(17).unbind())


@pytest.mark.parametrize("source", ["map", "stream"])
def test_single_process_dispatcher_resumes(source):
    data = Counting(17) if source == "map" else Stream()
    make = lambda: prepare_data_loader(DataLoader(data, batch_size=4), dispatch_batches=True)  # noqa: E731
    loader = make()
    assert isinstance(loader, DataLoaderDispatcher)
    whole = [batch.tolist() for batch in loader]
    iterator = iter(loader)
    next(iterator), next(iterator)
    state = loader.state_dict()
    assert state["samples_consumed"] == 8
    fresh = make()
    fresh.load_state_dict(state)
    assert [batch.tolist() for batch in fresh] == whole[2:]


# -- two real processes ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("data_resume")
    launch_ok(WORKERS / "data_resume_worker.py", 2, out)
    return [json.loads((out / f"rank{rank}.json").read_text()) | {"dir": str(out)} for rank in range(2)]


@pytest.mark.parametrize("case", ["shard", "dispatch", "stream"])
def test_two_processes_resume_exactly(records, case):
    for rec in records:
        result = rec[case]
        assert result["first"] == result["reference"][:2], (case, rec["rank"])
        assert result["remaining"] == result["reference"][2:], (case, rec["rank"])
        assert result["next_epoch"] == result["reference_next_epoch"], (case, rec["rank"])
        assert result["epoch_after"] == 2 and result["loaded"] == result["state"]
        assert result["state"]["samples_consumed"] == 12 and result["state"]["epoch"] == 0
    assert records[0][case]["state"] == records[1][case]["state"], "every rank saves the same position"
    if case == "shard":
        assert all(rec[case]["reads"] == 6 for rec in records), "each rank loads its 2 remaining batches"
    if case == "dispatch":  # rank 0 reads: the first step again (for the top-up), then the 11 left
        assert [rec[case]["reads"] for rec in records] == [6 + 11, 0]


def test_two_processes_end_state_and_global_rng(records):
    for rec in records:
        assert rec["end_state"]["end_of_epoch"] and rec["end_state"]["samples_consumed"] == 24
        assert rec["global_rng_as_plain"] == [True, True, True], "shard, dispatch, stream"
        assert rec["seedable_global_rng_untouched"]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_two_process_position_loads_into_other_world_sizes(records, n):
    assert records[0]["cross_state"] == records[1]["cross_state"]
    state = torch.load(f"{records[0]['dir']}/cross.pt", weights_only=True)
    assert state["samples_consumed"] == 24
    expected = [i for step in records[0]["cross_remaining"] for i in step]
    loaders = [
        prepare_data_loader(
            DataLoader(torch.arange(48), batch_size=3, shuffle=True), num_processes=n, process_index=p
        )
        for p in range(n)
    ]
    for loader in loaders:
        loader.load_state_dict(state)
    assert round_order([[batch.tolist() for batch in loader] for loader in loaders]) == expected
