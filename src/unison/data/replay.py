"""Samplers of the user's own, replayed exactly when a run resumes in the middle of their pass.

unison draws a torch RandomSampler's order itself (torch_order, randomness), so it knows where that
order came from. A sampler it does not know (WeightedRandomSampler, SubsetRandomSampler, a class of the
user's) draws from the global torch RNG or from its own `generator` when its pass begins, and by the time
a checkpoint is taken those generators have moved on: a resumed pass that simply iterated the sampler
again would draw another order, and skipping the consumed batches would skip the wrong samples.

So prepare() wraps such a sampler in a `ReplayedSampler`. Each pass it notes the states of both
generators as its pass begins (the loader saves them with its position); a resumed pass draws the whole
order once from those states, inside torch.random.fork_rng, so the global RNG the checkpoint restored
is left exactly as it was. The sampler's own generator ends where the saved run's was after its draws.

A sampler that draws lazily, item by item, is replayed too, but its generators are restored to their
save-time states (PreparedDataLoader.load_state_dict), which is where an up-front draw leaves them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, Sampler, SequentialSampler

from .randomness import SeedableRandomSampler
from .torch_order import TorchOrderRandomSampler

# Samplers whose order unison draws itself, or that draw nothing
_KNOWN_ORDER = (SequentialSampler, TorchOrderRandomSampler, SeedableRandomSampler)


def own_generator(sampler: Any) -> torch.Generator | None:
    """The torch.Generator a sampler draws from by the convention torch's samplers follow (`generator`)."""
    generator = getattr(sampler, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


class ReplayedSampler(Sampler[Any]):
    """The user's `sampler`, yielding what it yields, whose pass a resumed loader can replay.

    began: the generator states of the latest pass's start ({"torch": global RNG, "generator": the
    sampler's own or None}), noted when the pass begins; replay: states the next pass must start from
    (set by the loader for a resumed pass, used once).
    """

    def __init__(self, sampler: Sampler[Any]):
        self.sampler = sampler
        self.began: dict[str, torch.Tensor | None] | None = None
        self.replay: dict[str, torch.Tensor | None] | None = None

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        generator = own_generator(self.sampler)
        if self.replay is None:
            self.began = {
                "torch": torch.get_rng_state(),
                "generator": None if generator is None else generator.get_state(),
            }
            yield from self.sampler
            return
        states, self.replay = self.replay, None
        self.began = states
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(states["torch"])
            if generator is not None and states["generator"] is not None:
                generator.set_state(states["generator"])
            order = list(self.sampler)
        yield from order


def with_replayed_sampler(sampler: Any, *, batches: bool) -> Any:
    """`sampler` with a sampler of the user's own wrapped in a ReplayedSampler: the one a torch
    BatchSampler draws from (shallow-copied, the user's object left untouched), or with batches=False
    (DataLoader's `sampler` position, batch_size=None) the sampler itself. Samplers unison orders itself
    are returned as they are, and so is a batch sampler of the user's own: it is not replayed."""
    if type(sampler) is BatchSampler:
        inner = sampler.sampler
        if isinstance(inner, _KNOWN_ORDER) or not isinstance(inner, Sampler):
            return sampler
        replaced = copy.copy(sampler)
        replaced.sampler = ReplayedSampler(inner)
        return replaced
    if batches or isinstance(sampler, (*_KNOWN_ORDER, BatchSampler)) or not isinstance(sampler, Sampler):
        return sampler
    return ReplayedSampler(sampler)
