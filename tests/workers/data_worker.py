"""Launched by tests/test_data_loader.py: prepared data loaders in a real gloo group.

Usage: data_worker.py OUT_DIR. Each rank records, per scenario, what its prepared loader yielded next
to a single-process reference computed here from the rule (the reference permutation of the agreed
seed and epoch, cut into batches, batch i to process i % n, the final round topped up from the start),
plus what unison.ops.gather returned over all ranks. OUT_DIR/rank{r}.json holds it for the test.
"""

import hashlib
import itertools
import json
import random
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from unison import GradientState, PartialState
from unison.data import (
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    prepare_data_loader,
    skip_first_batches,
)
from unison.ops import gather
from unison.random import set_seed

state = PartialState(cpu=True)
rank, world = state.process_index, state.num_processes
out: dict = {"rank": rank, "world": world}
SEED, SIZE, BS = 1234, 23, 4


def reference_batches(order: list, batch_size: int, split: bool = False, even: bool = True) -> list:
    """This rank's batches of `order` by the rule (see the module docstring)."""
    global_batch = batch_size if split else batch_size * world
    per_process = global_batch // world
    if even and len(order) % global_batch:
        target = -(-len(order) // global_batch) * global_batch
        order = order + list(itertools.islice(itertools.cycle(order[:global_batch]), target - len(order)))
    if split:
        return [
            order[i + rank * per_process : i + (rank + 1) * per_process]
            for i in range(0, len(order), batch_size)
        ]
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return batches[rank::world]


def permutation(epoch: int) -> list:
    sampler = SeedableRandomSampler(range(SIZE), seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def plain_orders(passes: int, generator=None) -> list:
    """The orders of `passes` passes of the user's unprepared shuffled loader in ONE process, from the
    global RNG's (or `generator`'s) current state, which is left as it was."""
    saved = torch.get_rng_state() if generator is None else generator.get_state()
    plain = DataLoader(range(SIZE), batch_size=SIZE, shuffle=True, generator=generator)
    orders = [next(iter(plain)).tolist() for _ in range(passes)]
    torch.set_rng_state(saved) if generator is None else generator.set_state(saved)
    return orders


def run_epoch(loader, key=lambda b: b) -> dict:
    """One pass: this rank's batches, end_of_dataloader per batch, and the gathered de-duplicated rows."""
    batches, flags, rows, active = [], [], [], []
    for batch in loader:
        values = key(batch)
        batches.append(values.tolist())
        flags.append(loader.end_of_dataloader)
        active.append(
            GradientState().active_dataloader is loader and GradientState().end_of_dataloader == flags[-1]
        )
        everyone = gather(values)  # every rank's batch, concatenated in process order
        if loader.end_of_dataloader and loader.remainder != -1:
            everyone = everyone[: loader.remainder]
        rows += everyone.tolist()
    return {
        "batches": batches,
        "end_flags": flags,
        "remainder": loader.remainder,
        "gathered": rows,
        "registered": all(active) and GradientState().active_dataloader is None,
        "epoch_after": loader.epoch,
    }


class Squares(Dataset):
    def __len__(self):
        return SIZE

    def __getitem__(self, index):
        return torch.tensor(index)


class Stream(IterableDataset):
    """An iterable dataset of dicts, with a string leaf (dispatching carries any picklable structure)."""

    def __init__(self, size=SIZE, fail_at=None):
        self.size, self.fail_at = size, fail_at

    def __iter__(self):
        for i in range(self.size):
            if i == self.fail_at:
                raise OSError(f"sample {i} is unreadable")
            yield {"x": torch.tensor(i), "name": f"s{i}"}

    def __len__(self):
        return self.size


# -- map-style, shuffled: shards of the order the plain loader gives in one process, new each pass -------
set_seed(SEED)
orders = plain_orders(3)
raw = DataLoader(Squares(), batch_size=BS, shuffle=True)
loader = prepare_data_loader(raw, num_processes=world, process_index=rank)
out["types"] = {
    "is_dataloader": isinstance(loader, DataLoader),
    "is_shard": isinstance(loader, DataLoaderShard),
    "class": type(loader).__name__,
    "batch_size": loader.batch_size,
    "total_batch_size": loader.total_batch_size,
    "len": len(loader),
}
out["shuffled"] = []
for epoch in range(2):
    record = run_epoch(loader)
    record["reference"] = reference_batches(orders[epoch], BS)
    out["shuffled"].append(record)
loader.set_epoch(5)  # a third pass: as in torch, the epoch number does not decide the order
record = run_epoch(loader)
record["reference"] = reference_batches(orders[2], BS)
out["set_epoch"] = record

# -- use_seedable_sampler: each epoch's order a function of (seed, epoch) ------------------------------
set_seed(SEED)
seedable = prepare_data_loader(raw, num_processes=world, process_index=rank, use_seedable_sampler=True)
seedable.set_epoch(5)
record = run_epoch(seedable)
record["reference"] = reference_batches(permutation(5), BS)
out["seedable"] = record

# -- a user generator seeded differently on each rank (rank 0: above 2**63): process 0's state wins -----
user_seed = 2**64 - 5 if rank == 0 else 7 + rank
user_generator = torch.Generator().manual_seed(user_seed)
seeded = DataLoader(Squares(), batch_size=BS, shuffle=True, generator=user_generator)
out["user_seeded"] = {
    "batches": [b.tolist() for b in prepare_data_loader(seeded)],
    "generator_after": hashlib.sha256(user_generator.get_state().numpy().tobytes()).hexdigest(),
}

# -- split_batches and even_batches=False, with worker processes -------------------------------------
if BS * 3 % world == 0:
    split = prepare_data_loader(DataLoader(Squares(), batch_size=BS * 3, num_workers=1), split_batches=True)
    record = run_epoch(split)
    record["reference"] = reference_batches(list(range(SIZE)), BS * 3, split=True)
    out["split"] = record
uneven = prepare_data_loader(DataLoader(Squares(), batch_size=BS), even_batches=False)
out["uneven"] = {
    "batches": [b.tolist() for b in uneven],
    "reference": reference_batches(list(range(SIZE)), BS, even=False),
}

# -- the indivisible split_batches error, on every rank ------------------------------------------------
try:
    prepare_data_loader(DataLoader(Squares(), batch_size=world * 2 + 1), split_batches=True)
    out["split_error"] = None
except ValueError as error:
    out["split_error"] = str(error)

# -- iterable data: dispatched by process 0 (the default), or sharded ---------------------------------
dispatched = prepare_data_loader(DataLoader(Stream(), batch_size=BS))
out["dispatch_types"] = {
    "class": type(dispatched).__name__,
    "is_dataloader": isinstance(dispatched, DataLoader),
    "is_dispatcher": isinstance(dispatched, DataLoaderDispatcher),
    "len": len(dispatched),
}
names = []
record = run_epoch(dispatched, key=lambda b: names.append(b["name"]) or b["x"])
record["names"] = names
record["reference"] = reference_batches(list(range(SIZE)), BS)
out["dispatch"] = record
resumed = skip_first_batches(dispatched, 2)
out["dispatch_resumed"] = {
    "batches": [b["x"].tolist() for b in resumed],
    "reference": reference_batches(list(range(SIZE)), BS)[2:],
}
split_dispatch = prepare_data_loader(DataLoader(Stream(), batch_size=world * 2), split_batches=True)
record = run_epoch(split_dispatch, key=lambda b: b["x"])
record["reference"] = reference_batches(list(range(SIZE)), world * 2, split=True)
out["dispatch_split"] = record
sharded = prepare_data_loader(DataLoader(Stream(), batch_size=BS), dispatch_batches=False)
record = run_epoch(sharded, key=lambda b: b["x"])
record["reference"] = reference_batches(list(range(SIZE)), BS)
record["class"] = type(sharded).__name__
out["iterable_shard"] = record

uneven_dispatch = prepare_data_loader(DataLoader(Stream(), batch_size=BS), even_batches=False)
out["dispatch_uneven"] = {
    "batches": [b["x"].tolist() for b in uneven_dispatch],
    "reference": reference_batches(list(range(SIZE)), BS, even=False),
    "len": len(uneven_dispatch),
}

# -- rng_types: every process continues from process 0's generator states ------------------------------
set_seed(100 + rank)
synced = prepare_data_loader(DataLoader(Squares(), batch_size=BS), rng_types=["torch", "python"])
next(iter(synced))
out["rng_synced"] = {"torch": torch.rand(3).tolist(), "python": random.random()}

# -- a failure while process 0 reads reaches every process -------------------------------------------
failing = prepare_data_loader(DataLoader(Stream(size=100, fail_at=2 * BS * world + 1), batch_size=BS))
seen = 0
try:
    for _ in failing:
        seen += 1
    out["dispatch_failure"] = None
except Exception as error:
    out["dispatch_failure"] = {"type": type(error).__name__, "message": str(error), "batches_before": seen}

state.wait_for_everyone()
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(out))
