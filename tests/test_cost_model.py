"""The step-time model (planning.cost_model): each term against its formula, computed here by hand, and the
whole model against the throughput Narayanan et al. 2021 (Megatron-LM) published for their layouts."""

from __future__ import annotations

import math

import pytest

from unison.parallel.config import ParallelismConfig
from unison.parallel.pipeline_split import _balance
from unison.planning.cost_model import (
    ACTIVATION_BYTES,
    GRADIENT_BYTES,
    HIDDEN_HALF_EFFICIENCY,
    KERNEL_SECONDS,
    KERNELS_OUTSIDE_BLOCKS,
    KERNELS_PER_BLOCK,
    KERNELS_PER_COLLECTIVE,
    LINK_EFFICIENCY,
    TOKENS_HALF_EFFICIENCY,
    Batch,
    DeviceSpec,
    step_cost,
)
from unison.planning.devices import DEFAULT_EFFICIENCY, DEVICES
from unison.planning.memory import ModelShape

A100 = DEVICES["a100-80gb"]
SEQ, VOCAB = 2048, 51200


def gpt(layers: int, hidden: int) -> ModelShape:
    """A GPT of Megatron's Table 1 shape: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))."""
    parameters = int(
        12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (VOCAB + SEQ) / (12 * layers * hidden))
    )
    return ModelShape(parameters, parameters, layers=layers, hidden=hidden, vocab=VOCAB)


def layout(devices: int, **sizes: int) -> ParallelismConfig:
    return ParallelismConfig(**sizes).validate(devices)


def test_compute_counts_6n_plus_attention_and_a_third_more_when_recomputing():
    shape = gpt(24, 2304)
    plain = step_cost(shape, layout(1), A100, 8, Batch(8, SEQ), efficiency=0.5)
    tokens = 8 * SEQ
    flops = (6 * shape.parameters + 12 * 24 * 2304 * SEQ) * tokens
    assert plain.model_flops == pytest.approx(flops)
    # a narrow model reaches less of the peak: h / (h + h0) of `efficiency`; a micro-batch of T tokens
    # T / (T + T0) of that
    assert plain.compute == pytest.approx(
        flops
        / (
            A100.peak_flops
            * 0.5
            * 2304
            / (2304 + HIDDEN_HALF_EFFICIENCY)
            * SEQ
            / (SEQ + TOKENS_HALF_EFFICIENCY)
        )
    )
    recomputed = step_cost(shape, layout(1), A100, 8, Batch(8, SEQ, recompute=True), efficiency=0.5)
    assert recomputed.hardware_flops == pytest.approx(flops * 4 / 3)
    assert recomputed.model_flops == pytest.approx(flops)  # MFU does not count the recomputation
    assert recomputed.compute == pytest.approx(plain.compute * 4 / 3)
    assert recomputed.mfu == pytest.approx(plain.mfu * 3 / 4, rel=0.01)  # the launches are not recomputed


