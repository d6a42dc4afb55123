"""Samplers of the user's own, drawn alike on every process and replayed exactly when a run resumes.

unison draws a torch RandomSampler's order itself (torch_order, randomness), so it knows where that
order came from. A sampler it does not know (WeightedRandomSampler, SubsetRandomSampler, a class of the
user's) draws from the global torch RNG or from its own `generator` when its pass begins. Two things go
wrong with it as it is. Processes whose generators differ (seeded per process for augmentations, or
resumed on more processes than saved, where the new ones carry no saved stream) draw different orders,
so their shards overlap and miss samples, silently. And by the time a checkpoint is taken those
generators have moved on: a resumed pass that simply iterated the sampler again would draw another
order, and skipping the consumed batches would skip the wrong samples.

So prepare() wraps such a sampler in a `ReplayedSampler`. Each pass draws its order from process 0's
generator states (agreed by one broadcast, as torch_order does for a RandomSampler) and notes them; the
loader saves them with its position. A resumed pass draws the order again from the saved states. The
draws are made inside torch.random.fork_rng, and afterwards each generator stands where plain PyTorch
would leave it: this process's global RNG advanced by the sampler's draws (process 0 draws for real;
another process draws once more from its own stream, discarding the order), a sampler's own generator in
process 0's state after the draws; a replay leaves the global RNG the checkpoint restored as it was.
Under dispatch_batches only process 0 reads the sampler, so nothing needs agreeing.

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
from .torch_order import TorchOrderRandomSampler, process_0_states

# Samplers whose order unison draws itself, or that draw nothing
_KNOWN_ORDER = (SequentialSampler, TorchOrderRandomSampler, SeedableRandomSampler)


def own_generator(sampler: Any) -> torch.Generator | None:
    """The torch.Generator a sampler draws from by the convention torch's samplers follow (`generator`)."""
    generator = getattr(sampler, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


class ReplayedSampler(Sampler[Any]):
    """The user's `sampler`, yielding what it yields, drawn from process 0's generator states (unless
    `agree` is False) and replayable by a resumed loader.

    began: the generator states of the latest pass's draws ({"torch": the global RNG, "generator": the
    sampler's own or None}); replay: states the next pass must draw from (set by the loader for a resumed
    pass, used once).
    """

    def __init__(self, sampler: Sampler[Any], agree: bool = True):
        self.sampler = sampler
        self.agree = agree
        self.began: dict[str, torch.Tensor | None] | None = None
        self.replay: dict[str, torch.Tensor | None] | None = None

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        generator = own_generator(self.sampler)
        replayed, self.replay = self.replay, None
        if replayed is None:
            here = {"torch": torch.get_rng_state(), "generator": generator and generator.get_state()}
            self.began = process_0_states([here])[0] if self.agree else here
        else:
            self.began = replayed
        yield from self._draw(self.began, generator, advance_global=replayed is None)

    def _draw(self, states: dict, generator: torch.Generator | None, advance_global: bool) -> list[Any]:
        """The sampler's order drawn from `states`, each generator left as the module docstring says."""
        if advance_global and torch.equal(states["torch"], torch.get_rng_state()):
            if generator is not None and states["generator"] is not None:
                generator.set_state(states["generator"])
            return list(self.sampler)  # this process's own states: draw for real, as plain PyTorch
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(states["torch"])
            if generator is not None and states["generator"] is not None:
                generator.set_state(states["generator"])
            order = list(self.sampler)
        if advance_global and generator is None:  # the draws came from the global RNG: advance this one's
            list(self.sampler)
        return order


def with_replayed_sampler(sampler: Any, *, batches: bool, agree: bool) -> Any:
    """`sampler` with a sampler of the user's own wrapped in a ReplayedSampler: the one a torch
    BatchSampler draws from (shallow-copied, the user's object left untouched), or with batches=False
    (DataLoader's `sampler` position, batch_size=None) the sampler itself. Samplers unison orders itself
    are returned as they are, and so is a batch sampler of the user's own: it is not replayed.
    agree: every process iterates the sampler (not under dispatch_batches), so they draw alike."""
    if type(sampler) is BatchSampler:
        inner = sampler.sampler
        if isinstance(inner, _KNOWN_ORDER) or not isinstance(inner, Sampler):
            return sampler
        replaced = copy.copy(sampler)
        replaced.sampler = ReplayedSampler(inner, agree)
        return replaced
    if batches or isinstance(sampler, (*_KNOWN_ORDER, BatchSampler)) or not isinstance(sampler, Sampler):
        return sampler
    return ReplayedSampler(sampler, agree)
