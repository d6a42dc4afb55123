"""Sharding arithmetic, checked without processes: build the shard of every process index and compare.

Each case is checked two ways: against a reference written directly from the rule (pad the index
stream cyclically from its start to whole rounds, cut it into batches, deal batch i to process
i % n, or cut each batch into n slices with split_batches), and against the properties the rule is
for (equal counts of full batches with even_batches, coverage, no duplicates where none are needed,
len() == iteration count, drop_last drops, and the gathered final round truncated to `remainder`
giving back exactly the dataset).
"""

import itertools
import math

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from unison.data import (
    BatchSamplerShard,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    prepare_data_loader,
    skip_first_batches,
)

SIZES = [0, 1, 3, 8, 10, 17, 24]
BATCH_SIZES = [1, 2, 3, 4, 6]
PROCESSES = [1, 2, 3, 4]
FLAGS = list(itertools.product([False, True], repeat=3))  # split_batches, even_batches, drop_last


def chunks(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


def cyclic_padding(items, first, length):
    return items + list(itertools.islice(itertools.cycle(first), length - len(items)))


def reference(size, batch_size, n, split, even, drop_last):
    """(batches of each process, remainder) straight from the rule."""
    stream = list(range(size))
    global_batch = batch_size if split else batch_size * n
    per_process = global_batch // n
    if drop_last:  # the batch sampler drops its short batch; an incomplete round is dropped too
        stream = stream[: size // global_batch * global_batch]
    remainder = -1
    if even and n > 1 and not drop_last and size % global_batch:
        remainder = size % global_batch
        stream = cyclic_padding(stream, stream[:global_batch], math.ceil(size / global_batch) * global_batch)
    shards = [[] for _ in range(n)]
    if split:
        for batch in chunks(stream, batch_size):
            for p in range(n):
                piece = batch[p * per_process : (p + 1) * per_process]
                if piece:
                    shards[p].append(piece)
    else:
        for i, batch in enumerate(chunks(stream, batch_size)):
            shards[i % n].append(batch)
    return shards, remainder


def gathered_rounds(shards):
    """Per step, every process's batch concatenated in process order (as ops.gather would)."""
    steps = max(len(shard) for shard in shards)
    return [[i for shard in shards if step < len(shard) for i in shard[step]] for step in range(steps)]


CASES = [
    (size, bs, n, *flags)
    for size, bs, n, flags in itertools.product(SIZES, BATCH_SIZES, PROCESSES, FLAGS)
    if not (flags[0] and bs % n)  # indivisible split_batches: see test_split_batches_needs_a_multiple
]


def case_id(case):
    size, bs, n, split, even, drop = case
    return f"N{size}-bs{bs}-n{n}" + "-split" * split + "-even" * even + "-drop" * drop


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_batch_sampler_shard_table(case):
    size, bs, n, split, even, drop_last = case
    base = BatchSampler(SequentialSampler(range(size)), bs, drop_last)
    samplers = [BatchSamplerShard(base, n, p, split_batches=split, even_batches=even) for p in range(n)]
    shards = [list(sampler) for sampler in samplers]
    expected, expected_remainder = reference(size, bs, n, split, even, drop_last)
    assert shards == expected

    per_process = bs // n if split else bs
    capacity = per_process * n
    for p, sampler in enumerate(samplers):
        assert len(sampler) == len(shards[p]), f"len() of process {p}"
        assert sampler.remainder == expected_remainder
        assert sampler.process_batch_size == per_process and sampler.total_batch_size == capacity
    flat = [i for shard in shards for batch in shard for i in batch]
    if drop_last:
        kept = size // capacity * capacity
        assert sorted(flat) == list(range(kept)), "drop_last keeps exactly the complete rounds"
        assert all(len(batch) == per_process for shard in shards for batch in shard)
    else:
        assert set(flat) == set(range(size)), "every index appears"
    if (even and n > 1) or drop_last:
        assert len({len(shard) for shard in shards}) == 1, "every process gets the same number of batches"
        assert all(len(batch) == per_process for shard in shards for batch in shard), "full batches"
    if (not even or n == 1) and not drop_last:
        assert sorted(flat) == list(range(size)), "exactly once without even_batches"
    if size % capacity == 0:
        assert sorted(flat) == list(range(size)), "disjoint when no padding is needed"

    # what gather_for_metrics does: drop the rows after `remainder` in the last gathered step
    rounds = gathered_rounds(shards)
    if rounds and samplers[0].remainder != -1:
        rounds[-1] = rounds[-1][: samplers[0].remainder]
    recovered = sorted(i for step in rounds for i in step)
    assert recovered == (list(range(size // capacity * capacity)) if drop_last else list(range(size)))


@pytest.mark.parametrize("bs,n", [(5, 2), (4, 3), (7, 4), (6, 4)])
def test_split_batches_needs_a_multiple(bs, n):
    base = BatchSampler(SequentialSampler(range(20)), bs, False)
    for p in range(n):  # every process raises, in the constructor
        with pytest.raises(ValueError, match=rf"batch_size={bs}\b.*num_processes={n}\b"):
            BatchSamplerShard(base, n, p, split_batches=True)
        with pytest.raises(ValueError, match=rf"batch_size={bs}\b.*num_processes={n}\b"):
            IterableDatasetShard(range(20), bs, num_processes=n, process_index=p, split_batches=True)
    loader = DataLoader(range(20), batch_size=bs)
    with pytest.raises(ValueError, match=rf"batch_size={bs}\b.*num_processes={n}\b"):
        prepare_data_loader(loader, num_processes=n, process_index=n - 1, split_batches=True)


class VariableBatches:
    """A custom batch sampler with no batch_size: batches of 1, 2, 3, 1, 2, 3, ... indices."""

    def __init__(self, size):
        self.size = size

    def __iter__(self):
        start = 0
        for length in itertools.cycle([1, 2, 3]):
            if start >= self.size:
                return
            yield list(range(start, min(start + length, self.size)))
            start += length

    def __len__(self):
        return len(list(iter(self)))


@pytest.mark.parametrize("size,n", [(10, 3), (7, 2), (12, 4), (2, 3)])
def test_batch_sampler_without_batch_size(size, n):
    batches = list(VariableBatches(size))
    even = [list(BatchSamplerShard(VariableBatches(size), n, p)) for p in range(n)]
    assert len({len(shard) for shard in even}) == 1, "even_batches tops up with whole batches"
    for p, shard in enumerate(even):
        assert shard[: len(batches[p::n])] == batches[p::n]
        assert len(BatchSamplerShard(VariableBatches(size), n, p)) == len(shard)
    uneven = [list(BatchSamplerShard(VariableBatches(size), n, p, even_batches=False)) for p in range(n)]
    assert uneven == [batches[p::n] for p in range(n)]
    with pytest.raises(ValueError, match="no batch_size"):
        BatchSamplerShard(VariableBatches(size), n, 0, split_batches=True)


class Stream(IterableDataset):
    def __init__(self, size, sized=True):
        self.size, self.sized = size, sized

    def __iter__(self):
        return iter(range(self.size))

    def __len__(self):
        if not self.sized:
            raise TypeError("unsized stream")
        return self.size


ITERABLE_CASES = [
    (size, bs, n, split, drop)
    for size, bs, n, split, drop in itertools.product(
        SIZES, [1, 2, 4], PROCESSES, [False, True], [False, True]
    )
    if not (split and bs % n)
]


@pytest.mark.parametrize("case", ITERABLE_CASES, ids=lambda c: "N{}-bs{}-n{}-split{}-drop{}".format(*c))
def test_iterable_dataset_shard_table(case):
    size, bs, n, split, drop_last = case
    shards = [IterableDatasetShard(Stream(size), bs, drop_last, n, p, split) for p in range(n)]
    samples = [list(shard) for shard in shards]
    expected, remainder = reference(size, bs, n, split, True, drop_last)
    # the shard yields samples; the loader batches them by the per-process batch size
    assert samples == [[i for batch in batches for i in batch] for batches in expected]
    for p, shard in enumerate(shards):
        assert len(shard) == len(samples[p])
        assert shard.remainder == remainder == shard.remainder_from_length()


def test_seedable_sampler_is_a_function_of_seed_and_epoch():
    data = range(50)

    def order(seed, epoch):
        sampler = SeedableRandomSampler(data, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(3, 0) == order(3, 0) and sorted(order(3, 0)) == list(data)
    assert order(3, 1) == order(3, 1)
    assert order(3, 0) != order(3, 1) != order(3, 2)
    assert order(3, 0) != order(4, 0)
    assert order(0, 1) != order(1, 0), "seed + epoch must not collide"
    # a finished pass moves on to the next epoch (Accelerate's); the global RNG is neither used nor moved
    sampler = SeedableRandomSampler(data, seed=3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert [list(sampler), list(sampler)] == [order(3, 0), order(3, 1)] and sampler.epoch == 2
    assert torch.equal(before, torch.get_rng_state())
    with_replacement = SeedableRandomSampler(data, replacement=True, num_samples=80, seed=3)
    first = list(with_replacement)
    with_replacement.set_epoch(0)
    assert len(first) == 80 and list(with_replacement) == first
    # Accelerate's signature: data_seed=, generator= (its seed; the generator itself is not advanced)
    assert list(SeedableRandomSampler(data, data_seed=3)) == order(3, 0)
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert list(SeedableRandomSampler(data, generator=generator)) == order(3, 0)
    assert torch.equal(generator.get_state(), state)
    torch.manual_seed(4)
    assert list(SeedableRandomSampler(data)) == order(4, 0), "torch's initial seed, as set_seed sets it"
    with pytest.raises(ValueError, match=r"seed=3 and data_seed=4: they name the same seed"):
        SeedableRandomSampler(data, seed=3, data_seed=4)


def shard_orders(loader, n, epochs=2):
    """Per epoch, every simulated process's batches of a prepared copy of `loader` (use_seedable_sampler)."""
    prepared = [
        prepare_data_loader(loader, num_processes=n, process_index=p, use_seedable_sampler=True)
        for p in range(n)
    ]
    return [[[batch.tolist() for batch in pl] for pl in prepared] for _ in range(epochs)]


def test_seedable_shuffle_follows_set_seed_and_the_users_generator():
    data = torch.arange(40)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    torch.manual_seed(11)
    first = shard_orders(loader, 2)
    torch.manual_seed(11)
    assert shard_orders(loader, 2) == first, "set_seed before prepare makes the run reproducible"
    torch.manual_seed(12)
    assert shard_orders(loader, 2) != first
    assert first[0] != first[1], "a new order every epoch"
    for epoch in first:  # the processes share one permutation: together they cover the data once
        assert sorted(i for shard in epoch for batch in shard for i in batch) == list(range(40))

    user_seeded = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(11)
    a = shard_orders(user_seeded, 2)
    torch.manual_seed(99)
    assert shard_orders(user_seeded, 2) == a, "the user's generator decides, not the global seed"
    other = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(6))
    assert shard_orders(other, 2) != a
    explicit = prepare_data_loader(loader, num_processes=1, data_seed=5)
    from_generator = prepare_data_loader(user_seeded, num_processes=1, use_seedable_sampler=True)
    assert [b.tolist() for b in explicit] == [b.tolist() for b in from_generator], (
        "data_seed=5 == generator seed 5"
    )


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, size):
        self.size, self.reads = size, 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.reads += 1
        return index


@pytest.mark.parametrize("seedable", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_skip_first_batches_skips_in_the_sampler_for_one_pass(n, seedable):
    dataset = CountingDataset(26)
    torch.manual_seed(0)
    loader = prepare_data_loader(
        DataLoader(dataset, batch_size=3, shuffle=True),
        num_processes=n,
        process_index=0,
        use_seedable_sampler=seedable,
    )
    before = torch.get_rng_state()
    epoch0 = [b.tolist() for b in loader]
    epoch1 = [b.tolist() for b in loader]
    loader.set_epoch(0)
    dataset.reads = 0
    torch.set_rng_state(before)  # PyTorch's order: a pass draws from the global RNG, as at epoch 0
    resumed = skip_first_batches(loader, 2)
    assert isinstance(resumed, DataLoaderShard) and len(resumed) == len(epoch0) - 2
    assert [b.tolist() for b in resumed] == epoch0[2:]
    assert dataset.reads == sum(len(b) for b in epoch0[2:]), "skipped batches are never loaded"
    assert resumed.epoch == loader.epoch == 1, "finishing the resumed epoch moves the original on"
    assert len(resumed) == len(epoch0)
    assert [b.tolist() for b in resumed] == epoch1, "the passes after the resumed one are complete"
    assert [b.tolist() for b in loader] != epoch1 and loader.epoch == 3

    plain = DataLoader(range(10), batch_size=3)
    assert [b.tolist() for b in skip_first_batches(plain, 1)] == [[3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(ValueError, match="negative"):
        skip_first_batches(plain, -1)


def test_random_sampler_inside_a_user_batch_sampler_is_replaced_without_touching_it():
    user_sampler = RandomSampler(range(16))
    batch_sampler = BatchSampler(user_sampler, 4, drop_last=False)
    loader = DataLoader(range(16), batch_sampler=batch_sampler)
    prepared = [prepare_data_loader(loader, num_processes=2, process_index=p) for p in range(2)]
    assert loader.batch_sampler.sampler is user_sampler, "the user's loader is left as it was"
    shards = []
    for (
        pl
    ) in prepared:  # each simulated process from the same global RNG state (real ones agree by broadcast)
        torch.manual_seed(1)
        shards.append([b.tolist() for b in pl])
    assert sorted(i for shard in shards for b in shard for i in b) == list(range(16))
    assert all(pl.batch_size == 4 and pl.total_batch_size == 8 for pl in prepared)