@pytest.mark.parametrize("schedule, per_device", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_the_bubble_is_p_minus_1_over_vm_plus_p_minus_1_of_the_pipeline(schedule, per_device):
    p, dp, m = 4, 2, 12
    config = layout(p * dp, pp_size=p, dp_replicate_size=dp, pp_schedule=schedule)
    cost = step_cost(gpt(24, 1024), config, A100, 8, Batch(dp * m, SEQ))
    pipeline = cost.compute + cost.imbalance + cost.overhead  # the slowest stage's m micro-batches
    assert cost.bubble / (pipeline + cost.bubble) == pytest.approx((p - 1) / (per_device * m + p - 1))


def test_a_pipeline_runs_at_its_slowest_stage_as_unisons_split_cuts_it_and_the_output_layer():
    shape, dp, m = gpt(10, 1024), 2, 8
    cost = step_cost(shape, layout(8, pp_size=4, dp_replicate_size=dp), A100, 8, Batch(dp * m, SEQ))
    per_token = 6 * shape.parameters + 12 * 10 * 1024 * SEQ
    head = 6 * VOCAB * 1024
    block = (per_token - head) / 10
    # the pipeline's own split: equal parameters, the embedding with the first block, the output layer
    # with the last (each 4.2 blocks' worth here), so the end stages hold 1 block and the middle ones 8,
    # the last of them as many as the largest load allows (the split's tie-break): 5
    weights = [12 * 1024**2 + 13 * 1024] * 10
    weights[0] += VOCAB * 1024
    weights[-1] += VOCAB * 1024
    starts = [*_balance(weights, 4), 10]
    blocks = [b - a for a, b in zip(starts, starts[1:])]
    assert blocks == [1, 3, 5, 1]
    slowest = max(5 * block, 1 * block + head) * dp * m * SEQ / dp
    rate = A100.peak_flops * DEFAULT_EFFICIENCY * 1024 / (1024 + HIDDEN_HALF_EFFICIENCY)
    rate *= SEQ / (SEQ + TOKENS_HALF_EFFICIENCY)
    assert cost.compute + cost.imbalance == pytest.approx(slowest / rate)
    assert cost.compute == pytest.approx(per_token * dp * m * SEQ / 8 / rate)


def test_a_micro_batch_of_few_tokens_runs_slower_and_every_micro_step_pays_its_kernel_launches():
    shape, tokens = gpt(12, 768), 480 * 1024
    costs = {
        b: step_cost(shape, layout(8, dp_replicate_size=8), A100, 8, Batch(480, 1024, b)) for b in (1, 12)
    }
    for b, cost in costs.items():
        rows = b * 1024
        rate = A100.peak_flops * DEFAULT_EFFICIENCY * 768 / (768 + HIDDEN_HALF_EFFICIENCY)
        rate *= rows / (rows + TOKENS_HALF_EFFICIENCY)
        assert cost.compute == pytest.approx(cost.hardware_flops / 8 / rate)
        kernels = 12 * KERNELS_PER_BLOCK + KERNELS_OUTSIDE_BLOCKS
        assert cost.overhead == pytest.approx(480 // (8 * b) * kernels * KERNEL_SECONDS)
        assert cost.tokens == tokens
    # GPT-2 small in micro-batches of one sequence: 60 micro-steps of 1,024 rows, a quarter slower or more
    assert costs[1].step > 1.25 * costs[12].step
    # a large model's micro-batch of one long sequence loses little (Megatron-LM trains at micro-batch 1)
    wide = [step_cost(gpt(96, 12288), layout(8, tp_size=8), A100, 8, Batch(8, SEQ, b)) for b in (1, 8)]
    assert wide[0].step < 1.1 * wide[1].step
    # FSDP2 launches its gathers and reduce-scatters each micro-step: ZeRO-3 pays more than ZeRO-2, DDP none
    zero = {
        stage: step_cost(shape, layout(8, dp_shard_size=8, zero_stage=stage), A100, 8, Batch(480, 1024, 12))
        for stage in (2, 3)
    }
    for stage, cost in zero.items():
        extra = 5 * 12 * stage * KERNELS_PER_COLLECTIVE * KERNEL_SECONDS
        assert cost.overhead == pytest.approx(costs[12].overhead + extra)


def test_an_all_reduce_moves_2_n_minus_1_over_n_of_the_gradients_over_the_link_it_crosses():
    shape = gpt(24, 2304)
    batch = Batch(64, SEQ)
    one_node = step_cost(shape, layout(8, dp_replicate_size=8), A100, 8, batch)
    gradients = shape.parameters * GRADIENT_BYTES
    nvlink = A100.intra_node_bandwidth * LINK_EFFICIENCY
    expected = 2 * 7 / 8 * gradients / nvlink + 2 * 7 * A100.intra_node_latency
    assert one_node.communication["dp all-reduce"] == pytest.approx(expected)
    two_nodes = step_cost(shape, layout(16, dp_replicate_size=16), A100, 8, batch)
    network = A100.inter_node_bandwidth * LINK_EFFICIENCY
    assert two_nodes.communication["dp all-reduce"] == pytest.approx(
        2 * 15 / 16 * gradients / network + 2 * 15 * A100.inter_node_latency
    )
    # DDP's buckets overlap the last micro-step's backward (2/3 of its compute): only the rest is exposed
    window = two_nodes.compute * 2 / 3 / batch.micro_steps(16)
    assert two_nodes.exposed["dp all-reduce"] == pytest.approx(
        max(0.0, two_nodes.communication["dp all-reduce"] - window)
    )


def test_a_tiny_all_reduce_takes_the_tree_and_pays_log_n_latencies():
    tiny = DeviceSpec("tiny link", 1e12, 2**30, 1e15, 1e15)  # bandwidth so high that latency is all
    cost = step_cost(gpt(2, 64), layout(64, dp_replicate_size=64), tiny, 8, Batch(64, 16))
    assert cost.communication["dp all-reduce"] == pytest.approx(
        2 * math.log2(64) * tiny.inter_node_latency, rel=1e-3
    )


def test_zero3_gathers_twice_what_zero2_gathers_and_both_reduce_scatter_the_same():
    shape, batch = gpt(24, 2304), Batch(32, SEQ)
    zero2 = step_cost(shape, layout(8, dp_shard_size=8, zero_stage=2), A100, 8, batch)
    zero3 = step_cost(shape, layout(8, dp_shard_size=8, zero_stage=3), A100, 8, batch)
    assert zero3.communication["zero all-gather"] == pytest.approx(2 * zero2.communication["zero all-gather"])
    assert zero3.communication["zero reduce-scatter"] == pytest.approx(
        zero2.communication["zero reduce-scatter"]
    )
    micro_steps, blocks = 4, 24
    per_block = (
        7 / 8 * shape.parameters * ACTIVATION_BYTES / blocks / (A100.intra_node_bandwidth * LINK_EFFICIENCY)
    )
    assert zero2.communication["zero all-gather"] == pytest.approx(
        micro_steps * blocks * (per_block + 7 * A100.intra_node_latency)
    )
    # prefetch hides the gathers behind compute: on NVLink nothing is exposed
    assert sum(zero3.exposed.values()) == 0.0


def test_tensor_parallel_all_reduces_four_activations_per_layer_and_micro_batch_none_hidden():
    shape, b = gpt(24, 2304), 2
    config = layout(8, tp_size=4, dp_replicate_size=2)
    cost = step_cost(shape, config, A100, 8, Batch(8, SEQ, micro_batch_size=b))
    activation = b * SEQ * 2304 * ACTIVATION_BYTES
    one = (
        2 * 3 / 4 * activation / (A100.intra_node_bandwidth * LINK_EFFICIENCY)
        + 2 * 3 * A100.intra_node_latency
    )
    assert cost.communication["tp all-reduce"] == pytest.approx(2 * 24 * 4 * one)  # 2 micro-steps
    assert cost.exposed["tp all-reduce"] == cost.communication["tp all-reduce"]
    recomputed = step_cost(shape, config, A100, 8, Batch(8, SEQ, micro_batch_size=b, recompute=True))
    assert recomputed.communication["tp all-reduce"] == pytest.approx(2 * 24 * 6 * one)


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="global batch 10 does not split .* multiple of 8"):
        step_cost(gpt(2, 64), layout(4, dp_replicate_size=4), A100, 8, Batch(10, 16, micro_batch_size=2))
    with pytest.raises(ValueError, match="efficiency=1.5"):
        step_cost(gpt(2, 64), layout(1), A100, 8, Batch(1, 16), efficiency=1.5)
    with pytest.raises(ValueError, match="peak_flops=0 for device 'x'"):
        DeviceSpec("x", 0, 1, 1, 1)


# Narayanan et al. 2021, Table 1: GPT models trained with TP + PP + DP on A100 80GB (8 per node, HDR
# InfiniBand), sequence 2048, vocabulary 51,200, full recomputation; achieved TFLOP/s per GPU.
MEGATRON_TABLE_1 = [
    # billions, layers, hidden, tp, pp, GPUs, global batch, published TFLOP/s per GPU
    (1.7, 24, 2304, 1, 1, 32, 512, 137),
    (3.6, 30, 3072, 2, 1, 64, 512, 138),
    (7.5, 36, 4096, 4, 1, 128, 512, 142),
    (18.4, 40, 6144, 8, 1, 256, 1024, 135),
    (39.1, 48, 8192, 8, 2, 512, 1536, 138),
    (76.1, 60, 10240, 8, 4, 1024, 1792, 140),
    (145.6, 80, 12288, 8, 8, 1536, 2304, 148),
    (310.1, 96, 16384, 8, 16, 1920, 2160, 155),
    (529.6, 105, 20480, 8, 35, 2520, 2520, 163),
    (1008.0, 128, 25600, 8, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize("billions, layers, hidden, tp, pp, gpus, batch, published", MEGATRON_TABLE_1)
def test_megatron_table_1_throughput_is_predicted_within_25_percent(
    billions, layers, hidden, tp, pp, gpus, batch, published
):
    shape = gpt(layers, hidden)
    assert shape.parameters / 1e9 == pytest.approx(billions, rel=0.03)  # the paper rounds to 0.1B
    dp = gpus // (tp * pp)
    config = layout(gpus, tp_size=tp, pp_size=pp, dp_replicate_size=dp)
    cost = step_cost(shape, config, A100, 8, Batch(batch, SEQ, recompute=True))
    assert cost.tflops_per_device == pytest.approx(published, rel=0.25)


LLAMA_3_1_405B = ModelShape(405_853_388_800, 405_853_388_800, layers=126, hidden=16384, vocab=128256)


@pytest.mark.parametrize("gpus, dp, published", [(8192, 64, 430), (16384, 128, 400)])
def test_llama_3_1_405b_throughput_as_meta_published_it(gpus, dp, published):
    """Llama 3 paper, Table 4: H100s, TP 8 x PP 16 x DP, sequences of 8,192, 16M tokens per step, the
    interleaved schedule with one block per virtual stage (126 blocks and the embedding and output layers
    over 16 x 8 stages); 430 and 400 TFLOP/s per GPU (43% and 41% of peak)."""
    one_block_per_stage = [f"layers.{i}" for i in range(16 * 8 - 1)]
    config = layout(
        gpus,
        tp_size=8,
        pp_size=16,
        dp_replicate_size=dp,
        pp_schedule="interleaved",
        pp_split_points=one_block_per_stage,
    )
    cost = step_cost(LLAMA_3_1_405B, config, DEVICES["h100"], 8, Batch(2048, 8192))
    assert cost.tflops_per_device == pytest.approx(published, rel=0.25)


def test_nanogpt_gpt2_124m_on_8_a100_as_its_readme_reports():
    """nanoGPT's GPT-2 124M run: 8 x A100 40GB, DDP, 12 x 1024 tokens per micro-batch, 40 micro-batches per
    step (491,520 tokens), 600,000 steps in about 4 days: about 853,000 tokens/s."""
    parameters = 124_439_808 + 1024 * 768  # nanoGPT counts its position embeddings too
    shape = ModelShape(parameters, parameters, layers=12, hidden=768, vocab=50304)
    cost = step_cost(shape, layout(8, dp_replicate_size=8), DEVICES["a100-40gb"], 8, Batch(480, 1024, 12))
    assert cost.tokens_per_second == pytest.approx(600_000 * 491_520 / (4 * 86_400), rel=0.25)
