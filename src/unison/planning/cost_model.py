"""How long one training step of a parallel layout takes: compute, communication and the pipeline bubble.

Memory decides which layouts fit (`layout_memory`); this model decides which of those is fastest.
It is arithmetic on the model's shape, the layout, the batch and a device description (`DeviceSpec`),
as in Narayanan et al. 2021 (Megatron-LM, sections 3 and 5) and the PaLM appendix, and its figures are
predictions to rank layouts and to say roughly how fast a run will go, not measurements
(docs/planner.md compares them with published runs).

- compute: the step's FLOPs, 6·N per token plus attention's 12·L·h·s (PaLM), x 4/3 with full
  activation recomputation (the forward runs twice); with frozen weights (LoRA, frozen layers), 2·N
  forward + 2·N for input gradients where backward passes through + 2 per trainable parameter for the
  weight gradients (`parameter_flops`: 4.0 and a little for LoRA on a 70B Llama), the recomputed forward
  only where backward goes, and MFU counts those FLOPs; spread evenly over the devices and run at
  `efficiency` x h/(h + 640) x the device's dense bf16 peak. `efficiency` is the assumption that matters
  most: the share of peak a wide model's step reaches once nothing waits (0.6 by default); the factor
  h/(h + 640) is what a narrow model loses to the memory-bound work beside its matrix multiplications
  (HIDDEN_HALF_EFFICIENCY). With these, Megatron-LM's ten GPT runs on A100 (44-52% of peak measured) are
  predicted within 15% at their layouts (tests/test_cost_model.py; docs/planner.md has the table).
- the micro-batch: a step of m micro-batches of b sequences is not the same work as one of b·m. Each
  matrix multiplication has b·s/cp rows on a device; a GPU computes them in tiles of 128 rows, so few
  rows leave its units partly idle: the rate is scaled by T/(T + 128) for T tokens per micro-batch (0.89
  at 1,024 tokens, 0.99 at 12,288; TOKENS_HALF_EFFICIENCY). And every micro-step launches the same
  kernels whatever b is: 36 per block forward and backward, 18 outside the blocks (counted in the GPT
  example), 3 per FSDP2 collective (copy-in, collective, copy-out), each with a launch gap the GPU
  cannot hide (KERNEL_SECONDS); the `overhead` term is m times that. Together they make a small model's
  micro-batch of 1 slow (GPT-2 124M: 1.3x the step of micro-batch 12 on A100) and leave a large model's
  alone (a block of h = 12,288 is milliseconds of work per micro-step, the launches microseconds).
- mixtures of experts: 6 x the active parameters per token (each token's k experts, not all of them);
  under expert parallelism each MoE layer's two all-to-alls in forward and backward, on the critical
  path, and ZeRO's traffic for the experts over the EP groups beside each other only.
- communication: each collective the layout issues in one step, its bytes and the link it crosses
  (gradients: of the trainable parameters only, as DDP's buckets and FSDP2's reduce-scatters hold them;
  ZeRO-3's gathers: of every parameter, frozen or not),
  timed as NCCL's ring (bandwidth 2(n-1)/n of the buffer for an all-reduce, (n-1)/n for a
  reduce-scatter or all-gather, plus one latency per hop) or tree (2·log2(n) latencies) algorithm,
  whichever is faster. What overlaps with compute is subtracted: DDP's bucketed gradient all-reduce
  overlaps the last micro-step's backward, FSDP2's gathers and reduce-scatters overlap the forward and
  backward they prefetch for; tensor parallelism's all-reduces and pipeline sends sit on the critical
  path and do not.
- the pipeline bubble: (p-1)/(m+p-1) of the step for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved over
  v stages per device, with m the micro-batches each pipeline runs per step; and the pipeline's pace,
  which is its slowest device's: stages hold whole blocks, cut as unison's split cuts them (equal
  parameters, the embedding counted on the first stage and the output layer on the last:
  unison.planning.stages), and the last one also runs the output layer (6·V·h FLOPs per token); so a stage
  count that does not divide the blocks (31 stages of 96: some hold 4, the mean is 3.1) idles the others;
  the bubble is that share of the pipeline's compute, imbalance and micro-step overhead.

Groups are laid out as unison's DeviceMesh lays them (unison.parallel.mesh.MESH_DIM_ORDER: tp innermost,
then cp, dp_shard, dp_replicate, pp outermost), so a group crosses the inter-node link exactly when its
ranks span more than one node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..parallel.config import ParallelismConfig
from . import stages as plan_stages
from .devices import DEFAULT_EFFICIENCY, DeviceSpec
from .memory import ModelShape

HIDDEN_HALF_EFFICIENCY = 640
"""The hidden size at which a step reaches half of `efficiency`: per token, the matrix multiplications
cost O(h²) FLOPs but norms, activations, softmax and residual adds move O(h) bytes at memory speed, so
the share of time in matrix multiplications is h / (h + h0). h0 = 640 puts nanoGPT's GPT-2 124M (h 768)
at 0.55 x and Megatron's 1.7B (h 2304) at 0.78 x of a 1T model's (h 25600, 0.98 x)."""
LINK_EFFICIENCY = 0.75
"""Share of a link's data-sheet bandwidth that NCCL's collectives reach (nccl-tests' bus bandwidth:
about 230 of 300 GB/s on A100 NVLink, 370 of 450 on H100, 23 of 25 GB/s on HDR InfiniBand)."""
GRADIENT_BYTES = 4
"""Gradients are reduced in fp32 (unison's FSDP2 policy, Megatron's main_grad), whatever the compute dtype."""
ACTIVATION_BYTES = 2
"""Activations and gathered weights travel in bf16."""
PCIE_BANDWIDTH = 32e9
"""PCIe 4.0 x16, one way (data sheet): host <-> device copies of an offloaded shard, and device to device in
a node without NVLink; reached at LINK_EFFICIENCY like every link."""
CPU_ADAM_PARAMETERS_PER_SECOND = 1e9
"""An offloaded optimizer step on the host (AdamW over fp32 shards, a few cores)."""
TOKENS_HALF_EFFICIENCY = 128
"""Tokens per micro-batch on a device (the rows of its matrix multiplications) at which the step reaches
half of its rate: tensor-core GEMM kernels compute output tiles of 128 rows, and a micro-batch of few
tiles leaves units idle in the last wave; T/(T + 128) is a smooth stand-in for that staircase."""
KERNELS_PER_BLOCK = 36
"""Kernels one transformer block launches in forward and backward (the GPT example's block under torch's
profiler: 36 aten operations that do work; 18 more outside the blocks, KERNELS_OUTSIDE_BLOCKS)."""
KERNELS_OUTSIDE_BLOCKS = 18
KERNELS_PER_COLLECTIVE = 3
"""An FSDP2 all-gather or reduce-scatter of one block: copy-in, the collective, copy-out."""
KERNEL_SECONDS = 5e-6
"""What one kernel launch costs a micro-step whatever its size: the launch and the gap before the next
kernel starts (a few microseconds in eager PyTorch; an assumption from CUDA's launch latency, not a
measurement: it decides only between micro-batches of a model whose kernels are that short)."""


@dataclass(frozen=True)
class Batch:
    """What one optimizer step processes: `global_batch` sequences of `seq_len` tokens, in micro-batches
    of `micro_batch_size` sequences per data-parallel rank; `recompute`: full activation checkpointing."""

    global_batch: int
    seq_len: int
    micro_batch_size: int = 1
    recompute: bool = False

    def micro_steps(self, dp: int) -> int:
        """Micro-batches each data-parallel rank (each pipeline) runs per step."""
        per_rank, left = divmod(self.global_batch, dp * self.micro_batch_size)
        if left or per_rank < 1:
            raise ValueError(
                f"global batch {self.global_batch} does not split into micro-batches of "
                f"{self.micro_batch_size} over {dp} data-parallel ranks: make it a multiple of "
                f"{dp * self.micro_batch_size}."
            )
        return per_rank


@dataclass(frozen=True)
class StepCost:
    """The predicted step, in seconds; `communication` and `exposed` are per kind of collective."""

    compute: float
    imbalance: float  # a pipeline's slowest stage over the average (whole blocks, the output layer)
    overhead: float  # kernel launches, the same for every micro-step whatever its size
    bubble: float
    communication: dict[str, float]
    exposed: dict[str, float]
    tokens: int
    model_flops: float
    hardware_flops: float
    devices: int
    peak_flops: float
    micro_batch_size: int
    micro_steps: int  # micro-batches per step on each data-parallel rank (a pipeline's m)

    @property
    def step(self) -> float:
        return self.compute + self.imbalance + self.overhead + self.bubble + sum(self.exposed.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation) per second over the devices' peak, as PaLM defines MFU."""
        return self.model_flops / (self.step * self.devices * self.peak_flops)

    @property
    def tflops_per_device(self) -> float:
        """Hardware FLOP/s per device in TFLOP/s, recomputation included (Megatron-LM's figure)."""
        return self.hardware_flops / (self.step * self.devices) / 1e12

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_seconds": self.step,
            "compute_seconds": self.compute,
            "pipeline_imbalance_seconds": self.imbalance,
            "micro_step_overhead_seconds": self.overhead,
            "bubble_seconds": self.bubble,
            "communication_seconds": dict(self.communication),
            "exposed_communication_seconds": dict(self.exposed),
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "tflops_per_device": self.tflops_per_device,
            "micro_batch_size": self.micro_batch_size,
            "micro_steps": self.micro_steps,
        }


