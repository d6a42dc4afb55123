"""Prepared data loaders: in one process (simulated process indices), and in real 2- and 3-process groups.

The launched worker (tests/workers/data_worker.py) records what each rank's loader yielded next to
the single-process reference computed from the rule, and what unison.ops.gather collected over all
ranks; the tests below assert on those records.
"""

import hashlib
import json
import random

import pytest
import torch
from launching import WORKERS, launch_ok
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from unison import GradientState
from unison.data import (
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    prepare_data_loader,
    skip_first_batches,
)

SIZE = 23


# -- one process --------------------------------------------------------------------------------------
class EpochAware(Dataset):
    """Records the epochs set_epoch told it."""

    def __init__(self, size=SIZE):
        self.size, self.epochs = size, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return torch.tensor(index)


def test_prepared_loader_is_a_real_dataloader_that_keeps_the_users_settings():
    def collate(samples):
        return {"x": torch.stack(samples)}

    def init_worker(worker_id):
        pass

    user = DataLoader(
        EpochAware(), batch_size=4, shuffle=True, collate_fn=collate, worker_init_fn=init_worker
    )
    prepared = prepare_data_loader(user, num_processes=2, process_index=1)
    assert type(prepared) is DataLoaderShard and isinstance(prepared, DataLoader)
    assert prepared.dataset is user.dataset and prepared.collate_fn is collate
    assert prepared.worker_init_fn is init_worker and prepared.num_workers == 0
    assert prepared.pin_memory is False, "pinning is for CUDA devices only"
    assert (prepared.batch_size, prepared.total_batch_size, len(prepared)) == (4, 8, 3)
    assert isinstance(next(iter(prepared))["x"], torch.Tensor)
    with pytest.raises(ValueError, match="already prepared"):
        prepare_data_loader(prepared)
    with pytest.raises(TypeError, match="needs a torch.utils.data.DataLoader, got a list"):
        prepare_data_loader([1, 2, 3])
    with pytest.raises(ValueError, match=r"unknown generator names \['torch_cuda'\]"):
        prepare_data_loader(user, rng_types=["torch", "torch_cuda"])


@pytest.mark.parametrize(
    "device, loader_pins, non_blocking, expected",
    [
        ("cuda", False, None, (True, True)),  # the default on a GPU: pinned, queued copies
        ("cuda", False, False, (False, False)),  # blocking, as Accelerate's default
        ("cuda", True, False, (True, False)),  # the loader's own pinning is kept
        ("cpu", True, None, (False, False)),  # nothing to pin for, whatever was asked
        ("cpu", False, True, (False, False)),
    ],
)
def test_batches_are_pinned_and_copied_without_waiting_on_a_gpu_by_default(
    device, loader_pins, non_blocking, expected
):
    from unison.data.prepare import host_to_device_copies

    assert host_to_device_copies(torch.device(device), loader_pins, True, non_blocking) == expected
    # a loader that does not put batches on the device never copies them
    assert host_to_device_copies(torch.device(device), False, False, non_blocking)[0] is False


@pytest.mark.parametrize("num_workers", [0, 2])
def test_end_of_dataloader_remainder_and_gradient_state(num_workers):
    dataset = EpochAware()
    loaders = [
        prepare_data_loader(
            DataLoader(dataset, batch_size=4, num_workers=num_workers), num_processes=3, process_index=p
        )
        for p in range(3)
    ]
    per_process = []
    for loader in loaders:
        seen = []
        for batch in loader:
            assert GradientState().active_dataloader is loader
            assert GradientState().end_of_dataloader == loader.end_of_dataloader
            seen.append((batch.tolist(), loader.end_of_dataloader, loader.remainder))
        assert GradientState().active_dataloader is None, "unregistered after the pass"
        per_process.append(seen)
    assert [[flag for _, flag, _ in seen] for seen in per_process] == [[False, True]] * 3
    # 23 samples, global batch 12: the last round holds 11 real samples, then 1 from the start
    assert all(seen[-1][2] == 11 for seen in per_process)
    last_round = [i for seen in per_process for i in seen[-1][0]]
    assert last_round[:11] == list(range(12, 23)) and last_round[11:] == [0]
    assert dataset.epochs == [0, 0, 0], "each pass told the dataset its epoch"


