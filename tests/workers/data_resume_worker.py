"""Launched by tests/test_data_resume.py: saving and restoring prepared loaders' positions in a real group.

Usage: data_resume_worker.py OUT_DIR. For each kind of loader, every rank records its uninterrupted
pass (the reference), the state_dict after K batches, and what a freshly prepared loader (other
global seed, so the order must come from the state) yields after load_state_dict; the next epoch
draws from the global RNG as saved at that point (save_state/load_state carry it). The state goes
through torch.save / torch.load(weights_only=True) as a checkpoint would take it. Rank 0 also writes
the 2-process position (OUT_DIR/cross.pt) and the remaining samples of a cross-world-size case, which
the test replays with 1, 2 and 4 simulated processes. OUT_DIR/rank{r}.json holds it for the test.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from unison import PartialState
from unison.data import prepare_data_loader
from unison.ops import gather
from unison.random import set_seed

state = PartialState(cpu=True)
rank, world = state.process_index, state.num_processes
out_dir = Path(sys.argv[1])
out: dict = {"rank": rank, "world": world}
SIZE, BS, K = 23, 3, 2  # 23 samples, global batch 6: the final round is topped up from the start


class Counting(Dataset):
    def __init__(self, size=SIZE):
        self.size, self.reads = size, 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.reads += 1
        return torch.tensor(index)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(SIZE).unbind())

    def __len__(self):
        return SIZE


def through_disk(loader_state: dict, name: str) -> dict:
    path = out_dir / f"{name}.pt"
    if rank == 0:
        torch.save(loader_state, path)
    state.wait_for_everyone()
    return torch.load(path, weights_only=True)


def printable(loader_state: dict) -> dict:
    """The state for the json record: the generator states (tensors) as digests."""
    digest = lambda t: None if t is None else hashlib.sha256(t.numpy().tobytes()).hexdigest()  # noqa: E731
    passed = loader_state["pass_states"]
    if passed is None:
        return loader_state
    return {**loader_state, "pass_states": {key: digest(value) for key, value in passed.items()}}


def resume_case(name: str, make) -> None:
    """Reference pass, K batches then state_dict, a fresh loader restored: its pass and the next epoch."""
    set_seed(10)
    reference = make()
    full = [[b.tolist() for b in reference] for _ in range(2)]  # epochs 0 and 1
    set_seed(10)
    interrupted = make()
    iterator = iter(interrupted)
    first = [next(iterator).tolist() for _ in range(K)]
    saved, saved_rng = interrupted.state_dict(), torch.get_rng_state()
    loaded = through_disk(saved, name)
    set_seed(99)  # another global seed: the order must come from the state
    fresh = make()
    dataset = fresh.dataset
    reads_before = getattr(dataset, "reads", None)
    fresh.load_state_dict(loaded)
    remaining = [b.tolist() for b in fresh]
    reads = None if reads_before is None else dataset.reads - reads_before
    torch.set_rng_state(saved_rng)  # as load_state restores it
    out[name] = {
        "reference": full[0],
        "first": first,
        "state": printable(saved),
        "loaded": printable(loaded),
        "remaining": remaining,
        "next_epoch": [b.tolist() for b in fresh],
        "reference_next_epoch": full[1],
        "epoch_after": fresh.epoch,
        "reads": reads,
    }


def map_shard():
    return prepare_data_loader(DataLoader(Counting(), batch_size=BS, shuffle=True))


def map_dispatch():
    return prepare_data_loader(DataLoader(Counting(), batch_size=BS, shuffle=True), dispatch_batches=True)


def stream_dispatch():
    return prepare_data_loader(DataLoader(Stream(), batch_size=BS))


resume_case("shard", map_shard)
resume_case("dispatch", map_dispatch)
resume_case("stream", stream_dispatch)

# -- saved on the last step: resumes at the next epoch, whatever the split ----------------------------
set_seed(10)
last = map_shard()
for _ in last:
    pass_end = last.state_dict()
out["end_state"] = printable(pass_end)

# -- the global RNG: advanced as the plain loaders advance it (use_seedable_sampler: untouched) --------
plain_makers = {
    map_shard: lambda: DataLoader(Counting(), batch_size=BS, shuffle=True),
    map_dispatch: lambda: DataLoader(Counting(), batch_size=BS, shuffle=True),
    stream_dispatch: lambda: DataLoader(Stream(), batch_size=BS),
}
as_plain = []
for make, plain in plain_makers.items():
    set_seed(10)
    for _ in plain():
        pass
    expected = torch.get_rng_state()
    set_seed(10)
    for _ in make():
        pass
    as_plain.append(torch.equal(expected, torch.get_rng_state()))
out["global_rng_as_plain"] = as_plain
set_seed(10)
before = torch.get_rng_state()
for dispatch in (False, True):
    loader = prepare_data_loader(
        DataLoader(Counting(), batch_size=BS, shuffle=True),
        dispatch_batches=dispatch,
        use_seedable_sampler=True,
    )
    for _ in loader:
        pass
    iter(loader)
out["seedable_global_rng_untouched"] = torch.equal(before, torch.get_rng_state())

# -- across world sizes: the position and what is left of the epoch, in round order --------------------
set_seed(10)
cross = prepare_data_loader(DataLoader(torch.arange(48), batch_size=BS, shuffle=True))
rounds = []
for i, batch in enumerate(cross):
    if i == 3:  # four batches handed out
        out["cross_state"] = printable(cross.state_dict())
        if rank == 0:
            torch.save(cross.state_dict(), out_dir / "cross.pt")
    if i >= 4:
        rounds.append(gather(batch).tolist())
out["cross_remaining"] = rounds

state.wait_for_everyone()
(out_dir / f"rank{rank}.json").write_text(json.dumps(out))
