"""How a pipeline's stages share a model's blocks, for pricing: the work of the slowest device.

unison's pipeline split (unison.parallel.pipeline_split) cuts the blocks into contiguous stages of the
smallest largest parameter count, counting the embedding with the first block and the output layer with
the last, so when the stages do not divide the blocks, some hold one block more, and the end stages hold
fewer blocks to make room for the embedding and the output layer. The cost model (unison.planning.cost_model)
needs the FLOPs of the busiest device of that split: the embedding costs next to nothing (a lookup), the
output layer as much as its matrix multiplication. This module reproduces that split in closed form rather
than running the parallel layer's dynamic programme (O(stages x blocks²)), too slow for every layout the
planner prices; tests/test_plan_stages.py checks that both cut alike.
"""

from __future__ import annotations

import functools
import math


@functools.lru_cache(maxsize=1024)
def stage_blocks(layers: int, stages: int, end_weight: float) -> tuple[int, ...]:
    """Blocks per stage, first to last, as unison's split cuts `layers` blocks of one unit of parameters
    into `stages` contiguous stages of the smallest largest load, the first and the last block each
    carrying `end_weight` more (the embedding, the output layer, in blocks' worth of parameters). Its
    dynamic programme settles ties by making the last stage as full as that load allows, then cuts the
    rest the same way; so does this, in closed form. More stages than blocks: one block each, then none."""
    if layers < 1 or stages < 1 or end_weight < 0:
        raise ValueError(
            f"layers={layers}, stages={stages}, end_weight={end_weight}: a split needs at least one block "
            "and one stage and a weight of 0 or more."
        )
    if stages >= layers:
        return (1,) * layers + (0,) * (stages - layers)
    groups, left = [], layers
    for k in range(stages, 1, -1):  # k stages still to fill with the first `left` blocks
        last_end = end_weight if k == stages else 0.0  # the output layer rides on the model's last block
        limit = _smallest_load(left, k, end_weight, last_end)
        size = min(math.floor(limit - last_end + 1e-9), left - (k - 1))
        groups.append(size)
        left -= size
    groups.append(left)
    return tuple(groups[::-1])


def _smallest_load(blocks: int, groups: int, first_end: float, last_end: float) -> float:
    """The smallest largest load of `blocks` unit blocks in `groups` >= 2 contiguous non-empty groups,
    the first block weighing `first_end` more and the last `last_end` more."""

    def fits(limit: float) -> bool:
        first = math.floor(limit - first_end + 1e-9)
        last = math.floor(limit - last_end + 1e-9)
        middle = math.floor(limit + 1e-9)
        return min(first, last) >= 1 and first + last + (groups - 2) * middle >= blocks

    ends = (0.0, first_end, last_end, first_end + last_end)
    candidates = sorted({whole + end for whole in range(1, blocks + 1) for end in ends})
    low, high = 0, len(candidates) - 1  # the largest candidate (every block in its own group) fits
    while low < high:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            high = middle
        else:
            low = middle + 1
    return candidates[low]


def slowest_device_blocks(layers: int, pp: int, per_device: int, end_weight: float, head: float) -> float:
    """Work of the busiest of `pp` pipeline devices, in blocks' worth of FLOPs, each device holding
    `per_device` stages (interleaved: stages d, d + pp, ...); `head` is the output layer's FLOPs in
    blocks, on the last stage."""
    stages = stage_blocks(layers, pp * per_device, end_weight)
    last = max(i for i, blocks in enumerate(stages) if blocks)  # where the output layer runs
    loads = [0.0] * pp
    for index, blocks in enumerate(stages):
        loads[index % pp] += blocks + (head if index == last else 0.0)
    return max(loads)
