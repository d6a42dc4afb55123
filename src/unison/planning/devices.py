"""The hardware a plan can be asked for, in words: the device table, the links, sizes such as "80GB".

`unison plan`'s flags name devices, links and memory sizes; the parser checks them as it reads them. So
these names live in this torch-free module, which the cost model (unison.planning.cost_model), the
hardware description (unison.planning.hardware) and the command line import, and `unison plan --help`
needs no torch.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

DEFAULT_EFFICIENCY = 0.6
"""Share of the dense bf16 peak a wide model's step reaches when nothing waits (module docstring)."""
LINKS_WITHIN_NODE = {"nvlink": True, "pcie": False}
"""Links between the devices of one node, and whether the guide counts them as fast."""
LINKS_BETWEEN_NODES = {"nvlink": True, "infiniband": True, "ethernet": False}
"""Links between nodes (nvlink: NVLink-switch systems), and whether they count as fast."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory(text: str) -> int:
    """'80GB', '40GiB', '24G', '512MB' or plain bytes -> bytes, in binary units as memory is sold (JEDEC)."""
    match = _SIZE.match(str(text))
    if match is None or (match.group(3).lower() == "i" or (match.group(3) and not match.group(2))):
        raise ValueError(
            f"device memory {text!r} is not a size: write a number with an optional unit, e.g. 80GB, 40GiB, "
            "24G, 512MB or 85899345920 (bytes). Units are binary, as GPU memory is quoted: 1GB = 2^30 bytes."
        )
    value = int(float(match.group(1)) * _UNIT[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"device memory {text!r} is not positive: give the memory of one device, e.g. 80GB.")
    return value


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and its links, from the vendors' data sheets.

    peak_flops: dense bf16 FLOP/s. memory: bytes. intra_node_bandwidth: bytes/s one way from a device to
    the rest of its node (NVLink, Infinity Fabric, or PCIe). inter_node_bandwidth: bytes/s one way of a
    device's share of its node's network (one NIC per device on the systems below). Latencies: seconds
    per hop of a collective.
    """

    name: str
    peak_flops: float
    memory: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "name" and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(
                    f"{field.name}={value!r} for device {self.name!r} is not a positive number: give it in "
                    "FLOP/s, bytes, bytes/s or seconds (e.g. peak_flops=989e12)."
                )


GB = 10**9
GIB = 2**30
DEVICES = {
    "a100-40gb": DeviceSpec("A100 SXM 40GB", 312e12, 40 * GIB, 300 * GB, 25 * GB),
    "a100-80gb": DeviceSpec("A100 SXM 80GB", 312e12, 80 * GIB, 300 * GB, 25 * GB),
    "h100": DeviceSpec("H100 SXM 80GB", 989e12, 80 * GIB, 450 * GB, 50 * GB),
    "h200": DeviceSpec("H200 SXM 141GB", 989e12, 141 * GB, 450 * GB, 50 * GB),
    "b200": DeviceSpec("B200 180GB", 2250e12, 180 * GB, 900 * GB, 50 * GB),
    "mi300x": DeviceSpec("MI300X 192GB", 1307e12, 192 * GB, 448 * GB, 50 * GB),
}
"""Data-sheet figures. Networks: HDR InfiniBand (200 Gb/s per GPU) with A100 as in NVIDIA's Selene and
DGX A100; NDR (400 Gb/s per GPU) with the others, as in DGX H100/H200/B200 and MI300X platforms."""


def parse_device_spec(text: str) -> DeviceSpec:
    """'NAME:peak=989e12,memory=80GB,nvlink=450e9,network=50e9' -> a DeviceSpec for a device the table
    lacks; a NAME in the table may be given with only the fields that differ."""
    name, _, fields = text.partition(":")
    known = DEVICES.get(name.strip().lower())
    values: dict[str, float | int] = {}
    aliases = {
        "peak": "peak_flops",
        "memory": "memory",
        "nvlink": "intra_node_bandwidth",
        "network": "inter_node_bandwidth",
    }
    for item in filter(None, (part.strip() for part in fields.split(","))):
        key, _, value = item.partition("=")
        if key not in aliases:
            raise ValueError(f"device field {key!r} in {text!r} is unknown: use {', '.join(aliases)}.")
        try:
            values[aliases[key]] = parse_memory(value) if key == "memory" else float(value)
        except ValueError:
            raise ValueError(
                f"device field {key}={value!r} in {text!r} is not a number (e.g. 989e12)."
            ) from None
    if known is not None:
        return dataclasses.replace(known, **values)
    missing = [alias for alias, field in aliases.items() if field not in values]
    if missing:
        raise ValueError(
            f"device {name!r} is not in the table ({', '.join(DEVICES)}), so {text!r} must give "
            f"{', '.join(missing)} too, e.g. {name}:peak=989e12,memory=80GB,nvlink=450e9,network=50e9."
        )
    return DeviceSpec(name, **values)  # type: ignore[arg-type]
