"""The planner, memory formulas and cost model with mixtures of experts (expert parallelism, `ep_size`).

Mixtral-8x7B's shape is built from transformers' default MixtralConfig on the meta device (no download,
no memory): 46.7B parameters, 45.1B of them in experts, 12.9B active per token (Mistral AI's figures).
Its users train it with the experts divided over the 8 GPUs of a node (EP 8: Megatron-LM's and NeMo's
Mixtral recipes, torchtitan's MoE placement); on 8 H100s its full training state (16 bytes a parameter,
93 GB per GPU sharded over 8) fits on no layout of the devices alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from unison.parallel.config import ParallelismConfig  # noqa: E402
from unison.planning import layout_memory as plan_memory  # noqa: E402
from unison.planning.cost_model import ACTIVATION_BYTES, Batch, step_cost  # noqa: E402
from unison.planning.devices import DEVICES  # noqa: E402
from unison.planning.inputs import model_facts  # noqa: E402
from unison.planning.planner import Hardware, Workload, parse_memory, plan_for  # noqa: E402


@pytest.fixture(scope="module")
def mixtral():
    with torch.device("meta"):
        return model_facts(transformers.MixtralForCausalLM(transformers.MixtralConfig()))


def test_the_shape_counts_experts_and_the_parameters_a_token_uses(mixtral):
    shape = mixtral.shape
    assert round(shape.parameters / 1e9, 1) == 46.7 and round(shape.expert_parameters / 1e9, 1) == 45.1
    assert (shape.experts, shape.expert_layers, shape.experts_per_token) == (8, 32, 2)
    assert round(shape.active_parameters / 1e9, 1) == 12.9


def test_expert_parallel_memory_holds_each_processs_experts_sharded_over_the_groups_beside_it(mixtral):
    """ep=8 x dp_shard=64 under ZeRO-3: the dense part over 64, each process's 1/8 of the experts over the
    8 EP groups: the same model state as ZeRO-3 over 64, but a gathered block with 1/8 of its experts."""
    workload = Workload("bf16-mixed")
    ep = ParallelismConfig(ep_size=8, dp_shard_size=64, zero_stage=3).validate(64)
    zero3 = ParallelismConfig(dp_shard_size=64, zero_stage=3).validate(64)
    device = parse_memory("80GB")
    with_ep = plan_memory.layout_memory(mixtral, device, workload, ep)
    without = plan_memory.layout_memory(mixtral, device, workload, zero3)
    precision = workload.bytes
    shape, in_block = mixtral.shape, mixtral.shape.expert_parameters // 32
    dense = shape.parameters - shape.expert_parameters
    assert with_ep.optimizer == precision.optimizer_bytes * (
        -(-dense // 64) + -(-(shape.expert_parameters // 8) // 8)
    )
    # the gathered unit: one block's dense part and 1/8 of its experts (0.22B, less than the embedding and
    # output layer outside the blocks, 0.26B, which are then the largest unit), against a whole block
    gathered = with_ep.parameters - precision.param_bytes * (
        -(-dense // 64) + -(-(shape.expert_parameters // 8) // 8)
    )
    whole = without.parameters - precision.param_bytes * -(-shape.parameters // 64)
    unit = max(mixtral.block_parameters - in_block + in_block // 8, mixtral.root_parameters)
    assert gathered / whole == pytest.approx(unit / mixtral.block_parameters, rel=1e-3)


def test_the_all_to_all_bytes_follow_the_tokens_routed(mixtral):
    """Each MoE layer sends every token's hidden state to its k experts and back, in forward and backward:
    4 all-to-alls per layer and micro-batch, each (ep-1)/ep of b·s·k·h bf16 values off the device."""
    device = DEVICES["h100"]
    config = ParallelismConfig(ep_size=8, dp_shard_size=8, zero_stage=3).validate(8)
    batch = Batch(global_batch=16, seq_len=4096, micro_batch_size=1)
    cost = step_cost(mixtral.shape, config, device, 8, batch)
    routed = 1 * 4096 * 2 * 4096 * ACTIVATION_BYTES
    per_all_to_all = 7 / 8 * routed / (device.intra_node_bandwidth * 0.75) + 7 * device.intra_node_latency
    assert cost.communication["ep all-to-all"] == pytest.approx(2 * 32 * 4 * per_all_to_all)
    assert cost.exposed["ep all-to-all"] == cost.communication["ep all-to-all"]  # on the critical path
    # MoE compute counts the active parameters: 6 x 12.9B per token, not 6 x 46.7B
    assert cost.model_flops == pytest.approx(
        (6 * mixtral.shape.active_parameters + 12 * 32 * 4096 * 4096) * 16 * 4096
    )


def test_mixtral_on_64_h100s_gets_its_experts_divided_over_each_node(mixtral):
    hardware = Hardware(64, parse_memory("80GB"), 8, "nvlink", "infiniband")
    workload = Workload("bf16-mixed", seq_len=4096, global_batch_size=256)
    plan = plan_for(mixtral, hardware, workload, "h100")
    assert (plan.config.ep_size, plan.config.dp_shard_size, plan.config.zero_stage) == (8, 64, 3)
    assert plan.memory.fraction <= 0.75
    dense = [c for c in plan.runners_up if (c.config.ep_size or 1) == 1]
    assert dense and plan.cost.step < min(c.cost.step for c in dense)  # faster than every dense layout
    assert any("EP 8 inside a node" in reason for reason in plan.reasons)


def test_mixtral_on_8_h100s_fits_no_layout_on_the_devices_and_offloads(mixtral):
    hardware = Hardware(8, parse_memory("80GB"))
    workload = Workload("bf16-mixed", seq_len=4096, global_batch_size=256)
    plan = plan_for(mixtral, hardware, workload, "h100")
    assert plan.config.offload and plan.config.zero_stage == 3
    ep = ParallelismConfig(ep_size=8, dp_shard_size=8, zero_stage=3).validate(8)
    need = plan_memory.layout_memory(mixtral, parse_memory("80GB"), Workload("bf16-mixed"), ep)
    assert need.fraction > 1  # the model state alone: 16 bytes x 46.7B / 8


def test_estimate_memory_adds_an_expert_parallel_row_for_a_mixture_of_experts(mixtral):
    """`unison estimate-memory` at 64 devices: ep8 + ZeRO-3 beside ZeRO-3, the same Adam state (both
    shard every parameter over 64) and a smaller gathered block."""
    from unison.planning.memory_table import estimate

    result = estimate(mixtral.shape, 64)
    rows = {row.strategy: row for row in result.rows if row.precision == "fp32"}
    ep, zero3 = rows["ep8_zero3"], rows["zero3"]
    assert ep.optimizer == zero3.optimizer == 8 * -(-mixtral.shape.parameters // 64)
    dense = mixtral.shape.parameters - mixtral.shape.expert_parameters
    state = 4 * (-(-dense // 64) + -(-(mixtral.shape.expert_parameters // 8) // 8))
    assert state < ep.parameters < zero3.parameters  # its gathered unit: the embedding, not a whole block
    assert any("ep=8 + ZeRO-3 row divides the experts over 8 processes" in note for note in result.notes)
    dense_model = estimate(dataclasses.replace(mixtral.shape, experts=0, expert_parameters=0), 64)
    assert not any(row.strategy.startswith("ep") for row in dense_model.rows)