@dataclass(frozen=True)
class _Link:
    bandwidth: float
    latency: float


def step_cost(
    shape: ModelShape,
    config: ParallelismConfig,
    device: DeviceSpec,
    devices_per_node: int,
    batch: Batch,
    efficiency: float = DEFAULT_EFFICIENCY,
) -> StepCost:
    """Predict one optimizer step of `shape` trained in layout `config` (validated, sizes filled) on
    devices `device`, `devices_per_node` to a node (module docstring: what is counted and how)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r}: the share of peak reached, between 0 and 1 (e.g. 0.4).")
    if shape.layers is None or shape.hidden is None:
        raise ValueError(
            "the cost model prices transformers: the model's blocks and hidden size were not found."
        )
    tp, pp, cp = config.tp_size or 1, config.pp_size or 1, config.cp_size or 1
    replicas, shards = config.dp_replicate_size or 1, config.dp_shard_size or 1
    dp = replicas * shards
    devices = tp * pp * cp * dp
    micro_steps = batch.micro_steps(dp)
    tokens = batch.global_batch * batch.seq_len
    # a mixture of experts computes each token with its k experts only (shape.active_parameters); frozen
    # weights compute no weight gradients, nor input gradients before the first trainable one
    per_parameter = parameter_flops(shape)
    attention = 4.0 * shape.layers * shape.hidden * batch.seq_len  # forward; backward twice that
    reached = shape.reached_parameters / shape.parameters if shape.parameters else 1.0
    model_flops = (per_parameter * shape.active_parameters + attention * (1 + 2 * reached)) * tokens
    forward_flops = (2.0 * shape.active_parameters + attention) * tokens
    hardware_flops = model_flops + (forward_flops * reached if batch.recompute else 0.0)
    rows = batch.micro_batch_size * batch.seq_len / cp  # of each matrix multiplication, per micro-batch
    rate = device.peak_flops * efficiency * shape.hidden / (shape.hidden + HIDDEN_HALF_EFFICIENCY)
    rate *= rows / (rows + TOKENS_HALF_EFFICIENCY)
    compute = hardware_flops / devices / rate
    overhead = micro_steps * _kernels_per_micro_step(shape.layers, config) * KERNEL_SECONDS
    imbalance = bubble = 0.0
    if pp > 1:
        # a pipeline runs at its slowest stage's pace: whole blocks per stage (some stages hold one more
        # when p does not divide L) and the output layer on the last one
        per_device = stages_per_device(config)
        head = per_parameter * (shape.vocab or 0) * shape.hidden
        block = (model_flops / tokens - head) / shape.layers
        block_parameters = shape.block_parameters or 12 * shape.hidden**2
        ends = (shape.vocab or 0) * shape.hidden / block_parameters  # embedding, output layer: in blocks
        busiest = plan_stages.slowest_device_blocks(shape.layers, pp, per_device, ends, head / block)
        slowest = busiest * block * tokens
        slowest *= hardware_flops / model_flops / (tp * cp * dp)
        imbalance = max(0.0, slowest / rate - compute)
        bubble = (compute + imbalance + overhead) * (pp - 1) / (per_device * micro_steps)
    # the share of each micro-step after its forward: where a gradient all-reduce can hide
    backward = (compute + imbalance) * (1 - forward_flops / hardware_flops)  # 2/3, 3/4 recomputing

    def link(stride: int, size: int) -> _Link:
        """The link a group of `size` ranks `stride` apart crosses: inter-node once it spans nodes."""
        if stride * size > devices_per_node:
            return _Link(device.inter_node_bandwidth * LINK_EFFICIENCY, device.inter_node_latency)
        return _Link(device.intra_node_bandwidth * LINK_EFFICIENCY, device.intra_node_latency)

    communication: dict[str, float] = {}
    exposed: dict[str, float] = {}
    stage_parameters = shape.parameters / (tp * pp)  # what one device holds before data-parallel sharding
    blocks = max(1, shape.layers // pp)
    ep = config.ep_size or 1
    experts = shape.expert_parameters if ep > 1 else 0
    if dp > 1:
        dense = stage_parameters - experts
        _data_parallel(
            config,
            (dense, dense * shape.trainable_fraction),  # gathered: all; gradients: the trainable ones
            blocks,
            micro_steps,
            backward,
            pp,
            link,
            (tp * cp, shards, replicas),
            communication,
            exposed,
        )
    if experts:
        _expert_parallel(shape, config, batch, micro_steps, link, (tp * cp, shards), communication, exposed)
    _hide_under_compute(communication, exposed, compute)
    if tp > 1:
        activation = batch.micro_batch_size * batch.seq_len // cp * shape.hidden * ACTIVATION_BYTES
        per_layer = 6 if batch.recompute else 4  # 2 forward, 2 backward, 2 more in the recomputed forward
        seconds = micro_steps * blocks * per_layer * _all_reduce(activation, tp, link(1, tp))
        communication["tp all-reduce"] = exposed["tp all-reduce"] = seconds
    if pp > 1:
        activation = batch.micro_batch_size * batch.seq_len // cp * shape.hidden * ACTIVATION_BYTES
        hop = link(tp * cp * dp, 2)  # next stage: one pipeline rank further, every other rank in between
        # 1F1B sends each micro-batch's activations forward and its gradients back on the critical path:
        # v·m + p - 1 slots each way; Megatron's scatter-gather splits a send over the tp ranks
        slots = stages_per_device(config) * micro_steps + pp - 1  # interleaved: v crossings per micro-batch
        seconds = 2 * slots * (activation / tp / hop.bandwidth + hop.latency)
        communication["pp send/recv"] = exposed["pp send/recv"] = seconds
    if config.offload:  # every parameter in, the trainable ones' gradients out and stepped on the host
        shard, trainable = shape.parameters / max(1, shards), shape.trainable_parameters / max(1, shards)
        copies = shard * ACTIVATION_BYTES + trainable * GRADIENT_BYTES
        seconds = copies / (PCIE_BANDWIDTH * LINK_EFFICIENCY) + trainable / CPU_ADAM_PARAMETERS_PER_SECOND
        communication["offload copies and host step"] = exposed["offload copies and host step"] = seconds
    return StepCost(
        compute,
        imbalance,
        overhead,
        bubble,
        communication,
        exposed,
        tokens,
        model_flops,
        hardware_flops,
        devices,
        device.peak_flops,
        batch.micro_batch_size,
        micro_steps,
    )


def parameter_flops(shape: ModelShape) -> float:
    """Training FLOPs per parameter and token: 2 forward, 2 for its input's gradient where backward passes
    through it, 2 for its own gradient where it trains. 6 when every parameter trains (Kaplan et al. 2020's
    6·N); 4 and a little under LoRA, whose frozen weights compute no weight gradients (as share of the
    parameters: ModelShape.reached_parameters, trainable_parameters)."""
    if not shape.parameters:
        return 6.0
    return 2.0 + 2.0 * shape.reached_parameters / shape.parameters + 2.0 * shape.trainable_fraction


def _kernels_per_micro_step(layers: int, config: ParallelismConfig) -> int:
    """Kernels one device launches per micro-step: its blocks' (the fullest stage's ceil(L/p)), those
    outside the blocks, and FSDP2's per block (ZeRO-2: a gather and a reduce-scatter; ZeRO-3: two gathers)."""
    blocks = math.ceil(layers / (config.pp_size or 1))
    kernels = blocks * KERNELS_PER_BLOCK + KERNELS_OUTSIDE_BLOCKS
    if (config.dp_shard_size or 1) > 1 and config.zero_stage in (2, 3):
        kernels += blocks * (config.zero_stage) * KERNELS_PER_COLLECTIVE
    return kernels


