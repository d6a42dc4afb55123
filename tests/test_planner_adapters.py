"""Fine-tuning with frozen weights or adapters in `unison plan` and `unison estimate-memory` (issue 40,
part 5): gradients and Adam state count the trainable parameters only (requires_grad=True) and shard as
the layout shards them, the frozen weights count and shard as parameters, frozen weights send no
gradients in the cost model, and a PEFT-wrapped model built on meta plans as its base model does.

In-process and on the meta device, but for one tiny CPU forward that measures autocast's saved copies.
The 70B shapes are examples/llama/lora.py's (the factories docs/planner.md shows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math

import pytest
import torch
from launching import REPO_ROOT

from unison.commands.main import main
from unison.parallel.blocks import find_blocks
from unison.parallel.config import ParallelismConfig
from unison.planning import cost_model, inputs, memory, memory_table, planner
from unison.planning.layout_memory import layout_memory
from unison.planning.planner import Hardware, PlanError, Workload, parse_memory

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

GiB = 2**30
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_70B = "examples/llama/lora.py:llama_70b_lora"
FULL_70B = "examples/llama/lora.py:llama_70b"
H100 = parse_memory("80GB")


def tiny_llama(lora: bool, device: str = "meta") -> torch.nn.Module:
    """transformers' Llama, 2 blocks of hidden 64; with LoRA r=4 on the attention projections."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
        if lora:
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=TARGETS))
    return model


@functools.cache
def facts_70b(target: str) -> inputs.ModelFacts:
    return planner.model_facts(memory.build_on_meta(f"{REPO_ROOT}/{target}"))


def counts(model: torch.nn.Module, blocks: torch.nn.ModuleList) -> dict[str, int]:
    """What the estimate must find, counted here from requires_grad directly."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_block = [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks]
    return {
        "total": total,
        "trainable": trainable,
        "unit_trainable": max(*per_block, trainable - sum(per_block)),
    }


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradients_and_adam_state_count_trainable_parameters_only(lora):
    model = tiny_llama(lora)
    blocks = find_blocks(model)[1]
    want = counts(model, blocks)
    shape = memory.inspect_model(model)
    assert (shape.parameters, shape.trainable_parameters) == (want["total"], want["trainable"])
    assert (shape.layers, shape.hidden, shape.vocab) == (2, 64, 256)  # blocks found through the wrappers
    assert shape.blocks == ("base_model.model.model.layers" if lora else "model.layers")
    if lora:  # r·(in + out) per projection: q 4·128, k and v 4·96, o 4·128, in each of the 2 blocks
        assert want["trainable"] == 2 * 4 * (128 + 96 + 96 + 128) == 3584
    one = {(r.precision, r.strategy): r for r in memory_table.estimate(shape, devices=1).rows}
    four = {(r.precision, r.strategy): r for r in memory_table.estimate(shape, devices=4).rows}
    for precision in memory.PRECISIONS:
        single = one[precision.name, "single"]
        assert single.gradients == precision.grad_bytes * want["trainable"]
        assert single.optimizer == precision.optimizer_bytes * want["trainable"]
        copies = precision.autocast_copy_bytes * shape.reached_parameters  # bf16-mixed's casts, else 0
        assert single.parameters == precision.param_bytes * want["total"] + copies
        shard = math.ceil(want["trainable"] / 4)
        zero1, zero3 = four[precision.name, "zero1"], four[precision.name, "zero3"]
        assert (zero1.gradients, zero1.optimizer) == (
            precision.grad_bytes * want["trainable"],
            precision.optimizer_bytes * shard,
        )
        assert zero3.gradients == precision.grad_bytes * (shard + want["unit_trainable"])
        assert zero3.optimizer == precision.optimizer_bytes * shard
        assert zero3.parameters == (
            precision.param_bytes * math.ceil(want["total"] / 4)
            + precision.gathered_bytes * shape.largest_unit
        )
    if lora:
        assert any(
            "trainable 3.2% (3,584 of 110,400)" in note for note in memory_table.estimate(shape, 1).notes
        )


def test_autocast_keeps_bf16_copies_of_the_frozen_weights_backward_passes_through():
    """A LoRA step keeps autocast's bf16 copy of nearly every frozen weight (its input's gradient needs
    it), measured with torch's saved tensors on the CPU: what bf16-mixed's parameter column adds is
    reached_parameters, not the adapters' few trainable ones."""
    model = tiny_llama(True, device="cpu")
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    copies: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.bfloat16 and {tuple(tensor.shape), tuple(tensor.shape[::-1])} & weights:
            copies[tensor.untyped_storage().data_ptr()] = tensor.numel()
        return tensor

    ids = torch.randint(0, 256, (1, 10))  # 10 tokens: no activation has a weight's shape
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        model(input_ids=ids)
    shape = memory.inspect_model(model)
    measured = sum(copies.values())
    # every matmul weight but the embedding (a lookup) and the first block's frozen q, k, v (their input
    # needs no gradient yet); the estimate counts all from the first trainable parameter on: the first
    # block's k and v and the 1-D norms too, a little over
    assert shape.trainable_parameters < 0.1 * measured
    assert 0.9 * shape.reached_parameters < measured <= shape.reached_parameters


