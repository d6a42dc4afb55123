"""A pipeline stage's block list: this stage's blocks under their original names, run by the model's loop.

unison.parallel.pipeline_split gives each stage a copy of the model's containers; the block list in that
copy is one of these. Outside a stage's forward it is an ordinary nn.ModuleList (or nn.Sequential) of
this stage's blocks, keyed by their original names ("2", "3"), which FSDP2, tensor parallel,
activation checkpointing and compile see and wrap as usual. During the stage's forward, iterating it
(`for block in self.layers`, `self.layers[:n]`, nn.Sequential's own forward) yields, in order:

- this stage's blocks, the first of them (on a later stage) called with the activations received from
  the previous stage in place of the tensors among its positional arguments;
- on every stage but the last, a stand-in for the next stage's first block that ends the forward,
  handing the tensors among that call's positional arguments to the stage (`StageExit`), to be sent on.

The other stages' blocks are skipped, as torchtitan's models skip the layers a stage deleted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten


class StageExit(BaseException):
    """Raised where the next stage's first block is called; args[0]: that call's positional tensors.

    A BaseException, as StopIteration's cousins GeneratorExit and KeyboardInterrupt are: it ends the
    stage's forward, it is no error, and a model's own `except Exception:` around its blocks (a
    fallback path, a logging wrapper) must not catch it and run on past the stage boundary."""


def _any_nan(value: Any) -> bool:
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            flag = torch.isnan(leaf).any()
            if bool(flag.full_tensor() if hasattr(flag, "full_tensor") else flag):
                return True
    return False


class StageRun:
    """What one forward of a stage shares with its block list and stand-ins (a plain object).

    `checking`: until a later stage's first forward on finite activations has completed, the values
    recomputed on the stage and given to its blocks are checked for the NaN of the embeddings'
    stand-in (see pipeline_split); once is enough, the model's code does not change between calls.
    """

    def __init__(self, stage_index: int):
        self.stage_index = stage_index
        self.active = False
        self.received: tuple[torch.Tensor, ...] = ()
        self.entered = False
        self.checking = stage_index > 0
        self.check_now = False

    def start(self, received: tuple[torch.Tensor, ...]) -> None:
        self.active, self.received, self.entered = True, received, self.stage_index == 0
        # torch's first call sizes the buffers on uninitialised activations, which may hold NaN
        self.check_now = self.checking and not _any_nan(received)

    def stop(self) -> None:
        self.active, self.received = False, ()

    def finish(self) -> None:
        """A forward ended where it should (at the next stage's first block, or the model's end)."""
        if not self.entered:
            raise RuntimeError(
                f"the model's forward on pipeline stage {self.stage_index} never called the stage's first "
                "block: a stage reaches its blocks through the model iterating its block list "
                "(for block in self.layers), not by index."
            )
        if self.check_now:
            self.checking = False

    def refuse_stand_in_values(self, where: str, args: Sequence[Any], kwargs: dict, first: int) -> None:
        """Raise if a block gets a value (positional from `first` on, or keyword) computed from an
        earlier stage's stand-in: it was computed before the split from the embeddings' output."""
        if not self.check_now:
            return
        positional = [(f"positional argument {i}", a) for i, a in enumerate(args) if i >= first]
        named = [*positional, *kwargs.items()]
        for name, value in named:
            if _any_nan(value):
                raise ValueError(
                    f"{where} on pipeline stage {self.stage_index} gets {name!r} computed before the "
                    "model's blocks from the output of a module of stage 0 (e.g. from the embeddings), "
                    "which a later stage does not have: only the positional arguments of the call where "
                    "a stage begins travel between stages, and what the model computes from its inputs "
                    "alone (positions, masks, rotary tables) is recomputed on every stage. Compute it "
                    "inside the blocks or from the model's inputs only."
                )


class _BlockCall:
    """This stage's block as the model's loop sees it: the first one takes the received activations."""

    def __init__(self, block: nn.Module, path: str, entry: bool, run: StageRun):
        self.block, self.path, self.entry, self.run = block, path, entry, run

    def __getattr__(self, name: str) -> Any:  # the model may read a block's attributes (attention_type)
        return getattr(self.block, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.entry:
            args, self.run.entered = self._with_received(args), True
        self.run.refuse_stand_in_values(self.path, args, kwargs, len(args) if self.entry else 1)
        return self.block(*args, **kwargs)

    def _with_received(self, args: tuple) -> tuple:
        """The positional arguments with their tensors, in order, replaced by the received ones (the
        others, e.g. Hugging Face GPT-2's positional Nones, are the model's own on this stage too)."""
        count = sum(isinstance(a, torch.Tensor) for a in args)
        if count != len(self.run.received):
            raise ValueError(
                f"{self.path} on pipeline stage {self.run.stage_index} is called with {count} positional "
                f"tensors, but the previous stage sent {len(self.run.received)}: the model must call its "
                "blocks the same way on every stage."
            )
        received = iter(self.run.received)
        return tuple(next(received) if isinstance(a, torch.Tensor) else a for a in args)


class _NextStage:
    """Stands where the next stage's first block is called: ends the forward, handing the tensors among
    its positional arguments on (the rest, and its keyword arguments, are the model's own on the next
    stage too). Answers reads of that block's plain attributes (a snapshot taken at the split), since
    the model may read them first."""

    def __init__(self, path: str, attributes: dict[str, Any], run: StageRun):
        self.path, self.attributes, self.run = path, attributes, run

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["attributes"][name]
        except KeyError:
            message = f"{self.path} (on the next pipeline stage) has no plain attribute {name!r}"
            raise AttributeError(message) from None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError(
                f"{self.path}, where a pipeline stage begins, is called with positional arguments of types "
                f"{[type(a).__name__ for a in args]}: the activations must come first, as a tensor (the "
                "positional tensors travel between stages; keyword arguments are recomputed on each)."
            )
        self.run.refuse_stand_in_values(self.path, args, {}, 1)
        raise StageExit(tuple(a for a in args if isinstance(a, torch.Tensor)))


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    items = vars(module).items()
    return {k: v for k, v in items if not k.startswith("_") and not isinstance(v, torch.Tensor)}


class _StageBlocks:
    """The behaviour StageBlockList and StageBlockSequential add to their torch container."""

    def _setup(
        self,
        positions: Sequence[int],
        total: int,
        run: StageRun,
        path: str,
        successor: nn.Module | None,
        successor_path: str | None,
    ) -> None:
        self._positions = list(positions)  # original index of each block held, in order
        self._total = total
        self._run = run
        self._path = path
        self._successor_path = successor_path
        self._successor_attributes = None if successor is None else _plain_attributes(successor)

    def _key(self, position: int) -> str:
        return [name for name, _ in self.named_children()][self._positions.index(position)]

    def _calls(self, positions: Sequence[int]) -> list[Any]:
        """What the model's loop gets for these original positions, during the stage's forward."""
        calls: list[Any] = []
        first = self._positions[0]
        for position, (name, block) in zip(self._positions, self.named_children()):
            if position in positions:
                entry = position == first and self._run.stage_index > 0
                calls.append(_BlockCall(block, f"{self._path}.{name}", entry, self._run))
        successor = self._positions[-1] + 1
        if self._successor_path is not None and successor in positions:
            calls.append(_NextStage(self._successor_path, self._successor_attributes, self._run))
        return calls

    def _absent(self, position: int) -> IndexError:
        return IndexError(
            f"{self._path}[{position}] is not on this pipeline stage (it holds blocks {self._positions}): "
            "a stage reaches its blocks through the model iterating its block list "
            "(for block in self.layers, or a slice of it), not by index."
        )

    def __iter__(self) -> Iterator[Any]:
        if not self._run.active:
            return super().__iter__()
        return iter(self._calls(range(self._total)))

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            if self._run.active:
                return self._calls(range(self._total)[index])
            blocks = [block for _, block in self.named_children()]
            return self._positions_of(index, blocks)
        position = index + self._total if index < 0 else index
        if self._run.active:
            calls = self._calls([position])
            if not calls:
                raise self._absent(index)
            return calls[0]
        if position not in self._positions:
            raise self._absent(index)
        return self.get_submodule(self._key(position))

    def _positions_of(self, index: slice, blocks: list[nn.Module]) -> nn.Module:
        """The blocks held at the original positions `index` selects, in a plain torch container."""
        chosen = [b for p, b in zip(self._positions, blocks) if p in range(self._total)[index]]
        return nn.Sequential(*chosen) if isinstance(self, nn.Sequential) else nn.ModuleList(chosen)

    def __setitem__(self, index: int, module: nn.Module) -> None:
        position = index + self._total if index < 0 else index
        if position not in self._positions:
            raise self._absent(index)
        self.register_module(self._key(position), module)


class StageBlockList(_StageBlocks, nn.ModuleList):
    """A stage's blocks from an nn.ModuleList (see the module docstring)."""

    def __init__(self, blocks: dict[str, nn.Module], positions: Sequence[int], total: int, **where: Any):
        nn.ModuleList.__init__(self)
        for name, block in blocks.items():
            self.add_module(name, block)
        self._setup(positions, total, **where)


class StageBlockSequential(_StageBlocks, nn.Sequential):
    """A stage's blocks from an nn.Sequential, whose own forward iterates them (see the module docstring)."""

    def __init__(self, blocks: dict[str, nn.Module], positions: Sequence[int], total: int, **where: Any):
        nn.Sequential.__init__(self)
        for name, block in blocks.items():
            self.add_module(name, block)
        self._setup(positions, total, **where)
