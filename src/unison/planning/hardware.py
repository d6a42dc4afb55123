"""What the job runs on: a description of the devices, their memory and links (`Hardware`), read from
the running job (`detect_hardware`) or given by hand (`parse_memory`, from unison.planning.devices,
for sizes such as "80GB").

The planner (unison.planning.planner) prices layouts against this description. Its facts are the same on every
rank of equal nodes, except that the link probe (nvidia-smi) can fail on one rank and answer PCIe there:
a job that plans at run time therefore plans on rank 0 and broadcasts the plan (unison.planning.auto).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

import torch

from . import memory
from .devices import LINKS_BETWEEN_NODES, LINKS_WITHIN_NODE
from .devices import parse_memory as parse_memory  # planner.py and tests import it from here


@dataclass(frozen=True)
class Hardware:
    """The machines a plan is for: `devices` in all, over `nodes` equal nodes, `device_memory` bytes each.

    interconnect: the link between the devices of one node ("nvlink" fast, "pcie" slow).
    inter_node: the link between nodes ("nvlink", "infiniband" fast; "ethernet" slow); unused on one node.
    """

    devices: int
    device_memory: int
    nodes: int = 1
    interconnect: str = "nvlink"
    inter_node: str = "ethernet"

    def __post_init__(self) -> None:
        for name in ("devices", "nodes", "device_memory"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not a whole number >= 1: give e.g. {name}=8.")
        if self.devices % self.nodes:
            raise ValueError(
                f"devices={self.devices} is not divisible by nodes={self.nodes}: every node holds the same "
                f"number of devices. Give a multiple of {self.nodes} devices, or the right node count."
            )
        if self.interconnect not in LINKS_WITHIN_NODE:
            hint = (
                f" ({self.interconnect!r} links nodes: give it as inter_node / --inter-node)"
                if self.interconnect in LINKS_BETWEEN_NODES
                else ""
            )
            raise ValueError(
                f"interconnect={self.interconnect!r} is not a link between the devices of one node{hint}: "
                f"pass one of {', '.join(map(repr, LINKS_WITHIN_NODE))}."
            )
        if self.inter_node not in LINKS_BETWEEN_NODES:
            raise ValueError(
                f"inter_node={self.inter_node!r} is not a link between nodes: pass one of "
                f"{', '.join(map(repr, LINKS_BETWEEN_NODES))}."
            )

    @property
    def devices_per_node(self) -> int:
        return self.devices // self.nodes

    def describe(self) -> str:
        layout = f"{self.devices} device{'s' if self.devices > 1 else ''}" + (
            f" ({self.nodes} nodes x {self.devices_per_node})" if self.nodes > 1 else " (one node)"
        )
        links = f"{self.interconnect} within nodes" + (
            f", {self.inter_node} between nodes" if self.nodes > 1 else ""
        )
        return f"{layout}, {memory.format_bytes(self.device_memory)} each, {links}"


def detect_hardware(
    world_size: int,
    local_world_size: int,
    device: torch.device | str,
    inter_node: str = "ethernet",
    interconnect: str | None = None,
) -> Hardware:
    """The hardware of the running job, as this rank sees it (see the module docstring for why a job
    broadcasts one rank's answer).

    Device memory: the CUDA device's total memory, else total RAM shared by the node's processes. The link
    inside a node: NVLink when `nvidia-smi topo -m` shows NV links between every pair of the node's GPUs,
    else PCIe (also when nvidia-smi is missing); pass `interconnect` to skip the probe. Between nodes
    nothing is probed: `inter_node` (default: the slow, safe "ethernet").
    """
    if local_world_size < 1 or world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"world_size={world_size}, local_world_size={local_world_size}: the world must be a whole number "
            "of equal nodes (world_size a multiple of local_world_size, both >= 1)."
        )
    device = torch.device(device)
    if device.type == "cuda":
        device_memory = torch.cuda.get_device_properties(device).total_memory
        link = interconnect or _cuda_link(local_world_size)
    else:
        device_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_world_size
        link = interconnect or "pcie"
    return Hardware(world_size, device_memory, world_size // local_world_size, link, inter_node)


def _cuda_link(local_world_size: int) -> str:
    """The link between this node's GPUs from `nvidia-smi topo -m` ('pcie' when it cannot be run)."""
    if local_world_size < 2:
        return "pcie"
    try:
        topology = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "pcie"
    return link_from_topology(topology, local_world_size, os.environ.get("CUDA_VISIBLE_DEVICES", ""))


def link_from_topology(topology: str, local_world_size: int, visible_devices: str = "") -> str:
    """'nvlink' when `nvidia-smi topo -m` shows NV# links between every pair of the GPUs used, else 'pcie'.

    The GPUs used: the first `local_world_size` of CUDA_VISIBLE_DEVICES (`visible_devices`, when it lists
    indices), else of all GPUs in the matrix.
    """
    rows = {}
    for line in topology.splitlines():
        cells = line.split()
        if cells and re.fullmatch(r"GPU\d+", cells[0]):
            rows[int(cells[0][3:])] = cells[1:]
    used = [int(i) for i in visible_devices.split(",") if i.strip().isdigit()] or sorted(rows)
    used = used[:local_world_size]
    if len(used) < local_world_size or any(i not in rows for i in used):
        return "pcie"
    try:
        linked = all(rows[i][j].startswith("NV") for i in used for j in used if i != j)
    except IndexError:
        return "pcie"
    return "nvlink" if linked else "pcie"