def test_epoch_advances_after_complete_passes_only():
    loader = prepare_data_loader(
        DataLoader(range(20), batch_size=5, shuffle=True), num_processes=1, data_seed=3
    )
    sampler = loader.batch_sampler.sampler
    assert isinstance(sampler, SeedableRandomSampler) and loader.epoch == 0
    first = [b.tolist() for b in loader]
    assert loader.epoch == 1 and sampler.epoch == 1  # a finished pass moves both on
    second = [b.tolist() for b in loader]
    assert loader.epoch == 2 and sampler.epoch == 2 and first != second
    for _ in loader:
        break  # an interrupted pass does not count
    assert loader.epoch == 2 and GradientState().active_dataloader is None
    loader.set_epoch(0)
    loader.set_epoch(0)  # harmless twice
    assert [b.tolist() for b in loader] == first


def test_a_seedable_sampler_reshuffles_each_pass_as_its_prepared_loader_does():
    """Accelerate's SeedableRandomSampler idiom: the user's sampler, no set_epoch; plain == prepared."""
    sampler = SeedableRandomSampler(range(12), data_seed=5)
    plain = [[b.tolist() for b in DataLoader(range(12), batch_size=4, sampler=sampler)] for _ in range(3)]
    assert plain[0] != plain[1] != plain[2] and sampler.epoch == 3
    user = DataLoader(range(12), batch_size=4, sampler=SeedableRandomSampler(range(12), data_seed=5))
    prepared = prepare_data_loader(user, num_processes=1)
    assert [[b.tolist() for b in prepared] for _ in range(3)] == plain


class Stream(IterableDataset):
    def __init__(self, size=SIZE):
        self.size = size

    def __iter__(self):
        return iter(torch.arange(self.size).unbind())

    def __len__(self):
        return self.size


@pytest.mark.parametrize("num_workers", [0, 1])
def test_iterable_shard_loader(num_workers):
    loaders = [
        prepare_data_loader(
            DataLoader(Stream(), batch_size=4, num_workers=num_workers),
            num_processes=2,
            process_index=p,
            dispatch_batches=False,
        )
        for p in range(2)
    ]
    shards = [
        [(b.tolist(), loader.end_of_dataloader, loader.remainder) for b in loader] for loader in loaders
    ]
    assert [batch for batch, _, _ in shards[0]] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]]
    assert [batch for batch, _, _ in shards[1]] == [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 22, 0]]
    assert [(flag, rem) for _, flag, rem in shards[1]] == [(False, -1), (False, -1), (True, 7)]
    assert all(len(loader) == 3 and loader.total_batch_size == 8 for loader in loaders)


def test_even_batches_false_on_a_sharded_stream_is_refused_not_ignored():
    """A stream read in shards always tops up its last round: even_batches=False cannot be kept."""
    with pytest.raises(ValueError, match=r"even_batches=False cannot apply to an IterableDataset"):
        prepare_data_loader(
            DataLoader(Stream(), batch_size=4),
            num_processes=2,
            process_index=0,
            dispatch_batches=False,
            even_batches=False,
        )
    one = prepare_data_loader(
        DataLoader(Stream(), batch_size=4), num_processes=1, process_index=0, even_batches=False
    )
    assert sum(len(batch) for batch in one) == SIZE  # one process: nothing to even out


class ReadyMadeBatches(Dataset):
    """batch_size=None loaders: each index fetches a whole batch (or a list of indices fetches rows)."""

    def __len__(self):
        return 7

    def __getitem__(self, index):
        if isinstance(index, list):
            return torch.tensor(index)
        return torch.full((2,), index)


