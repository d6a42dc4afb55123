"""Seeding, and capturing / restoring every random number generator a training run draws from.

`set_seed` seeds Python's `random`, NumPy's global generator and torch on
every device (`torch.manual_seed` seeds the CPU and all CUDA devices). `get_rng_state` /
`set_rng_state` let a checkpoint resume with exactly the random stream it stopped at; the captured
state holds only tensors, lists and plain numbers, so it loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch

from .environment import detect_layout

logger = logging.getLogger("unison")

SEED_LIMIT = 2**32  # NumPy's global generator accepts seeds in [0, 2**32)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed `random`, NumPy and torch (CPU and every CUDA device) with `seed`.

    device_specific adds the process index, so each process draws a different stream (e.g. for
    data augmentation) while the run stays reproducible. The index is read from the launcher's
    environment rather than from PartialState, so calling set_seed before creating the Accelerator
    neither forms the process group nor fixes the device early.
    deterministic turns on torch.use_deterministic_algorithms (and sets CUBLAS_WORKSPACE_CONFIG,
    which cuBLAS needs for it, unless already set): slower, but bitwise repeatable on GPUs.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} is a {type(seed).__name__}: pass an int, e.g. set_seed(42).")
    offset = detect_layout().rank if device_specific else 0
    if not 0 <= seed + offset < SEED_LIMIT:
        raise ValueError(
            f"seed={seed} (plus process index {offset}) is outside [0, 2**32), the range NumPy accepts: "
            "pick a non-negative seed below 2**32 minus the number of processes."
        )
    seed += offset
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def get_rng_state() -> dict[str, Any]:
    """The state of every generator set_seed seeds, for a checkpoint (restore with set_rng_state).

    CUDA states are captured only once CUDA is initialised, so a CPU run on a GPU machine does not
    create a CUDA context just to save a checkpoint.
    """
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"] = {**numpy_state["state"], "key": numpy_state["state"]["key"].tolist()}
    states["numpy"] = numpy_state
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_state(states: dict[str, Any]) -> None:
    """Restore generator states captured by get_rng_state (missing entries are left as they are)."""
    unknown = set(states) - {"python", "numpy", "torch", "cuda"}
    if unknown:
        raise ValueError(
            f"set_rng_state got unknown entries {sorted(unknown)}: it takes the dict get_rng_state returns "
            "(keys python, numpy, torch, cuda)."
        )
    if "python" in states:
        version, internal, gauss_next = states["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in states:
        numpy_state = states["numpy"]
        key = np.asarray(numpy_state["state"]["key"], dtype=np.uint32)
        np.random.set_state({**numpy_state, "state": {**numpy_state["state"], "key": key}})
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        cuda_states = states["cuda"]
        if len(cuda_states) != torch.cuda.device_count():
            logger.warning(
                "restoring the RNG states of %d CUDA devices on a machine with %d: devices beyond the "
                "smaller count keep their current state",
                len(cuda_states),
                torch.cuda.device_count(),
            )
        for index, state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device=index)
