"""`split_for_process`: the contiguous share of a list, tuple, tensor (or dict of those) one process
gets, as `PartialState.split_between_processes` yields it; pure, so it is tested without processes."""

from __future__ import annotations

from typing import Any

import torch


def _split_sequence_bounds(length: int, num_processes: int, process_index: int) -> tuple[int, int]:
    base, extra = divmod(length, num_processes)
    start = process_index * base + min(process_index, extra)
    return start, start + base + (1 if process_index < extra else 0)


def split_for_process(
    inputs: Any, num_processes: int, process_index: int, apply_padding: bool = False
) -> Any:
    """This process's contiguous share of `inputs`; see PartialState.split_between_processes."""
    if num_processes == 1:
        return inputs
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                f"split_between_processes got a dict whose values have different lengths {sorted(lengths)}: "
                "every value must have the same length so that process i gets the same rows of each."
            )
        return {
            k: split_for_process(v, num_processes, process_index, apply_padding) for k, v in inputs.items()
        }
    if not isinstance(inputs, (list, tuple, torch.Tensor)):
        raise TypeError(
            f"split_between_processes cannot split a {type(inputs).__name__}: pass a list, tuple, tensor, "
            "or a dict of those."
        )
    start, end = _split_sequence_bounds(len(inputs), num_processes, process_index)
    share = inputs[start:end]
    if apply_padding:
        longest = -(-len(inputs) // num_processes)
        missing = longest - len(share)
        if missing and len(inputs):
            last = inputs[-1:] if len(share) == 0 else share[-1:]
            if isinstance(share, torch.Tensor):
                share = torch.cat([share] + [last] * missing)
            else:
                share = share + type(share)(last) * missing
    return share