def test_loaders_without_automatic_batching_are_sharded_too():
    plain = DataLoader(ReadyMadeBatches(), batch_size=None)
    shards = [
        [b.tolist() for b in prepare_data_loader(plain, num_processes=3, process_index=p)] for p in range(3)
    ]
    assert shards == [[[0, 0], [3, 3], [6, 6]], [[1, 1], [4, 4], [0, 0]], [[2, 2], [5, 5], [1, 1]]]
    with pytest.raises(ValueError, match="batch_size=None"):
        prepare_data_loader(plain, num_processes=3, process_index=0, split_batches=True)

    rows = DataLoader(
        ReadyMadeBatches(), sampler=BatchSampler(SequentialSampler(range(7)), 2, False), batch_size=None
    )
    prepared = [prepare_data_loader(rows, num_processes=2, process_index=p) for p in range(2)]
    assert [[b.tolist() for b in pl] for pl in prepared] == [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]
    assert prepared[1].remainder == 3 and prepared[1].batch_size == 2

    batch_sampler = DataLoader(
        ReadyMadeBatches(), batch_sampler=BatchSampler(SequentialSampler(range(7)), 3, False)
    )
    split = [
        prepare_data_loader(batch_sampler, num_processes=3, process_index=p, split_batches=True)
        for p in range(3)
    ]
    assert [[b[:, 0].tolist() for b in pl] for pl in split] == [
        [[0], [3], [6]],
        [[1], [4], [0]],
        [[2], [5], [1]],
    ]
    assert split[0].batch_size == 1 and split[0].total_batch_size == 3


def test_single_process_dispatcher_and_its_skip():
    dispatcher = prepare_data_loader(DataLoader(Stream(), batch_size=5), dispatch_batches=True)
    assert type(dispatcher) is DataLoaderDispatcher
    batches = [b.tolist() for b in dispatcher]
    assert batches == [list(range(i, min(i + 5, SIZE))) for i in range(0, SIZE, 5)], (
        "one process: nothing padded"
    )
    assert dispatcher.remainder == -1 and len(dispatcher) == 5
    resumed = skip_first_batches(dispatcher, 3)
    assert type(resumed) is DataLoaderDispatcher and [b.tolist() for b in resumed] == batches[3:]
    assert dispatcher.epoch == 2


# -- real processes -----------------------------------------------------------------------------------
def expected_rows(batches):
    return sorted(i for batch in batches for i in batch)


@pytest.fixture(scope="module", params=[2, 3], ids=["2proc", "3proc"])
def records(request, tmp_path_factory):
    nproc = request.param
    out = tmp_path_factory.mktemp(f"data{nproc}")
    launch_ok(WORKERS / "data_worker.py", nproc, out)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def check_pass(record, name, rank):
    """This rank got exactly the reference batches; the flags and the de-duplicated gather are right."""
    assert record["batches"] == record["reference"], (
        f"{name}: rank {rank} got other samples than the reference"
    )
    assert record["end_flags"] == [False] * (len(record["batches"]) - 1) + [True], name
    assert sorted(record["gathered"]) == list(range(SIZE)), f"{name}: gather minus duplicates != the dataset"
    assert record["registered"], f"{name}: not registered in GradientState while iterating"


