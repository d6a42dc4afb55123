"""Throughput and model FLOPs utilisation (MFU): tokens/s, samples/s, and the share of the devices' peak.

MFU as nanoGPT and PaLM (Chowdhery et al. 2022, appendix B) count it: a transformer's training step
costs 6·N FLOPs per token for the matrix multiplications with its N weights (forward 2N, backward 4N)
plus 12·L·d·T for attention's scores and weighted sum (L blocks of width d over T tokens of context);
recomputation is not counted. The peak is the device's dense bf16 rate from the table below (NVIDIA's
data sheets), or one given by the user (`peak_flops(device, override=...)`, or UNISON_PEAK_FLOPS, which
`unison launch --peak-flops X` exports); a CPU has no entry, so without one no MFU is shown there.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch

from .. import env_vars
from ..env_vars import check_peak_flops as check_peak_flops

PEAK_BF16_FLOPS = {
    "B200": 2250e12,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
}
"""Dense bf16 FLOP/s per device, by a name torch.cuda.get_device_name contains; the first match wins,
so a more specific name comes before the family's."""


def peak_flops(device: torch.device, override: float | str | None = None) -> float | None:
    """One device's peak FLOP/s: `override` if given, else UNISON_PEAK_FLOPS if set, else the dense bf16
    peak from PEAK_BF16_FLOPS; None where none is known (a CPU, an unlisted GPU), so MFU is not shown."""
    if override is not None:
        return check_peak_flops(override)
    if os.environ.get(env_vars.PEAK_FLOPS, "").strip():
        return check_peak_flops(os.environ[env_vars.PEAK_FLOPS].strip(), env_vars.PEAK_FLOPS)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def transformer_flops_per_token(parameters: int, layers: int, width: int, context: int) -> float:
    """Training FLOPs per token: 6·N + 12·L·d·T (module docstring)."""
    for name, value in (
        ("parameters", parameters),
        ("layers", layers),
        ("width", width),
        ("context", context),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: a whole number >= 1 of the model's {name}.")
    return 6.0 * parameters + 12.0 * layers * width * context


class Throughput:
    """Tokens/s, samples/s and MFU over the steps since the meter started (or was reset).

    The loop reports what each step processed; the meter reads the clock itself:

        meter = Throughput(flops_per_token=transformer_flops_per_token(n, 12, 768, 1024),
                           peak_flops=peak_flops(accelerator.device), devices=accelerator.num_processes)
        for batch in loader:
            ...
            meter.step(tokens=batch_tokens_on_all_processes, samples=batch_size_on_all_processes)
            accelerator.log(meter.compute(), step=step)
            with meter.paused():  # not training time: left out of the rates
                evaluate(...)

    MFU is None where the peak is unknown (a CPU) or no FLOPs per token were given.
    """

    def __init__(
        self, flops_per_token: float | None = None, peak_flops: float | None = None, devices: int = 1
    ):
        if devices < 1:
            raise ValueError(f"devices={devices!r}: the number of devices the tokens were spread over, >= 1.")
        self.flops_per_token, self.peak, self.devices = flops_per_token, peak_flops, devices
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (e.g. after warm-up or compilation steps)."""
        self.started = time.perf_counter()
        self.tokens = self.samples = self.steps = 0

    def step(self, tokens: int = 0, samples: int = 0) -> None:
        """One step done, that processed `tokens` tokens and `samples` samples (over all processes)."""
        self.tokens += tokens
        self.samples += samples
        self.steps += 1

    @property
    def elapsed(self) -> float:
        """Seconds counted since the start, without the time spent in `paused()`."""
        return time.perf_counter() - self.started

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count: an evaluation or a checkpoint between steps is not training,
        and would otherwise lower the tokens/s and MFU of the steps around it."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - began

    def compute(self) -> dict[str, float]:
        """{"tokens_per_s", "samples_per_s", "mfu" (when known)} since the start."""
        elapsed = max(self.elapsed, 1e-9)
        result = {"tokens_per_s": self.tokens / elapsed, "samples_per_s": self.samples / elapsed}
        if self.flops_per_token is not None and self.peak is not None:
            result["mfu"] = result["tokens_per_s"] * self.flops_per_token / (self.peak * self.devices)
        return result
