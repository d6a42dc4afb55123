"""The public path of `unison.observing.throughput` (tokens/s and MFU), as the docs and examples import
it: `from unison.throughput import Throughput, peak_flops, transformer_flops_per_token`."""

from .observing.throughput import (
    PEAK_BF16_FLOPS,
    Throughput,
    check_peak_flops,
    peak_flops,
    transformer_flops_per_token,
)

__all__ = ["PEAK_BF16_FLOPS", "Throughput", "check_peak_flops", "peak_flops", "transformer_flops_per_token"]