def test_a_peft_model_on_meta_plans_as_its_base_model():
    lora, full = facts_70b(LORA_70B), facts_70b(FULL_70B)
    per_block = 16 * ((8192 + 8192) * 2 + (8192 + 1024) * 2)  # r·(in + out): q, o; k, v
    assert per_block == 819_200
    assert lora.shape.trainable_parameters == 80 * per_block == 65_536_000
    assert lora.shape.parameters == full.shape.parameters + 65_536_000 == 70_619_242_496
    assert (lora.blocks, lora.shape.layers, lora.shape.hidden, lora.heads, lora.kv_heads) == (
        80,
        80,
        8192,
        64,
        8,
    )
    assert lora.shape.blocks == "base_model.model.model.layers"
    assert lora.block_parameters == full.block_parameters + per_block
    assert (lora.block_trainable, lora.root_trainable, lora.largest_unit_trainable) == (
        per_block,
        0,
        per_block,
    )
    assert lora.largest_layer == "base_model.model.model.embed_tokens" and lora.largest_layer_trainable == 0
    assert lora.shape.describe_trainable() == "trainable 0.093% (65.5M of 70.6B)"
    # backward starts at the first block's q_proj adapter: the embedding and that q_proj's frozen weight,
    # registered before it, are not passed through
    assert lora.shape.reached_parameters == lora.shape.parameters - 128256 * 8192 - 8192 * 8192
    assert full.shape.reached_parameters == full.shape.parameters == full.shape.trainable_parameters


