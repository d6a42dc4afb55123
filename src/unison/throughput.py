"""Throughput and model FLOPs utilisation (MFU): tokens/s, samples/s, and the share of the devices' peak.

MFU as nanoGPT and PaLM (Chowdhery et al. 2022, appendix B) count it: a transformer's training step
costs 6·N FLOPs per token for the matrix multiplications with its N weights (forward 2N, backward 4N)
plus 12·L·d·T for attention's scores and weighted sum (L blocks of width d over T tokens of context);
recomputation is not counted. The peak is the device's dense bf16 rate from the table below (NVIDIA's
data sheets), or one given by the user; a CPU has no entry, so no MFU is shown there.
"""

from __future__ import annotations

import time

import torch

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


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from PEAK_BF16_FLOPS, or None (a CPU, an unknown GPU)."""
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

    def compute(self) -> dict[str, float]:
        """{"tokens_per_s", "samples_per_s", "mfu" (when known)} since the start."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        result = {"tokens_per_s": self.tokens / elapsed, "samples_per_s": self.samples / elapsed}
        if self.flops_per_token is not None and self.peak is not None:
            result["mfu"] = result["tokens_per_s"] * self.flops_per_token / (self.peak * self.devices)
        return result
