"""Which numbers a run computes where unison and Accelerate deliberately differ: the switch and its notice.

Two conventions change numbers (docs/migrating-from-accelerate.md, "Deliberate differences"):

- a gradient-accumulation window the loader cuts short after r < k micro-batches: unison averages its
  gradients over the r micro-batches it had; Accelerate divides every micro-batch's loss by k;
- a prepared scheduler with split_batches=False on N > 1 processes: unison steps it once per optimizer
  step; Accelerate steps it N times (its AcceleratedScheduler).

Beside them, the order of a shuffled loader with no generator of its own, on N > 1 processes: unison
draws PyTorch's (one process's) order; Accelerate seeds a generator once at prepare() (data/prepare.py).

`numerics="unison"` (the default) keeps unison's; `numerics="accelerate"`, or the environment variable
UNISON_NUMERICS=accelerate for a script left unchanged, gives Accelerate's for all three, so a migrated
script reproduces its Accelerate run. Under the default, `NumericsNotice.differs` says once per run and
convention, on the main process, the first time a convention changes a number, naming the switch; it
says nothing while the two agree, nor about the order (another permutation drawn, no rule changed).
This module knows only the launch contract (env_vars) and logging.
"""

from __future__ import annotations

import logging
import os

from . import env_vars

logger = logging.getLogger("unison")

UNISON = "unison"
ACCELERATE = "accelerate"
CHOICES = (UNISON, ACCELERATE)

SHORT_WINDOW = "short_window"
SCHEDULER_STEPS = "scheduler_steps"


def check_numerics(value: object, where: str) -> str:
    """`value` as "unison" or "accelerate" (any case); else ValueError naming `where`, value, choices."""
    if not isinstance(value, str) or value.strip().lower() not in CHOICES:
        example = {"numerics": "numerics='accelerate'", "--numerics": "--numerics accelerate"}.get(
            where, f"export {where}=accelerate"
        )
        raise ValueError(
            f"{where}={value!r} is not a numerics convention: choose 'unison' (the default: a short "
            "accumulation window averaged over its own micro-batches, the scheduler stepped once per "
            "optimizer step) or 'accelerate' (Accelerate's numbers: the short window divided by "
            f"gradient_accumulation_steps, the scheduler stepped num_processes times), e.g. {example}."
        )
    return value.strip().lower()


def resolve_numerics(numerics: str | None) -> tuple[str, bool, str | None]:
    """The run's convention, whether the script or its environment chose it (a run that chose one,
    unison's included, is told nothing about Accelerate's numbers), and, when the code overrides
    UNISON_NUMERICS, the line that says so.

    The variable is always read (and a bad value refused, on every process); a code argument given
    wins over it, as every Accelerator argument wins over its UNISON_* variable (env_vars).
    """
    raw = os.environ.get(env_vars.NUMERICS)
    exported = check_numerics(raw, env_vars.NUMERICS) if raw is not None and raw.strip() else None
    if numerics is None:
        return exported or UNISON, exported is not None, None
    chosen = check_numerics(numerics, "numerics")
    if exported is not None and exported != chosen:
        return (
            chosen,
            True,
            (
                f"Accelerator(numerics={chosen!r}) overrides {env_vars.NUMERICS}={exported}: the argument in "
                f"code wins. Remove it from the script to let {env_vars.NUMERICS} choose."
            ),
        )
    return chosen, True, None


class NumericsNotice:
    """One run's convention, and which differences it has already reported (each at most once). The
    notices are for scripts that came from Accelerate and did not choose: `chosen` (numerics= given, or
    UNISON_NUMERICS set) silences them."""

    def __init__(self, numerics: str, is_main_process: bool, chosen: bool = False):
        self.numerics = numerics
        self.is_main_process = is_main_process
        self.chosen = chosen
        self._said: set[str] = set()

    @property
    def accelerate(self) -> bool:
        """True when the run computes Accelerate's numbers."""
        return self.numerics == ACCELERATE

    def differs(self, convention: str, what: str) -> None:
        """Under unison's numbers, say `what` (how this number differs from Accelerate's) once."""
        if self.accelerate or self.chosen or convention in self._said:
            return
        self._said.add(convention)
        if self.is_main_process:
            logger.warning(
                "For scripts written for Hugging Face Accelerate: %s Nothing is wrong otherwise. Set "
                "%s=accelerate (or Accelerator(numerics='accelerate')) for Accelerate's numbers, or "
                "numerics='unison' to keep these and silence this note "
                "(docs/migrating-from-accelerate.md, deliberate differences).",
                what,
                env_vars.NUMERICS,
            )
