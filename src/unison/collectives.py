"""The Accelerator's collectives: gather, gather_for_metrics, reduce, broadcast, padding, placement.

A mixin, as checkpoint/methods.py is, so accelerator.py stays the façade. What these add to `ops`
(collectives over every process) is the layout: under tensor or pipeline parallelism the peers of one
data-parallel rank read the same batch and hold copies of its results, so gather, gather_for_metrics
and reduce count each data-parallel rank once (the first of its peers), and a metric is the same
number in every layout. They read `device_mesh`, `num_processes`, `gradient_state` and `device` from
the Accelerator.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import ops
from .data.top_ups import rows_to_keep
from .parallel.mesh import data_parallel_representatives
from .state import PartialState

logger = logging.getLogger("unison")


class CollectiveMethods:
    """gather / gather_for_metrics / gather_object / reduce / broadcast / pad_across_processes /
    send_to_device."""

    def gather(self, tensor: Any) -> Any:
        """Every data-parallel rank's tensors, concatenated in data-parallel order.

        Under tensor or pipeline parallelism the peers of one data-parallel rank read the same batch
        and hold copies of its results, so each data-parallel rank's rows appear once (those of the
        first of its peers), as in gather_for_metrics. Elsewhere: every process's rows.
        """
        data = ops.gather(tensor)
        representatives = data_parallel_representatives(self.device_mesh)
        if representatives is None:
            return data
        return ops.recursively_apply(lambda rows: _rows_of(rows, representatives, self.num_processes), data)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather across processes, dropping the samples duplicated to even out the final batch.

        Called on each batch of a prepared evaluation loader, the concatenated results hold exactly
        len(dataset) rows, in every layout: tensor-parallel and pipeline peers, which read the same
        batches, count once. Called once after the loop on everything a process collected (as many rows
        as the loader's complete pass gave it), it drops each process's repeats too; where that length
        is ambiguous it keeps every row, as Accelerate does, and warns once (see data.top_ups).
        """
        representatives = data_parallel_representatives(self.device_mesh)
        as_objects = use_gather_object or not _all_leaves_are_tensors(input_data)
        if as_objects:
            if representatives is None:
                data = ops.gather_object(input_data)
            else:  # tensor/pipeline peers hold copies of one dp rank's results: keep one of each
                everyone: list[Any] = [None] * self.num_processes
                torch.distributed.all_gather_object(everyone, input_data)
                kept = [everyone[rank] for rank in representatives]
                data = [item for obj in kept for item in obj] if isinstance(input_data, list) else kept
        else:
            data = self.gather(input_data)
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder >= 0:  # a loader's last batch
            self.gradient_state.active_dataloader.last_batch_gathered = True  # its pass leaves no repeats
            if as_objects:  # one list of every process's items: the padding is at its end
                return data[:remainder]
            return ops.slice_tensors(data, slice(0, remainder))  # each tensor's rows, in any structure
        return self._without_repeats_of_a_completed_pass(input_data, data, as_objects)

    def _without_repeats_of_a_completed_pass(self, input_data: Any, data: Any, as_objects: bool) -> Any:
        """`data` (gathered) less the repeats of the prepared loader's complete pass whose results
        `input_data` holds, judged by its rows (see data.top_ups); all of it where that is unclear."""
        state = self.gradient_state
        if not state.completed_passes:
            return data
        if as_objects:
            if not isinstance(input_data, list) or not isinstance(data, list):
                return data
            rows, gathered = len(input_data), len(data)
        else:
            leading = {tensor.shape[0] if tensor.ndim else None for tensor in _tensor_leaves(input_data)}
            rows = leading.pop() if len(leading) == 1 else None
            gathered = next(iter(_tensor_leaves(data))).shape[0] if rows else 0
        running = [getattr(loader, "batch_size", None) for loader in state.active_dataloaders]
        verdict = rows_to_keep(state.completed_passes.values(), rows, gathered, running)
        if verdict.warning is not None and not getattr(self, "_warned_of_repeats", False):
            self._warned_of_repeats = True
            if PartialState().is_main_process:  # every process decides alike
                logger.warning(verdict.warning)
        if verdict.keep is None:
            return data
        if as_objects:
            return [item for part in verdict.keep for item in data[part]]
        return ops.recursively_apply(lambda tensor: torch.cat([tensor[part] for part in verdict.keep]), data)

    def gather_object(self, obj: Any) -> list[Any]:
        return ops.gather_object(obj)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce across the data-parallel ranks ("sum" by default, as Accelerate's Accelerator.reduce).

        Each data-parallel rank's value counts once: under tensor or pipeline parallelism its peers
        hold copies of it (the same batch, the same loss), which a reduction over every process would
        count tp x pp times. "mean" divides by the number of data-parallel ranks. Context-parallel
        ranks count one each: inside maybe_context_parallel each holds its own part of the sequences, so
        the "mean" of their losses is the loss of the whole sequences.
        """
        representatives = data_parallel_representatives(self.device_mesh, peers=("pp", "tp"))
        if representatives is None:
            return ops.reduce(tensor, reduction=reduction, scale=scale)
        if reduction not in ops.REDUCTIONS:
            ops.reduce(tensor, reduction=reduction)  # raises the same error, naming the choices

        def reduce_one(value: torch.Tensor) -> torch.Tensor:
            rows = _rows_of(ops.gather(value.detach()[None]), representatives, self.num_processes)
            return _reduce_rows(rows, reduction, scale)

        return ops.recursively_apply(reduce_one, tensor)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        return ops.broadcast(tensor, from_process=from_process)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def send_to_device(self, data: Any, non_blocking: bool = False) -> Any:
        return ops.send_to_device(data, self.device, non_blocking=non_blocking)


def _rows_of(tensor: torch.Tensor, ranks: list[int], num_processes: int) -> torch.Tensor:
    """From a gather over all processes (equal row blocks in rank order), the blocks of `ranks`."""
    blocks = tensor.view(num_processes, tensor.shape[0] // num_processes, *tensor.shape[1:])
    return blocks[ranks].flatten(0, 1)


def _reduce_rows(rows: torch.Tensor, reduction: str, scale: float) -> torch.Tensor:
    """ops.reduce's arithmetic over the first dimension of one row per data-parallel rank: bools sum
    as counts (mean: their fraction), their max / min are any / all; integer means are floats."""
    work = rows.long() if rows.dtype == torch.bool else rows
    if scale != 1.0:
        work = work * scale
    if reduction == "sum":
        return work.sum(0)
    if reduction == "mean":
        return work.sum(0) / work.shape[0]
    result = work.amax(0) if reduction == "max" else work.amin(0)
    return result.bool() if rows.dtype == torch.bool else result


def _tensor_leaves(data: Any) -> list[torch.Tensor]:
    leaves: list[torch.Tensor] = []
    ops.recursively_apply(lambda tensor: leaves.append(tensor) or tensor, data)
    return leaves


def _all_leaves_are_tensors(data: Any) -> bool:
    try:
        ops.recursively_apply(lambda tensor: tensor, data, error_on_other_type=True)
    except TypeError:
        return False
    return True
