"""The environment-variable contract between `unison launch` and the library.

`unison launch --mixed-precision bf16 ...` does not talk to the worker processes directly: it exports
the variables below, and `Accelerator()` reads them as its defaults. Arguments given in code always
win. The same variables can be exported by hand, so `python train.py`, torchrun and srun runs can be
configured without touching the script.

The defaults and checks of the values both sides use live here too (the timeouts, the mixed-precision
choices, a peak FLOP/s): this module imports no torch, so the command line's help and its checks of a
flag need none.

| variable                             | Accelerator argument          | values            |
| ------------------------------------ | ----------------------------- | ----------------- |
| UNISON_MIXED_PRECISION               | mixed_precision               | no, bf16, fp16    |
| UNISON_GRADIENT_ACCUMULATION_STEPS   | gradient_accumulation_steps   | integer >= 1      |
| UNISON_CPU                           | cpu                           | 1/true or 0/false |
| UNISON_TIMEOUT                       | timeout (seconds)             | number > 0        |
| UNISON_PARALLELISM                   | parallelism                   | ddp, zeroK, k=v   |
| UNISON_PLUGIN                        | fsdp_plugin / deepspeed_plugin | {"fsdp": {...}}  |
| UNISON_ACTIVATION_CHECKPOINTING      | activation_checkpointing      | full, selective[:K] |
| UNISON_DYNAMO_BACKEND                | dynamo_backend                | no, inductor, ... |
| UNISON_DYNAMO_MODE                   | TorchDynamoPlugin(mode=...)   | default, max-autotune, ... |
| UNISON_NUMERICS                      | numerics                      | unison, accelerate |
| UNISON_DEBUG                         | (none: `unison launch --debug`) | 1/true or 0/false |
| UNISON_PEAK_FLOPS                    | (none: throughput.peak_flops) | FLOP/s > 0, e.g. 1e12 |
| UNISON_CHECKPOINT_GRACE              | (none: checkpoint/stop_signals.py) | seconds >= 0 |
"""

from __future__ import annotations

import math
import os

MIXED_PRECISION = "UNISON_MIXED_PRECISION"
GRADIENT_ACCUMULATION_STEPS = "UNISON_GRADIENT_ACCUMULATION_STEPS"
CPU = "UNISON_CPU"
TIMEOUT = "UNISON_TIMEOUT"
PARALLELISM = "UNISON_PARALLELISM"
ACTIVATION_CHECKPOINTING = "UNISON_ACTIVATION_CHECKPOINTING"  # parallel/checkpointing.py's modes
PLUGIN = "UNISON_PLUGIN"  # JSON: {"fsdp" or "deepspeed": {plugin field: value}}, from Accelerate's flags
NUMERICS = "UNISON_NUMERICS"  # whose numbers where unison and Accelerate differ (numerics.py)
DEBUG = "UNISON_DEBUG"  # check every collective's operation and shapes across ranks (state.debug_mode)
DYNAMO_BACKEND = "UNISON_DYNAMO_BACKEND"  # torch.compile backend of prepare() (parallel/compiling.py)
DYNAMO_MODE = "UNISON_DYNAMO_MODE"
PEAK_FLOPS = "UNISON_PEAK_FLOPS"  # one device's peak FLOP/s for MFU where the table has none (throughput.py)
LAUNCHER_PID = "UNISON_LAUNCHER_PID"  # the process whose elastic agent starts the workers (their parent)
CONFIG_SOURCES = "UNISON_CONFIG_SOURCES"  # JSON {setting: [value, origin]}, for `unison env` (launch_config)
CHECKPOINT_GRACE = "UNISON_CHECKPOINT_GRACE"  # seconds a stopped process finishes its save in flight
INTERRUPTED_SAVE_NOTES = "UNISON_INTERRUPTED_SAVE_NOTES"  # folder: what a stop did to it (launch's line)

ALL = (
    MIXED_PRECISION,
    GRADIENT_ACCUMULATION_STEPS,
    CPU,
    TIMEOUT,
    PARALLELISM,
    ACTIVATION_CHECKPOINTING,
    PLUGIN,
    NUMERICS,
    DEBUG,
    DYNAMO_BACKEND,
    DYNAMO_MODE,
    PEAK_FLOPS,
    LAUNCHER_PID,
    CONFIG_SOURCES,
    CHECKPOINT_GRACE,
    INTERRUPTED_SAVE_NOTES,
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default).strip() or default


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; export a whole number, e.g. {name}=2.") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; export seconds such as {name}=600.") from None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; export {name}=1 or {name}=0.")


DEFAULT_TIMEOUT_SECONDS = 300.0
"""How long a rank may wait in one collective once training runs (after the first optimizer step)
before the hang watchdog reports a stall: a step, an evaluation or a checkpoint that rank 0 writes alone
while the others wait fits in it on any reasonable setup."""
DEFAULT_FIRST_STEP_TIMEOUT_SECONDS = 900.0
"""The same limit until the first optimizer step: start-up may compile, warm data pipelines up or have
rank 0 download what the others wait for. An explicit timeout applies to both."""

DEFAULT_CHECKPOINT_GRACE_SECONDS = 20.0
"""How long a process told to stop (SIGINT, SIGTERM) while an asynchronous save is in flight keeps
writing it before abandoning it (checkpoint/stop_signals.py). Under the 30 s that torch's elastic agent,
SLURM (KillWait) and Kubernetes (terminationGracePeriodSeconds) give by default between SIGTERM and
SIGKILL, with room to end after it."""
STOP_MARGIN_SECONDS = 10
"""What `unison launch` lets its workers take beyond the grace to end, before its agent SIGKILLs them."""


def checkpoint_grace_seconds() -> float:
    """UNISON_CHECKPOINT_GRACE, or its default; a ValueError naming the fix for a negative or non-number."""
    grace = env_float(CHECKPOINT_GRACE, DEFAULT_CHECKPOINT_GRACE_SECONDS)
    if not (math.isfinite(grace) and grace >= 0):
        raise ValueError(
            f"{CHECKPOINT_GRACE}={os.environ[CHECKPOINT_GRACE]!r}: give the seconds (0 or more) a process "
            f"told to stop may spend finishing the checkpoint it is saving, e.g. {CHECKPOINT_GRACE}=60."
        )
    return grace


MIXED_PRECISION_CHOICES = ("no", "bf16", "fp16")


def validate_mixed_precision(value: str) -> str:
    normalised = str(value).lower()
    if normalised not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"mixed_precision={value!r} is unknown: choose one of {', '.join(MIXED_PRECISION_CHOICES)} "
            "(bf16 works on CPUs and recent GPUs; fp16 needs a GPU to be fast)."
        )
    return normalised


def check_peak_flops(value: float | str, name: str = "peak_flops") -> float:
    """`value` as a float if it is a finite number of FLOP/s above 0, else a ValueError naming the fix."""
    try:
        peak = float(value)
    except (TypeError, ValueError):
        peak = math.nan
    if not (math.isfinite(peak) and peak > 0):
        raise ValueError(
            f"{name}={value!r} is not a positive number of FLOP/s: give one device's peak, e.g. 1e12 for "
            "1 TFLOP/s (an H100's dense bf16 peak is 989e12)."
        )
    return peak