def test_prepared_types(records):
    for rec in records:
        world = rec["world"]
        assert rec["types"]["is_dataloader"] and rec["types"]["is_shard"]
        assert rec["types"]["batch_size"] == 4 and rec["types"]["total_batch_size"] == 4 * world
        assert rec["types"]["len"] == -(-SIZE // (4 * world))
        assert rec["dispatch_types"]["is_dataloader"] and rec["dispatch_types"]["is_dispatcher"]
        assert rec["dispatch_types"]["len"] == rec["types"]["len"]


def test_shuffles_agree_across_ranks_and_differ_across_epochs(records):
    for rec in records:
        for epoch, record in enumerate(rec["shuffled"]):
            check_pass(record, f"epoch {epoch}", rec["rank"])
            assert record["epoch_after"] == epoch + 1
            assert record["remainder"] == SIZE % (4 * rec["world"])
        assert rec["shuffled"][0]["batches"] != rec["shuffled"][1]["batches"]
        check_pass(rec["set_epoch"], "set_epoch(5)", rec["rank"])
        check_pass(rec["seedable"], "use_seedable_sampler, epoch 5", rec["rank"])
        assert rec["set_epoch"]["epoch_after"] == 6
    # the ranks' shards of one epoch are disjoint up to the padding, and all ranks agree on the order
    first_epoch = [rec["shuffled"][0]["gathered"] for rec in records]
    assert all(rows == first_epoch[0] for rows in first_epoch)


def test_user_generator_state_agreed_from_process_0(records):
    """Ranks whose generators were seeded differently shuffle as process 0's generator would in one
    plain process, so their shards still partition one permutation, and every rank's generator ends
    where that plain pass leaves it."""
    generator = torch.Generator().manual_seed(2**64 - 5)
    plain = DataLoader(range(SIZE), batch_size=4, shuffle=True, generator=generator)
    batches = [batch.tolist() for batch in plain]
    after = hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()
    for rec in records:
        world = rec["world"]
        expected = batches[rec["rank"] :: world]
        padded = -(-len(batches) // world) * world - len(batches)  # the last round topped up from the start
        got = rec["user_seeded"]["batches"]
        assert [batch[: len(want)] for batch, want in zip(got, expected)] == expected  # short ones topped up
        assert len(expected) <= len(got) <= len(expected) + padded
        assert rec["user_seeded"]["generator_after"] == after


def test_split_and_uneven_batches(records):
    for rec in records:
        check_pass(rec["split"], "split_batches with a worker process", rec["rank"])
        assert rec["uneven"]["batches"] == rec["uneven"]["reference"]
    uneven = [batch for rec in records for batch in rec["uneven"]["batches"]]
    assert expected_rows(uneven) == list(range(SIZE)), "even_batches=False: every sample exactly once"


def test_split_batches_error_on_every_rank(records):
    for rec in records:
        bs, n = 2 * rec["world"] + 1, rec["world"]
        assert rec["split_error"] and f"batch_size={bs}" in rec["split_error"]
        assert f"num_processes={n}" in rec["split_error"]


def test_dispatcher_gives_each_rank_its_slice(records):
    for rec in records:
        check_pass(rec["dispatch"], "dispatch", rec["rank"])
        assert rec["dispatch"]["names"] == [
            [f"s{i}" for i in batch] for batch in rec["dispatch"]["reference"]
        ]
        assert rec["dispatch_resumed"]["batches"] == rec["dispatch_resumed"]["reference"]
        check_pass(rec["dispatch_split"], "dispatch with split_batches", rec["rank"])
        check_pass(rec["iterable_shard"], "IterableDatasetShard", rec["rank"])
        assert rec["dispatch_uneven"]["batches"] == rec["dispatch_uneven"]["reference"]
        assert rec["dispatch_uneven"]["len"] == len(rec["dispatch_uneven"]["reference"])


def test_dispatcher_failure_reaches_every_rank(records):
    for rec in records:
        failure = rec["dispatch_failure"]
        assert failure is not None and failure["batches_before"] == 1
        if rec["rank"] == 0:
            assert failure == {
                "type": "OSError",
                "message": f"sample {8 * rec['world'] + 1} is unreadable",
            } | {"batches_before": 1}
        else:
            assert failure["type"] == "RuntimeError" and "process 0 failed" in failure["message"]
            assert "OSError" in failure["message"]


def test_rng_types_synchronise_generators(records):
    assert len({json.dumps(rec["rng_synced"]) for rec in records}) == 1
    random.seed(100)  # rank 0's seed: everyone continues its streams
    assert records[0]["rng_synced"]["python"] == random.random()
    torch.manual_seed(100)  # (the DataLoader's iterator drew its worker seed from it first)
    stream = torch.rand(8).tolist()
    drawn = records[0]["rng_synced"]["torch"]
    assert any(stream[i : i + 3] == drawn for i in range(6)), (drawn, stream)
