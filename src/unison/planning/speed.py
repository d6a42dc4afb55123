"""Choose between the layouts that fit by their predicted step time (unison.planning.cost_model).

The planner (unison.planning.planner) lists the valid layouts and prices their memory; when the run's batch is
known (global batch and sequence length), this module prices each layout's step and the planner takes
the fastest of those that fit. Memory stays the hard constraint; speed only orders what fits.

The global batch fixes each layout's micro-steps: with `dp` data-parallel ranks and micro-batches of `b`
sequences, every rank runs m = global / (dp·b) micro-batches per step, which is a pipeline's
micro-batch count and otherwise the gradient accumulation steps. A layout whose data-parallel degree does
not divide the global batch cannot run it and is left out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..parallel.config import ParallelismConfig
from .cost_model import PCIE_BANDWIDTH, Batch, DeviceSpec
from .devices import DEVICES
from .hardware import Hardware
from .inputs import Workload

DEFAULT_DEVICE = "h100"
"""The device priced when none is named: the planner's default memory (80GB) is an H100's or A100's."""
ETHERNET_BANDWIDTH = 12.5e9
"""One node's network when the nodes are linked by 'ethernet' (100 Gb/s), shared by its devices."""
SAME_SPEED = 0.03
"""Layouts predicted within 3% of the fastest count as equally fast (the model is not that precise): of
those, the planner takes the one the guide lists first, the simpler (DDP before ZeRO, no split before TP
before PP)."""
LARGEST_MICRO_BATCH = 64
"""The largest micro-batch the planner tries when none is given."""


def device_spec(hardware: Hardware, name: str | DeviceSpec | None = None) -> DeviceSpec:
    """The DeviceSpec to price `hardware` with: `name` from devices.DEVICES (or a DeviceSpec), its links
    replaced by what `hardware` says it has (PCIe inside a node; Ethernet, InfiniBand or NVLink between)."""
    if isinstance(name, DeviceSpec):
        spec = name
    else:
        key = (name or DEFAULT_DEVICE).lower()
        if key not in DEVICES:
            raise ValueError(
                f"device {name!r} is not in the device table: pass one of {', '.join(DEVICES)}, or describe "
                "it (name:peak=FLOP/s,nvlink=bytes/s,network=bytes/s)."
            )
        spec = DEVICES[key]
    if hardware.interconnect == "pcie":
        spec = dataclasses.replace(spec, intra_node_bandwidth=PCIE_BANDWIDTH)
    if hardware.inter_node == "ethernet":
        spec = dataclasses.replace(spec, inter_node_bandwidth=ETHERNET_BANDWIDTH / hardware.devices_per_node)
    elif hardware.inter_node == "nvlink":  # NVLink-switch systems (NVL72): the whole rack is one node's link
        spec = dataclasses.replace(
            spec, inter_node_bandwidth=spec.intra_node_bandwidth, inter_node_latency=spec.intra_node_latency
        )
    return spec


def device_key(device: torch.device) -> str | None:
    """The devices.DEVICES key of a CUDA device by its name (A100s by their memory), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    if "A100" in name:
        return (
            "a100-80gb" if torch.cuda.get_device_properties(device).total_memory > 48 * 2**30 else "a100-40gb"
        )
    return next((key for key in ("h200", "h100", "b200", "mi300x") if key.upper() in name), None)


def micro_batch_sizes(workload: Workload) -> list[int]:
    """The micro-batch sizes to try: every divisor of the global batch up to LARGEST_MICRO_BATCH, so
    a batch of 480 over 8 ranks can run nanoGPT's 12 x 5 (powers of two alone would stop at 4 x 15)."""
    assert workload.global_batch_size is not None
    return [b for b in range(1, LARGEST_MICRO_BATCH + 1) if workload.global_batch_size % b == 0]


def fastest_micro_batch(priced: list[Any]) -> tuple[Any, float]:
    """Of one layout priced at several micro-batches (objects with a `.cost`), the largest micro-batch
    predicted within SAME_SPEED of the fastest, and the fastest step (what the layout is ranked by):
    fewer, fuller micro-steps lose less to what the model does not count (the loop, data loading, a
    step's synchronisations), so a tie goes to the larger."""
    fastest = min(c.cost.step for c in priced)
    larger = max(
        (c for c in priced if c.cost.step <= fastest * (1 + SAME_SPEED)),
        key=lambda c: c.cost.micro_batch_size,
    )
    return larger, fastest


def schedules(config: ParallelismConfig, blocks: int) -> list[ParallelismConfig]:
    """`config`, and beside a pipeline its interleaved variant (two stages per device: half the bubble,
    twice the sends) when every stage still gets a block."""
    pp = config.pp_size or 1
    if pp < 2 or blocks < 2 * pp:
        return [config]
    return [config, dataclasses.replace(config, pp_schedule="interleaved")]


def with_batch(config: ParallelismConfig, batch: Batch, devices: int) -> ParallelismConfig | None:
    """`config` with the pipeline's micro-batch count set from the global batch, or None when the
    global batch does not split over its data-parallel ranks."""
    try:
        micro_steps = batch.micro_steps(config.dp_size)
    except ValueError:
        return None
    if (config.pp_size or 1) > 1:
        config = dataclasses.replace(config, pp_microbatches=micro_steps).validate(devices)
    return config