def test_70b_with_lora_fits_where_full_fine_tuning_does_not():
    """`unison plan --devices 8 --device h100`: training all 70.55B parameters needs the host's memory
    (ZeRO-3 offloaded) on 8 H100s and 32 of them (4 nodes) to run on the devices alone; with LoRA ZeRO-3
    over 8 holds the fp32 weights' shards, the gathered root and the adapters' state on each."""
    lora, full = facts_70b(LORA_70B), facts_70b(FULL_70B)
    eight = Hardware(8, H100)
    chosen = planner.plan_for(full, eight, Workload(), "h100")
    assert chosen.config.offload and chosen.config.dp_shard_size == 8
    chosen = planner.plan_for(lora, eight, Workload(), "h100")
    assert chosen.config.describe() == "dp_shard=8 (ZeRO-3)"
    need, p, t = chosen.memory, lora.shape.parameters, lora.shape.trainable_parameters
    assert need.parameters == 4 * math.ceil(p / 8) + 4 * lora.largest_unit  # the root: embedding + lm_head
    assert need.gradients == 4 * (t // 8 + 819_200) == 36_044_800  # a block's adapters held whole
    assert need.optimizer == 8 * t // 8 == 65_536_000
    assert f"{need.total / GiB:.2f} GiB, {need.fraction:.0%}" == "40.81 GiB, 51%"
    run = Workload("bf16-mixed", 1, 4096, activation_checkpointing=True)

    def smallest(facts: inputs.ModelFacts) -> tuple[int, planner.Plan]:
        for devices in (1, 2, 4, 8, 16, 32):
            with contextlib.suppress(PlanError):
                plan = planner.plan_for(facts, Hardware(devices, H100, nodes=max(1, devices // 8)), run)
                if not plan.config.offload:
                    return devices, plan
        raise AssertionError("nothing fits on 32 devices")

    devices, plan = smallest(full)
    assert (devices, plan.config.describe()) == (
        32,
        "pp=2 x dp_shard=2 x tp=8 (ZeRO-1), pp_schedule=1f1b, activation_checkpointing=full",
    )
    assert f"{plan.memory.total / GiB:.2f}" == "55.26"
    devices, plan = smallest(lora)
    assert (devices, plan.config.describe()) == (8, "dp_shard=8 (ZeRO-3), activation_checkpointing=full")
    assert f"{plan.memory.total / GiB:.2f}" == "45.04"
    assert plan.memory.gradients + plan.memory.optimizer == 36_044_800 + 65_536_000


def test_70b_tables_and_priced_steps_as_the_docs_show_them():
    lora, full = facts_70b(LORA_70B), facts_70b(FULL_70B)
    for facts, ddp, zero3 in ((full, "1.03 TiB", "147.07 GiB"), (lora, "263.81 GiB", "40.81 GiB")):
        rows = {r.strategy: r for r in memory_table.estimate(facts.shape, 8).rows if r.precision == "fp32"}
        assert (memory.format_bytes(rows["ddp"].total), memory.format_bytes(rows["zero3"].total)) == (
            ddp,
            zero3,
        )
    run = Workload("bf16-mixed", None, 4096, activation_checkpointing=True, global_batch_size=64)
    slow = planner.plan_for(full, Hardware(8, H100), run, "h100")
    fast = planner.plan_for(lora, Hardware(8, H100), run, "h100")
    assert slow.config.offload and slow.cost.micro_batch_size == 4 and round(slow.cost.step, 1) == 47.5
    assert fast.config.describe() == "dp_shard=8 (ZeRO-3), activation_checkpointing=full"
    assert fast.cost.micro_batch_size == 2 and round(fast.cost.step, 1) == 28.0
    gradients = fast.cost.communication["zero reduce-scatter"], slow.cost.communication["zero reduce-scatter"]
    assert f"{gradients[0]:.3f} {gradients[1]:.2f}" == "0.014 1.47"


def test_a_pipeline_stage_holds_its_blocks_adapters():
    lora = facts_70b(LORA_70B)
    config = ParallelismConfig(dp_replicate_size=4, dp_shard_size=1, tp_size=1, pp_size=2).validate(8)
    need = layout_memory(lora, H100, Workload(), config)
    held = 40 * lora.block_parameters + math.ceil(lora.root_parameters / 2)
    assert (need.parameters, need.gradients, need.optimizer) == (4 * held, 4 * 40 * 819_200, 8 * 40 * 819_200)


def test_frozen_weights_send_no_gradients_and_compute_none():
    """The cost model: DDP's all-reduce and ZeRO's reduce-scatters carry the trainable parameters'
    gradients, ZeRO-3's gathers every weight; weight gradients are computed for trainable ones only."""
    p, t = 70_000_000_000, 70_000_000
    full = memory.ModelShape(p, p, layers=80, hidden=8192, vocab=128256)
    lora = dataclasses.replace(full, trainable_parameters=t, backward_parameters=p)
    batch = cost_model.Batch(64, 4096, 1)
    spec = planner.plan_speed.device_spec(Hardware(8, H100), "h100")
    zero3 = ParallelismConfig(dp_replicate_size=1, dp_shard_size=8, zero_stage=3).validate(8)
    ddp = ParallelismConfig(dp_replicate_size=8, dp_shard_size=1).validate(8)
    costs = {
        (name, kind): cost_model.step_cost(shape, config, spec, 8, batch)
        for name, shape in (("full", full), ("lora", lora))
        for kind, config in (("zero3", zero3), ("ddp", ddp))
    }
    assert (
        costs["lora", "zero3"].communication["zero all-gather"]
        == costs["full", "zero3"].communication["zero all-gather"]
    )
    link = cost_model._Link(spec.intra_node_bandwidth * cost_model.LINK_EFFICIENCY, spec.intra_node_latency)
    micro_steps, blocks = 8, 80
    scatter = micro_steps * blocks * cost_model._reduce_scatter(t * 4 / blocks, 8, link)
    assert costs["lora", "zero3"].communication["zero reduce-scatter"] == pytest.approx(scatter)
    assert costs["lora", "ddp"].communication["dp all-reduce"] == pytest.approx(
        cost_model._all_reduce(t * 4, 8, link)
    )
    attention = 12 * 80 * 8192 * 4096
    assert costs["full", "ddp"].model_flops == pytest.approx((6 * p + attention) * 64 * 4096)
    assert costs["lora", "ddp"].model_flops == pytest.approx((4 * p + 2 * t + attention) * 64 * 4096)
    assert cost_model.parameter_flops(lora) == pytest.approx(4.002)


def test_tp_is_proposed_for_an_adapter_model_only_where_its_plan_splits_it(monkeypatch):
    import unison.parallel.tensor as tensor

    model = tiny_llama(True)
    proposed = planner.model_facts(model).no_tensor_parallel is None
    try:
        plan = tensor.tensor_parallel_plan(model)
    except ValueError:
        plan = {}
    assert proposed == bool(plan)  # whatever unison's TP does with adapters today, planning agrees

    def refuse(model, *args, **kwargs):
        raise ValueError("no plan for this")

    monkeypatch.setattr(tensor, "tensor_parallel_plan", refuse)
    why = planner.model_facts(model).no_tensor_parallel
    assert why == (
        "adapter layers (peft.tuners.lora.layer.Linear at base_model.model.model.layers.0.self_attn.q_proj, "
        "...): no plan for this"
    )
    assert planner.model_facts(tiny_llama(False)).no_tensor_parallel is None  # no adapters: not asked
    monkeypatch.setattr(tensor, "tensor_parallel_plan", lambda model, *args, **kwargs: {})
    assert "names none of its modules" in planner.model_facts(model).no_tensor_parallel
    monkeypatch.undo()
    with torch.device("meta"):  # DoRA: a magnitude per output row, which the TP plan does not split
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
        dora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True))
    assert "carries a LoRA variant (DoRA" in planner.model_facts(dora).no_tensor_parallel

    lora = facts_70b(LORA_70B)
    blocked = dataclasses.replace(lora, no_tensor_parallel="a reason")
    allowed = dataclasses.replace(lora, no_tensor_parallel=None)
    workload = Workload("bf16-mixed", 1, 4096, activation_checkpointing=True)
    eight = Hardware(8, H100)
    assert any(c.tp_size > 1 for c in planner._ranked_layouts(allowed, eight, workload))
    assert all(c.tp_size == 1 for c in planner._ranked_layouts(blocked, eight, workload))
    reasons = planner.plan_for(blocked, eight, workload).reasons
    assert "TP not proposed: a reason" in reasons
    assert json.loads(planner.plan_for(blocked, eight, workload).to_json())["model"][
        "no_tensor_parallel"
    ] == ("a reason")


FROZEN = """\
import torch.nn as nn


def build():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    return model.requires_grad_(False)
"""

TINY_LORA = f"""\
import peft
import transformers


def build():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{TINY!r}))
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules={TARGETS!r}))
"""


def run(*argv: str) -> tuple[int, str]:
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = main(list(argv))
    return code, output.getvalue()


def test_a_model_with_nothing_to_train_is_refused_by_plan_and_flagged_by_the_estimate(tmp_path):
    (tmp_path / "frozen.py").write_text(FROZEN)
    target = f"{tmp_path / 'frozen.py'}:build"
    code, text = run("plan", target, "--devices", "2")
    assert code == 2 and "nothing to train: every one of the model's 144 parameters has requires_grad" in text
    code, text = run("estimate-memory", target, "--devices", "2")
    assert code == 0 and "144 parameters, trainable 0% (0 of 144)" in text
    assert "note: no trainable parameters: every parameter has requires_grad=False" in text


def test_plan_and_estimate_print_the_trainable_share(tmp_path):
    (tmp_path / "tiny_lora.py").write_text(TINY_LORA)
    target = f"{tmp_path / 'tiny_lora.py'}:build"
    share = "trainable 3.2% (3,584 of 110,400)"
    code, text = run("plan", target, "--devices", "2")
    assert code == 0 and f"memory per device, {share}: gradients and optimizer state of those only:" in text
    code, text = run("plan", target, "--devices", "2", "--json")
    model = json.loads(text)["model"]
    assert (model["parameters"], model["trainable_parameters"]) == (110_400, 3_584)
    assert model["trainable_fraction"] == pytest.approx(3_584 / 110_400)
    code, text = run("estimate-memory", target, "--devices", "2")
    assert code == 0 and f"110,400 parameters, {share}: gradients and optimizer state of those only" in text
    code, text = run("estimate-memory", target, "--json")
    assert json.loads(text)["model"]["trainable_fraction"] == pytest.approx(3_584 / 110_400)
