"""Prepared data loaders: real DataLoader subclasses that know where they stand in the epoch.

A prepared loader reads one batch ahead, so while the training loop processes the last batch of the
epoch `end_of_dataloader` is already True: the Accelerator forces the gradient synchronisation on
it, and gather_for_metrics drops the samples that topped up the final round (`remainder`). While it
is being iterated the loader registers itself in GradientState, which is how the Accelerator finds
it. The epoch counter lives with the loader: each pass first hands the epoch to the sampler and
the dataset (so every process shuffles alike) and a complete pass advances it, so a script that
never calls set_epoch still gets a new order every epoch.

A loader also knows how far into the epoch it is (batches handed to the user, not the one read
ahead), which `state_dict` reports in units that do not depend on the number of processes:
global samples consumed. `load_state_dict` makes the next pass continue there, skipping in the
sampler where there is one. Each loader owns its torch.Generator, reseeded from (seed, epoch) at
every pass, so creating an iterator never draws from the global RNG (torch draws the worker seed
from `generator`, else from the global stream, which would make a resumed run's dropout diverge).

A loader that deals its processes unequal numbers of batches (even_batches=False) may carry an
`unjoined_warning` from prepare(): said once, at the first pass that starts outside torch's Join
(`joined` is set by join_uneven_inputs), where the processes' collectives would no longer match.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from .. import ops
from ..state import GradientState, PartialState
from .randomness import SeedableRandomSampler, check_rng_types, epoch_seed, synchronize_rng_states
from .replay import ReplayedSampler, own_generator
from .sharding import SkipBatchSampler
from .top_ups import completed_pass, note_pass
from .torch_order import PassDraws, PassStates, TorchOrderRandomSampler

logger = logging.getLogger("unison")

_END = object()
_WORKER_SALT = 0x5851F42D4C957F2D  # worker seeds apart from the shuffle drawn from the same (seed, epoch)
STATE_KEYS = (
    "epoch",
    "samples_consumed",
    "end_of_epoch",
    "order",
    "seed",
    "pass_states",
    "worker_seed",
    "total_batch_size",
)

# DataLoader settings a re-created loader carries over unchanged (those this torch version has)
CARRIED_SETTINGS = [
    name
    for name in (
        "num_workers",
        "collate_fn",
        "pin_memory",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    )
    if name in inspect.signature(DataLoader.__init__).parameters
]


def carried_settings(dataloader: DataLoader) -> dict[str, Any]:
    return {name: getattr(dataloader, name) for name in CARRIED_SETTINGS if hasattr(dataloader, name)}


@dataclass
class LoaderProgress:
    """Where a prepared loader stands; shared with the loaders skip_first_batches derives from it,
    so finishing a resumed epoch advances the original loader too (and saving the original saves
    the copy's position).

    batches: batches of `epoch` handed out in the latest pass, counted from the epoch's start (a
    skipped start included); end_of_epoch: that pass handed out its last batch; resume: the next
    pass continues after `batches` instead of starting the epoch afresh (set by load_state_dict);
    pass_states: where the draws of `epoch`'s pass began (PyTorch's order only; None until it begins);
    sampler_draws: where the draws of the pass's samplers of the user's own began (see replay), one
    dict per ReplayedSampler, None until the pass begins. completed_epoch: an epoch that a loaded state
    had handed out completely (saved on its last batch); the loader stands at the next epoch's start,
    as the uninterrupted run did, and a set_epoch back to it gives that epoch's empty remainder.
    """

    epoch: int = 0
    batches: int = 0
    end_of_epoch: bool = False
    resume: bool = False
    pass_states: PassStates | None = None
    sampler_draws: list[dict[str, torch.Tensor | None]] | None = None
    completed_epoch: int | None = None

    def move_to(self, epoch: int) -> None:
        """Go to `epoch`; another epoch than the current one starts from its beginning (a loaded,
        completed one has nothing left)."""
        if epoch != self.epoch:
            completed = epoch == self.completed_epoch
            self.epoch, self.batches, self.end_of_epoch, self.resume = epoch, 0, completed, completed
            self.pass_states = self.sampler_draws = None


def find_in_chain(root: Any, kind: type) -> Any | None:
    """The first object of type `kind` among root and the samplers it wraps (.batch_sampler/.sampler)."""
    for sampler in _sampler_chain(root):
        if isinstance(sampler, kind):
            return sampler
    return None


def _sampler_chain(root: Any) -> Iterator[Any]:
    seen: set[int] = set()
    pending = [root]
    while pending:
        sampler = pending.pop(0)
        if sampler is None or id(sampler) in seen:
            continue
        seen.add(id(sampler))
        yield sampler
        pending += [getattr(sampler, "batch_sampler", None), getattr(sampler, "sampler", None)]


class PreparedDataLoader(DataLoader):
    """What DataLoaderShard and DataLoaderDispatcher share: look-ahead, epochs, position, device placement.

    Subclasses provide `_batches(skip)`, this process's batches on the host from the `skip`-th on,
    `_final_remainder()`, read once the last batch is known, `_epoch_length()`, `samples_per_step` and
    `_even_deal()`. A complete pass notes what it dealt the processes in GradientState (see top_ups).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        device: torch.device | str | None = None,
        non_blocking: bool = False,
        rng_types: Sequence[str] | None = None,
        skip_batches: int = 0,
        progress: LoaderProgress | None = None,
        use_seedable_sampler: bool = False,
        **loader_kwargs: Any,
    ):
        self._init_kwargs = dict(
            dataset=dataset,
            device=device,
            non_blocking=non_blocking,
            rng_types=rng_types,
            skip_batches=skip_batches,
            use_seedable_sampler=use_seedable_sampler,
            **loader_kwargs,
        )
        super().__init__(dataset, **loader_kwargs)
        self.device = None if device is None else torch.device(device)
        self.non_blocking = non_blocking
        self.rng_types = check_rng_types(rng_types)
        self.skip_batches = skip_batches
        self.progress = progress if progress is not None else LoaderProgress()
        self.gradient_state = GradientState()
        self.end_of_dataloader = False
        self.remainder = -1
        self.last_batch_gathered = False  # gather_for_metrics dropped the final round's repeats itself
        # The loader's own generator (see the module docstring). Without a shuffle seed to derive it
        # from, the user's generator's seed decides it, else torch's initial seed (set_seed sets it).
        user_generator = loader_kwargs.get("generator")
        self.worker_seed = (
            user_generator.initial_seed() if user_generator is not None else torch.initial_seed()
        )
        self.generator = torch.Generator()
        self._user_generator = user_generator
        self.use_seedable_sampler = use_seedable_sampler
        self._draws = None
        if not use_seedable_sampler:
            shuffle = find_in_chain(self._index_sampler, TorchOrderRandomSampler)
            self._draws = PassDraws(self.generator, user_generator, shuffle)
        self._passes_begun = 0
        self.unjoined_warning: str | None = None
        self.joined = False

    def _clone(self, **overrides: Any) -> PreparedDataLoader:
        """A loader like this one (same kind, same arguments, same progress) with some arguments changed."""
        clone = type(self)(**{**self._init_kwargs, "progress": self.progress, **overrides})
        clone.worker_seed = self.worker_seed
        return clone

    # torch's DataLoader stores batch_size=None whenever a batch sampler is given; a prepared loader
    # reports the batch size each process actually receives.
    @property
    def batch_size(self) -> int | None:
        return self._process_batch_size()

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:  # called once, by DataLoader.__init__
        self._loader_batch_size = value

    def _process_batch_size(self) -> int | None:
        return self._loader_batch_size

    @property
    def samples_per_step(self) -> int:
        """Items of the dataset all processes consume together per batch: total_batch_size where the
        batch size is known, else one item of the index sampler per process (a batch_size=None
        loader's items, or the batches of a custom batch sampler without a batch_size)."""
        raise NotImplementedError

    def _epoch_length(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        """Batches of this process's next pass (a skip_first_batches copy's first pass is shorter)."""
        return max(self._epoch_length() - self.skip_batches, 0)

    @property
    def epoch(self) -> int:
        """The epoch the current (or next) pass uses; advanced by one after each complete pass."""
        return self.progress.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.progress.move_to(int(value))

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch` for the next pass, and tell the samplers and the dataset (their set_epoch).

        The current epoch keeps a position restored by load_state_dict; another epoch starts afresh.
        """
        self.epoch = epoch
        for sampler in _sampler_chain(self._index_sampler):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _shuffle_sampler(self) -> SeedableRandomSampler | None:
        return find_in_chain(self._index_sampler, SeedableRandomSampler)

    def _replayed_samplers(self) -> list[ReplayedSampler]:
        return [s for s in _sampler_chain(self._index_sampler) if isinstance(s, ReplayedSampler)]

    def _user_generators(self) -> list[torch.Generator]:
        """The generators of the user's that this loader's passes draw from and advance: the DataLoader's
        `generator` and those of its samplers, in a fixed order (a SeedableRandomSampler's is its own)."""
        chain = _sampler_chain(self._index_sampler)
        samplers = [s for s in chain if not isinstance(s, SeedableRandomSampler)]
        found = [self._user_generator, *map(own_generator, samplers)]
        unique: list[torch.Generator] = []
        for generator in found:
            if generator is not None and all(generator is not g for g in unique):
                unique.append(generator)
        return unique

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, in units that do not depend on the number of processes.

        epoch; samples_consumed: the epoch's samples already handed out to all processes together
        (batches yielded x samples_per_step; 0 between epochs); end_of_epoch: the epoch's last batch
        was handed out (a save on the last step resumes at the next epoch whatever the new split);
        seed: the shuffle seed (None without shuffling); worker_seed: what seeds the workers when
        nothing shuffles; total_batch_size: this loader's samples_per_step, for error messages.
        order: "seedable" or "torch" (use_seedable_sampler); pass_states (PyTorch's order): the generator
        states the epoch's pass began from, {"base": ..., "shuffle": ...}, or None before it began;
        sampler_draws: the same for samplers of the user's own (replay), or None; generators: the states
        of the user's generators now (the DataLoader's and its samplers'), which a resumed run restores
        as it restores the global RNG, so the epoch after the saved one draws what it would have drawn.
        Ints, bools, strings, None and CPU tensors: it loads with torch.load(weights_only=True).
        """
        progress, shuffle = self.progress, self._shuffle_sampler()
        began = progress.pass_states
        return {
            "epoch": progress.epoch,
            "samples_consumed": progress.batches * self.samples_per_step,
            "end_of_epoch": progress.end_of_epoch,
            "order": self._order,
            "seed": None if shuffle is None else shuffle.seed,
            "pass_states": None if began is None else began.as_dict(),
            "worker_seed": self.worker_seed,
            "total_batch_size": self.samples_per_step,
            "sampler_draws": progress.sampler_draws,
            "generators": [generator.get_state() for generator in self._user_generators()],
        }

    @property
    def _order(self) -> str:
        return "seedable" if self.use_seedable_sampler else "torch"

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise a ValueError, changing nothing, unless this loader can continue from `state`: it must
        come from a prepared loader of the same order scheme and shuffle setting, at a position that is a
        whole number of this loader's steps (a global batch that divides the samples consumed).
        Accelerator.load_state checks every loader this way before it applies anything."""
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"this data loader state lacks {missing}: load_state_dict takes the dict a prepared "
                f"loader's state_dict() returns (keys {', '.join(STATE_KEYS)})."
            )
        if state["order"] != self._order:
            flag = {"seedable": True, "torch": False}
            raise ValueError(
                f"the data loader state comes from a loader with "
                f"use_seedable_sampler={flag[state['order']]}, "
                f"but this one has use_seedable_sampler={flag[self._order]}: the two draw their orders "
                "differently, so the saved order could not be continued. Prepare the loader with the saved "
                "run's setting (DataLoaderConfiguration(use_seedable_sampler=...))."
            )
        shuffle, seed = self._shuffle_sampler(), state["seed"]
        began = state["pass_states"]
        shuffles_here, saved_shuffled = shuffle is not None, seed is not None
        if began is not None and self._draws is not None:  # PyTorch's order: did the saved pass shuffle?
            shuffles_here, saved_shuffled = self._draws.sampler is not None, began["shuffle"] is not None
        if saved_shuffled != shuffles_here:
            saved, here = ("shuffled", "does not") if saved_shuffled else ("did not shuffle", "does")
            raise ValueError(
                f"the data loader state comes from a loader that {saved}, but this one {here}: "
                "the order could not be reproduced. Prepare the same DataLoader (shuffle setting) as the "
                "saved run, or load the state into the loader it was saved from."
            )
        saved_generators, generators = state.get("generators"), self._user_generators()
        if saved_generators is not None and len(saved_generators) != len(generators):
            raise ValueError(
                f"the data loader state holds {len(saved_generators)} generator states, but this loader "
                f"draws from {len(generators)} generators of yours (the DataLoader's `generator` and its "
                "samplers'): it was saved from a loader built another way. Build the DataLoader as the "
                "saved run did (the same generator= arguments), or load the state into the loader it was "
                "saved from."
            )
        consumed, step = int(state["samples_consumed"]), self.samples_per_step
        if consumed % step and not state["end_of_epoch"]:
            raise ValueError(
                f"cannot resume this {type(self).__name__} at samples_consumed={consumed}: that is not a "
                f"multiple of its total_batch_size={step} (the saved loader's was "
                f"{state['total_batch_size']}), so the saved position falls inside one of this loader's "
                "steps and no whole number of batches can be skipped. Resume with a number of processes "
                f"(or per-process batch size) whose global batch divides {consumed}, or save at a step "
                "where it does."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` (from state_dict, maybe of another number of processes) stood.

        The next pass yields exactly the batches the saved loader had not yet handed out, in the same
        order, skipping the others in the sampler (a stream, or data read by worker processes, is read
        through: see reads_through). A state saved on an epoch's last batch leaves the loader at the
        next epoch's start (`epoch` is the next one), where the uninterrupted run stood once its loop
        moved on: a loop that counts epochs itself and calls set_epoch with the saved one gets that
        epoch's empty remainder, a loop that just iterates gets the next epoch. The user's generators are
        set to their saved states at once, as the global RNG is: the passes after the resumed one draw
        from there. A state this loader cannot continue (see check_state_dict) is a ValueError: nothing is
        changed then.
        """
        self.check_state_dict(state)
        shuffle, seed = self._shuffle_sampler(), state["seed"]
        began = state["pass_states"]
        consumed, step = int(state["samples_consumed"]), self.samples_per_step
        if shuffle is not None:
            shuffle.seed = int(seed)
        self.worker_seed = int(state["worker_seed"])
        progress = self.progress
        progress.epoch, progress.batches, progress.resume = int(state["epoch"]), consumed // step, True
        progress.pass_states = None if began is None else PassStates(**began)
        progress.sampler_draws = state.get("sampler_draws")
        progress.end_of_epoch, progress.completed_epoch = False, None
        if state["end_of_epoch"]:  # saved on the epoch's last batch: the next epoch is where the run stood
            progress.move_to(progress.epoch + 1)
            progress.completed_epoch = progress.epoch - 1
        for generator, saved in zip(self._user_generators(), state.get("generators") or ()):
            generator.set_state(saved)

    def _begin_draws(self, resumed: bool, finished: bool) -> None:
        """Set this pass's generators: PyTorch's draws (see torch_order), or (seed, epoch)'s; a resumed
        pass's samplers of the user's own replay theirs. A resumed pass that was complete draws nothing:
        the generators are already where the saved run's were after it (load_state_dict)."""
        if finished:
            return
        if resumed:
            for sampler, states in zip(self._replayed_samplers(), self.progress.sampler_draws or ()):
                sampler.replay = states
        if self._draws is None:
            shuffle = self._shuffle_sampler()
            seed = self.worker_seed if shuffle is None else shuffle.seed
            self.generator.manual_seed(epoch_seed(seed, self.epoch) ^ _WORKER_SALT)
            return
        saved = self.progress.pass_states if resumed else None
        # persistent workers are started (and seeded) by a loader's first pass only, as in torch
        keeps_workers = self.persistent_workers and self.num_workers > 0 and self._passes_begun > 0
        self.progress.pass_states = self._draws.begin(draws_base_seed=not keeps_workers, saved=saved)
        self._passes_begun += 1

    def _batches(self, skip: int) -> Iterator[Any]:
        raise NotImplementedError

    def _final_remainder(self) -> int:
        raise NotImplementedError

    def _even_deal(self) -> tuple[int, int] | None:
        """(processes, rows per batch) where every process gets as many batches of that many rows in a
        pass (even_batches or drop_last, a known batch size); None otherwise."""
        raise NotImplementedError

    def _note_completed_pass(self, batches: int) -> None:
        """What this complete pass of `batches` batches dealt each process, for gather_for_metrics after
        the loop (see top_ups); a pass dealt unevenly or of unknown sizes is not noted, nor one whose last
        batch gather_for_metrics already gathered: its repeats are dropped, and a later gather of rows of
        the same length (another loader's, unprepared) must not lose rows by matching it."""
        deal = self._even_deal()
        noted = deal is not None and not self.last_batch_gathered
        record = completed_pass(batches, *deal, self.remainder) if noted else None
        note_pass(self.gradient_state.completed_passes, self, record)

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        return ops.send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def _start_of_pass(self) -> tuple[int, bool]:
        """(batches to skip, whether the epoch was already handed out completely) for the pass starting."""
        progress, skip = self.progress, self.skip_batches
        self.skip_batches = 0
        if progress.epoch != progress.completed_epoch:
            progress.completed_epoch = None  # the run has gone past the loaded epoch
        if progress.resume:
            progress.resume = False
            return progress.batches, progress.end_of_epoch
        progress.batches, progress.end_of_epoch = skip, False
        return skip, False

    def __iter__(self) -> Iterator[Any]:
        self.set_epoch(self.epoch)
        resumed = self.progress.resume
        skip, finished = self._start_of_pass()
        self._begin_draws(resumed, finished)
        synchronize_rng_states(self.rng_types, self.generator)
        self.end_of_dataloader = False
        self.remainder = -1
        self.last_batch_gathered = False
        if self.unjoined_warning is not None and not self.joined:
            if PartialState().is_main_process:  # every process would say the same
                logger.warning(self.unjoined_warning)
            self.unjoined_warning = None
        self.gradient_state._add_dataloader(self)
        note_pass(self.gradient_state.completed_passes, self, None)  # its last pass is no longer the latest
        try:
            batches = iter(()) if finished else self._batches(skip)
            current = next(batches, _END)
            if not finished:  # the samplers began their pass at the first batch: where they drew from
                self.progress.sampler_draws = [s.began for s in self._replayed_samplers()] or None
            while current is not _END:
                current = self._place(current)
                upcoming = next(batches, _END)  # read ahead: is `current` the last batch?
                if upcoming is _END:
                    self.remainder = self._final_remainder()
                    self.end_of_dataloader = True
                self.progress.batches += 1  # counted as handed out: the user has it once we yield
                self.progress.end_of_epoch = self.end_of_dataloader
                yield current
                current = upcoming
            self._note_completed_pass(self.progress.batches - skip)
            self.epoch += 1
        finally:
            self.gradient_state._remove_dataloader(self)


def reads_through(loader: DataLoader) -> bool:
    """Whether a resumed pass must read the batches it skips rather than skip them in the sampler: a
    stream cannot be skipped unread, and worker processes draw from random streams of their own (an
    augmentation in __getitem__), which the skipped batches advance. Read through, every worker reads
    what it read in the saved run, in the same order, so the batches after the skipped ones are the
    saved run's to the last random bit; the price is loading the skipped batches."""
    return isinstance(loader.dataset, IterableDataset) or loader.num_workers > 0


def skipping_loader(loader: DataLoader, skip: int) -> DataLoader:
    """A plain DataLoader over `loader`'s map-style data and settings whose pass skips `skip` batches in
    the sampler: the skipped batches are never loaded."""
    settings = carried_settings(loader)
    if loader._auto_collation:
        return DataLoader(
            loader.dataset, batch_sampler=SkipBatchSampler(loader.batch_sampler, skip), **settings
        )
    return DataLoader(
        loader.dataset, sampler=SkipBatchSampler(loader.sampler, skip), batch_size=None, **settings
    )
