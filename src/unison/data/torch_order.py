"""Each pass's randomness drawn exactly as plain PyTorch draws it, agreed by every process.

At every pass a plain DataLoader first draws its base seed (which seeds its worker processes) from its
`generator`, else from the global torch RNG; then, at the first batch, its RandomSampler draws the
permutation: from the sampler's own generator, else from a fresh generator seeded by one more draw of
the global RNG. A script moved to unison must see that very order, so the default prepared loader
replays these draws in this order, from process 0's generator states (one broadcast per pass, so
processes seeded differently still agree), and leaves every generator where plain PyTorch would: the
global RNG of each process advanced by its own draws, a user's generator in process 0's state after
the pass. The pass's starting states go into the loader's state_dict, so a resumed pass replays the
same order without drawing again (the saved run already did).

`use_seedable_sampler=True` (or a data_seed) keeps the other scheme, a pure function of (seed, epoch):
see `randomness`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import RandomSampler

from .. import ops
from ..state import PartialState


def draw_int64(generator: torch.Generator) -> int:
    """The draw DataLoader and RandomSampler make for a seed, from `generator`."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _replica(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state)
    return generator


@dataclass
class PassStates:
    """Where one pass's draws start: `base`, the state the loader's base seed is drawn from; `shuffle`,
    the state the sampler draws from (its seed, or with the user's generator the permutation itself);
    None when nothing shuffles."""

    base: torch.Tensor
    shuffle: torch.Tensor | None

    def as_dict(self) -> dict[str, torch.Tensor | None]:
        return {"base": self.base, "shuffle": self.shuffle}


class TorchOrderRandomSampler(RandomSampler):
    """The user's RandomSampler (same data, replacement, num_samples and generator), whose generator for
    each pass is handed over by the prepared loader (`pass_generator`) after the agreed draws."""

    def __init__(self, sampler: RandomSampler):
        super().__init__(
            sampler.data_source, sampler.replacement, sampler._num_samples, generator=sampler.generator
        )
        self.pass_generator: torch.Generator | None = None

    def __iter__(self) -> Iterator[int]:
        if self.pass_generator is None:
            raise RuntimeError(
                "this sampler's order is drawn by the prepared DataLoader at the start of each pass; "
                "iterate the prepared loader rather than its sampler."
            )
        # torch's own RandomSampler draws the permutation, so the order is exactly torch's
        source: Sized = self.data_source
        return iter(RandomSampler(source, self.replacement, self._num_samples, generator=self.pass_generator))


class PassDraws:
    """The draws of one prepared loader's passes.

    loader_generator: the prepared loader's own generator, which its inner DataLoader draws the base
    seed from; user_generator: the generator the user gave the DataLoader (None: the global RNG);
    sampler: the shuffle, if the loader has one.
    """

    def __init__(
        self,
        loader_generator: torch.Generator,
        user_generator: torch.Generator | None,
        sampler: TorchOrderRandomSampler | None,
    ):
        self.loader_generator = loader_generator
        self.base_source = user_generator if user_generator is not None else torch.default_generator
        self.sampler = sampler

    @property
    def _shuffle_source(self) -> torch.Generator | None:
        if self.sampler is None:
            return None
        return self.sampler.generator if self.sampler.generator is not None else torch.default_generator

    def begin(self, draws_base_seed: bool = True, saved: PassStates | None = None) -> PassStates:
        """Set up the pass about to start: afresh (process 0's states, every generator advanced as plain
        PyTorch would), or from `saved`, the states of a pass a saved run had begun (nothing drawn but the
        permutation again; the loader restored the user's generators to their saved states already).

        draws_base_seed: False when the inner DataLoader keeps its persistent workers from an earlier
        pass, which draws no base seed in plain PyTorch either.
        """
        states = saved if saved is not None else self._fresh_states(draws_base_seed)
        self.loader_generator.set_state(states.base)
        if self.sampler is None:
            return states
        source = self._shuffle_source
        if source is torch.default_generator:
            self.sampler.pass_generator = torch.Generator().manual_seed(draw_int64(_replica(states.shuffle)))
        else:  # the user's generator draws the permutation itself, from the agreed state
            source.set_state(states.shuffle)
            self.sampler.pass_generator = source
        return states

    def _fresh_states(self, draws_base_seed: bool) -> PassStates:
        sources = [self.base_source] if draws_base_seed else []
        shuffle_source = self._shuffle_source
        if shuffle_source is not None and all(shuffle_source is not s for s in sources):
            sources.append(shuffle_source)
        agreed = process_0_generator_states([source.get_state() for source in sources])
        replicas = [_replica(state) for state in agreed]

        def replica_of(source: torch.Generator) -> torch.Generator:
            return next(r for s, r in zip(sources, replicas) if s is source)

        if draws_base_seed:
            base = replica_of(self.base_source)
            base_state = base.get_state()
            draw_int64(base)
        else:  # any state: the persistent workers never read the base seed again
            base_state = self.loader_generator.get_state()
        shuffle_state = None if shuffle_source is None else replica_of(shuffle_source).get_state()
        # leave the generators where plain PyTorch would
        if draws_base_seed and self.base_source is torch.default_generator:
            draw_int64(torch.default_generator)
        if shuffle_source is torch.default_generator:
            draw_int64(torch.default_generator)
        for source, replica in zip(sources, replicas):
            if source is not torch.default_generator:
                source.set_state(replica.get_state())
        return PassStates(base_state, shuffle_state)


def process_0_generator_states(states: list[torch.Tensor]) -> list[torch.Tensor]:
    """Process 0's generator states (`Generator.get_state()`), on every process: ONE broadcast per pass,
    as Accelerate's synchronize_rng_state sends its generator's state (process_0_states would send two:
    the pickled size, then the bytes). Every process knows the sizes already, from its own generators of
    the same kinds (a CPU generator's state is 5056 bytes, a CUDA one's 16)."""
    if PartialState().num_processes == 1 or not states:
        return states
    flat = torch.cat([state.reshape(-1) for state in states])
    ops.broadcast(flat, from_process=0)
    return [part.clone() for part in flat.split([state.numel() for state in states])]


def process_0_states(states: list[Any]) -> list[Any]:
    """Process 0's generator states, on every process (a few KB, once per pass)."""
    if PartialState().num_processes == 1:
        return states
    return ops.broadcast_object_list([states], from_process=0)[0]
