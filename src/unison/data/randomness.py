"""Shuffles that agree across processes: a sampler whose order is a pure function of (seed, epoch).

Sharding only works if every process draws the same permutation, and training only works if each
epoch draws a new one. torch's RandomSampler draws a fresh seed from the global RNG at every pass,
which differs across processes unless the user seeded them identically. So prepare() replaces it
with SeedableRandomSampler, whose seed is agreed once (process 0's value is broadcast) and whose
permutation at epoch e depends on nothing but (seed, e): reproducible under set_seed, and a resumed
run only needs the epoch and the number of batches already seen to continue where it stopped.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import RandomSampler

from .. import ops
from ..random import get_rng_state, set_rng_state
from ..state import PartialState

logger = logging.getLogger("unison")

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive epochs over the seed space
RNG_TYPES = ("python", "numpy", "torch", "cuda", "generator")


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of epoch `epoch`: distinct epochs and distinct seeds do not collide
    the way seed + epoch would (seed 1 epoch 0 would replay seed 0 epoch 1)."""
    return (seed + epoch * _GOLDEN_GAMMA) % 2**64


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order at each epoch is a function of (seed, epoch) only.

    Takes Accelerate's arguments too: the seed is `seed` or `data_seed`, else the seed of `generator`,
    else torch's initial seed (what set_seed sets). The generator only supplies that seed: each epoch
    draws from a generator of its own, so iterating leaves the user's generator as it was.
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        seed: int | None = None,
        *,
        generator: torch.Generator | None = None,
        data_seed: int | None = None,
    ):
        super().__init__(data_source, replacement=replacement, num_samples=num_samples)
        if seed is not None and data_seed is not None and int(seed) != int(data_seed):
            raise ValueError(
                f"SeedableRandomSampler got seed={seed} and data_seed={data_seed}: they name the same "
                "seed; pass one of them."
            )
        chosen = seed if seed is not None else data_seed
        if chosen is None:
            chosen = generator.initial_seed() if generator is not None else torch.initial_seed()
        self.seed = int(chosen)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        """This epoch's order; a pass read to its end moves on to the next epoch (as Accelerate's does), so
        a plain loop that never calls set_epoch reshuffles like the prepared loader, which sets the epoch
        before each pass."""
        epoch = self.epoch
        self.generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        if not self.replacement and self.num_samples == len(self.data_source):
            # The common case, in the very order RandomSampler would give, without its two generator
            # layers: a sampler is read once per sample, so this shows in loader throughput.
            yield from torch.randperm(self.num_samples, generator=self.generator).tolist()
        else:
            yield from super().__iter__()
        self.epoch = epoch + 1


def shuffle_seed(sampler: RandomSampler, data_seed: int | None = None) -> int:
    """The seed all processes will shuffle with, agreed by broadcasting process 0's choice.

    data_seed wins; else the seed of the generator the user gave the DataLoader/sampler (so their
    seeding still decides the order); else torch's initial seed, which set_seed(s) sets to s.
    """
    if data_seed is not None:
        seed = int(data_seed)
    elif sampler.generator is not None:
        seed = sampler.generator.initial_seed()
    else:
        seed = torch.initial_seed()
    return broadcast_seed(seed)


def broadcast_seed(seed: int) -> int:
    """Process 0's 64-bit `seed` on every process, sent as one int64 tensor (no pickling).

    Generator seeds range over [0, 2**64); an int64 carries them in two's complement.
    """
    if PartialState().num_processes == 1:
        return seed
    signed = seed - 2**64 if seed >= 2**63 else seed
    agreed = int(ops.broadcast(torch.tensor([signed], dtype=torch.int64), from_process=0).item())
    return agreed % 2**64


def with_seedable_sampler(sampler: Any, data_seed: int | None = None) -> Any:
    """`sampler` with its torch RandomSampler replaced by a SeedableRandomSampler (see
    `with_replaced_shuffle`)."""

    def seedable(shuffle: RandomSampler) -> SeedableRandomSampler:
        seed = shuffle_seed(shuffle, data_seed)
        return SeedableRandomSampler(
            shuffle.data_source, shuffle.replacement, shuffle._num_samples, seed=seed
        )

    return with_replaced_shuffle(sampler, seedable)


def with_replaced_shuffle(sampler: Any, replace: Callable[[RandomSampler], Any]) -> Any:
    """`sampler` with its torch RandomSampler (itself, or the one a batch sampler draws from) replaced
    by `replace(it)`.

    A batch sampler is shallow-copied with the new sampler, so the user's object is left untouched.
    Other samplers are returned as they are.
    """
    if type(sampler) is RandomSampler:
        return replace(sampler)
    inner = getattr(sampler, "sampler", None)
    if type(inner) is RandomSampler:
        replaced = copy.copy(sampler)
        replaced.sampler = replace(inner)
        return replaced
    return sampler


def check_rng_types(rng_types: Sequence[str] | None) -> list[str]:
    names = [str(name) for name in rng_types or ()]
    unknown = [name for name in names if name not in RNG_TYPES]
    if unknown:
        raise ValueError(
            f"rng_types={list(rng_types or ())} contains unknown generator names {unknown}: choose from "
            f"{', '.join(RNG_TYPES)}."
        )
    return names


def synchronize_rng_states(rng_types: Sequence[str], generator: torch.Generator | None = None) -> None:
    """Give every process the state process 0's generators are in (python, numpy, torch, cuda, and the
    DataLoader's own `generator`, which seeds its worker processes)."""
    if PartialState().num_processes == 1 or not rng_types:
        return
    states = {name: state for name, state in get_rng_state().items() if name in rng_types and name != "cuda"}
    if "cuda" in rng_types and torch.cuda.is_available():
        # the state of the device process 0 computes on, for the device each process computes on (a list
        # of every device's state would give process r process 0's state of device r, never used there)
        states["cuda_current_device"] = torch.cuda.get_rng_state()
    if "generator" in rng_types and generator is not None:
        states["generator"] = generator.get_state()
    states = ops.broadcast_object_list([states], from_process=0)[0]
    if "generator" in states and generator is not None:
        generator.set_state(states.pop("generator"))
    if "cuda_current_device" in states:
        torch.cuda.set_rng_state(states.pop("cuda_current_device"))
    set_rng_state(states)