def stages_per_device(config: ParallelismConfig) -> int:
    """Pipeline stages each device holds (the interleaved schedule's v): as many as pp_split_points make
    per device, else 2 for "interleaved" (unison's default split), else 1."""
    pp = config.pp_size or 1
    if config.pp_split_points is not None:
        return max(1, (len(config.pp_split_points) + 1) // pp)
    return 2 if config.pp_schedule == "interleaved" else 1


def _data_parallel(
    config: ParallelismConfig,
    parameters: tuple[float, float],
    blocks: int,
    micro_steps: int,
    backward: float,
    pp: int,
    link: Any,
    strides: tuple[int, int, int],
    communication: dict[str, float],
    exposed: dict[str, float],
) -> None:
    """The gradient (and, sharded, parameter) traffic of the data-parallel dimensions, added to the dicts:
    `parameters` = (held, trainable): every held parameter is gathered, only trainable ones send gradients
    (DDP buckets and FSDP2 reduce-scatters the parameters with requires_grad=True only)."""
    inner, shards, replicas = strides
    held, trainable = parameters
    gradients = trainable * GRADIENT_BYTES
    weights = held * ACTIVATION_BYTES
    stage = config.zero_stage if shards > 1 else None
    if stage in (None, 1):
        # DDP and ZeRO-1: one all-reduce per step (ZeRO-1's reduce-scatter + all-gather move the same
        # bytes), over every data-parallel rank; it overlaps the last micro-step's backward, except after
        # a pipeline's flush, where nothing is left to overlap
        dp = shards * replicas
        seconds = _all_reduce(gradients, dp, link(inner, dp))
        window = 0.0 if pp > 1 else backward / micro_steps
        communication["dp all-reduce"] = seconds
        exposed["dp all-reduce"] = max(0.0, seconds - window)
        return
    # FSDP2 (ZeRO-2/3, HSDP): per block and micro-step, gathers in forward (ZeRO-3: in backward too) and a
    # reduce-scatter of its gradients; replicas all-reduce the reduced shard. Prefetch overlaps them with
    # the compute of the neighbouring blocks: step_cost's _hide_under_compute exposes what exceeds it.
    shard_link = link(inner, shards)
    gathers = 2 if stage == 3 else 1
    gather = micro_steps * blocks * gathers * _all_gather(weights / blocks, shards, shard_link)
    scatter = micro_steps * blocks * _reduce_scatter(gradients / blocks, shards, shard_link)
    communication["zero all-gather"] = gather
    communication["zero reduce-scatter"] = scatter
    if replicas > 1:
        communication["hsdp all-reduce"] = (
            micro_steps
            * blocks
            * _all_reduce(gradients / blocks / shards, replicas, link(inner * shards, replicas))
        )


def _expert_parallel(
    shape: ModelShape,
    config: ParallelismConfig,
    batch: Batch,
    micro_steps: int,
    link: Any,
    strides: tuple[int, int],
    communication: dict[str, float],
    exposed: dict[str, float],
) -> None:
    """Expert parallelism's traffic: each MoE layer's two all-to-alls (tokens to their experts and back)
    in forward and again in backward (and in the recomputed forward), on the critical path; and FSDP2's
    gathers and reduce-scatters of each process's experts over the EP groups beside it, hidden under the
    compute with ZeRO's own (`_hide_under_compute`)."""
    inner, shards = strides
    ep = config.ep_size
    layers = max(1, shape.expert_layers)
    # every token's hidden state goes to each of its k experts; (ep-1)/ep of it leaves the device
    routed = batch.micro_batch_size * batch.seq_len * shape.experts_per_token * (shape.hidden or 0)
    per_layer = 6 if batch.recompute else 4
    a2a = micro_steps * layers * per_layer * _all_to_all(routed * ACTIVATION_BYTES, ep, link(inner, ep))
    communication["ep all-to-all"] = exposed["ep all-to-all"] = a2a
    groups = shards // ep
    held = shape.expert_parameters / ep
    gathers = 2 if config.zero_stage == 3 else 1
    expert_link = link(inner * ep, groups)
    gather = (
        micro_steps * layers * gathers * _all_gather(held * ACTIVATION_BYTES / layers, groups, expert_link)
    )
    trained = held * shape.trainable_fraction
    scatter = micro_steps * layers * _reduce_scatter(trained * GRADIENT_BYTES / layers, groups, expert_link)
    communication["ep experts all-gather"] = gather
    communication["ep experts reduce-scatter"] = scatter


PREFETCHED = ("zero", "hsdp", "ep experts")
"""The kinds of traffic FSDP2 prefetches under the compute of the neighbouring blocks (by name prefix)."""


def _hide_under_compute(communication: dict[str, float], exposed: dict[str, float], compute: float) -> None:
    """What of FSDP2's gathers, reduce-scatters and replica all-reduces exceeds the compute is exposed,
    shared among them in proportion to their times."""
    prefetched = [kind for kind in communication if kind.startswith(PREFETCHED)]
    total = sum(communication[kind] for kind in prefetched)
    hidden = min(total, compute)
    for kind in prefetched:
        exposed[kind] = communication[kind] * (1 - hidden / total) if total else 0.0


def _all_to_all(size: float, ranks: int, link: _Link) -> float:
    """A pairwise all-to-all in which each rank holds `size` bytes, 1/ranks of it for each peer."""
    if ranks < 2:
        return 0.0
    return (ranks - 1) / ranks * size / link.bandwidth + (ranks - 1) * link.latency


def _all_reduce(size: float, ranks: int, link: _Link) -> float:
    """NCCL's faster of ring and tree for an all-reduce of `size` bytes over `ranks`."""
    if ranks < 2:
        return 0.0
    ring = 2 * (ranks - 1) / ranks * size / link.bandwidth + 2 * (ranks - 1) * link.latency
    tree = 2 * size / link.bandwidth + 2 * math.log2(ranks) * link.latency
    return min(ring, tree)


def _all_gather(shard_total: float, ranks: int, link: _Link) -> float:
    """A ring all-gather (or reduce-scatter) of a buffer of `shard_total` bytes in all over `ranks`."""
    if ranks < 2:
        return 0.0
    return (ranks - 1) / ranks * shard_total / link.bandwidth + (ranks - 1) * link.latency


_reduce_scatter = _all_gather
