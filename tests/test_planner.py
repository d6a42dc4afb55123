"""`planning.planner` and `unison plan`: the decision tree on a table of cases and on published layouts.

Models are built on the meta device (shapes only), from the example models the docs name as TARGETs
(examples/llama/model.py, examples/gpt/model.py).
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
from launching import REPO_ROOT
from slowness import budget
from tiny_gpt import gpt_model, llama_model

from unison.commands.main import build_parser
from unison.parallel.config import ParallelismConfig
from unison.planning import memory, planner
from unison.planning.layout_memory import layout_memory
from unison.planning.planner import Hardware, PlanError, Workload, parse_memory

GiB = 2**30


# The shipped example models: the factories the docs show as TARGETs, and two sizes for the decision table.
llama_3_1_8b = llama_model.llama_3_1_8b
llama_3_1_405b = llama_model.llama_3_1_405b
gpt2_124m = gpt_model.gpt2_124m


def llama_1b() -> nn.Module:
    """~0.95B: small enough that the table's device sizes read like arithmetic (fp32: 15.2 GB of state)."""
    return llama_model.LlamaForCausalLM(_llama_1b_config())


def llama_1b_huge_vocab() -> nn.Module:
    """The same blocks under a 1M-token vocabulary: one 2.05B-parameter embedding, the largest layer."""
    return llama_model.LlamaForCausalLM(_llama_1b_config(vocab_size=1_000_000))


def _llama_1b_config(vocab_size: int = 32000):
    return llama_model.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=5632,
    )


@functools.cache
def facts(factory_name: str) -> planner.ModelFacts:
    with torch.device("meta"):
        return planner.model_facts(globals()[factory_name]())


def plan(factory_name: str, devices: int, device_memory: str, workload: Workload | None = None, **hardware):
    return planner.plan_for(
        facts(factory_name),
        Hardware(devices, parse_memory(device_memory), **hardware),
        workload or Workload(),
    )


def layout(config: ParallelismConfig) -> tuple:
    return (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.pp_size, config.zero_stage)


LLAMA_8B_RUN = Workload("bf16-mixed", micro_batch_size=1, seq_len=8192)
LLAMA_8B_RECOMPUTED = Workload("bf16-mixed", micro_batch_size=1, seq_len=8192, activation_checkpointing=True)

NODES_2 = {"nodes": 2}
PCIE = {"interconnect": "pcie"}
FAST_NODES_2 = {"nodes": 2, "inter_node": "infiniband"}
STATE = Workload()  # fp32, model state only

TABLE = [  # factory, devices, memory, hardware, workload, (dp_replicate, dp_shard, tp, pp, zero), reason
    pytest.param("llama_1b", 8, "40GB", {}, STATE, (8, 1, 1, 1, None), "case 1", id="fits: DDP"),
    pytest.param("llama_1b", 8, "12GB", {}, STATE, (1, 8, 1, 1, 2), "case 2", id="does not fit: ZeRO-2"),
    pytest.param(
        "llama_1b", 8, "5GB", {}, STATE, (1, 8, 1, 1, 3), "case 2", id="ZeRO-2 does not fit: ZeRO-3"
    ),
    pytest.param(
        "llama_1b", 8, "12GB", PCIE, STATE, (1, 4, 1, 2, 1), "faster than TP or ZeRO", id="PCIe: PP first"
    ),
    pytest.param(
        "llama_1b_huge_vocab", 8, "24GB", {}, STATE, (1, 2, 4, 1, 2), "case 3", id="largest layer: TP"
    ),
    pytest.param(
        "llama_3_1_8b",
        16,
        "80GB",
        NODES_2,
        LLAMA_8B_RECOMPUTED,
        (2, 8, 1, 1, 2),
        "HSDP",
        id="2 slow nodes: HSDP",
    ),
    pytest.param(
        "llama_3_1_8b",
        16,
        "80GB",
        FAST_NODES_2,
        LLAMA_8B_RECOMPUTED,
        (1, 16, 1, 1, 2),
        "ZeRO over all",
        id="2 fast nodes",
    ),
    pytest.param(
        "llama_1b", 16, "40GB", NODES_2, STATE, (16, 1, 1, 1, None), "case 1", id="2 nodes, fits: DDP"
    ),
]


@pytest.mark.parametrize("factory, devices, device_memory, hardware, workload, expected, reason", TABLE)
def test_decision_table(factory, devices, device_memory, hardware, workload, expected, reason):
    result = plan(factory, devices, device_memory, workload, **hardware)
    assert layout(result.config) == expected, result.reasons
    assert result.config.validate(devices) == result.config  # already valid for the world size
    assert any(reason in line for line in result.reasons), result.reasons
    assert result.memory.fraction <= planner.COMFORTABLE_FRACTION
    assert result.runners_up, "the runners-up say what else was priced"


def test_memory_of_a_layout_is_hand_computed_zero_arithmetic():
    """ZeRO-3 over 8 for the 8B run: shards + one gathered unit (embedding+head) + autocast's bf16 copies of
    every weight (kept for backward: FSDP2 reshards the fp32 weights, not the casts) + activations."""
    f = facts("llama_3_1_8b")
    n = f.shape.parameters
    assert n == 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 2 * 128256 * 4096 + 4096
    unit = 2 * 128256 * 4096 + 4096  # everything outside the blocks is the largest ZeRO-3 unit here
    assert f.largest_unit == unit
    zero3 = ParallelismConfig(dp_shard_size=8, zero_stage=3).validate(8)
    need = layout_memory(f, 80 * GiB, LLAMA_8B_RUN, zero3)
    assert need.parameters == 4 * math.ceil(n / 8) + 2 * unit  # fp32 shard, the unit gathered in bf16
    assert need.gradients == 4 * math.ceil(n / 8) + 4 * unit
    assert need.optimizer == 8 * math.ceil(n / 8)  # two fp32 Adam moments, sharded
    assert need.activations == 32 * 34 * 8192 * 4096 + 4 * 8192 * 128256  # 34·s·b·h per block + fp32 logits
    assert need.device_memory == 80 * GiB and need.total == sum(
        (need.parameters, need.gradients, need.optimizer, need.activations)
    )
    assert 0.70 < need.fraction < 0.75  # so the 8B without recomputation is ZeRO-3 alone (next test)
    recomputed = layout_memory(f, 80 * GiB, LLAMA_8B_RECOMPUTED, zero3)
    assert recomputed.parameters == need.parameters  # no autocast casts to recompute: FSDP2 gathers bf16
    # one block rebuilt + fp32 logits + each block's bf16 input + the final norm's and output layer's inputs
    assert recomputed.activations == (
        34 * 8192 * 4096 + 4 * 8192 * 128256 + 2 * 8192 * 4096 * 32 + 2 * 2 * 8192 * 4096
    )
    fp32 = layout_memory(f, 80 * GiB, Workload("fp32", 1, 8192), zero3)
    assert fp32.parameters == 4 * math.ceil(n / 8) + 4 * unit  # gathered in fp32
    tp2 = layout_memory(
        f, 80 * GiB, LLAMA_8B_RUN, ParallelismConfig(dp_shard_size=4, tp_size=2, zero_stage=2).validate(8)
    )
    held = math.ceil(n / 2)  # ZeRO-2 keeps its share gathered in bf16 beside the fp32 shards
    assert tp2.parameters == 2 * held + 4 * math.ceil(held / 4) and tp2.optimizer == 8 * math.ceil(held / 4)
    offloaded = layout_memory(
        f, 80 * GiB, LLAMA_8B_RUN, ParallelismConfig(dp_shard_size=8, zero_stage=3, offload=True).validate(8)
    )
    assert (offloaded.parameters, offloaded.gradients, offloaded.optimizer) == (2 * unit, 4 * unit, 0)


def test_llama_3_1_8b_on_8_h100_is_fsdp_as_meta_runs_it():
    """Meta / torchtitan run the 8B on one 8 x H100 node, seq 8192, with FSDP (ZeRO-3) alone, bf16 weights.

    unison's bf16 under ZeRO gathers bf16 weights over fp32 shards (FSDP2's MixedPrecisionPolicy), so
    ZeRO-3 over 8 fits comfortably (73%); ZeRO-2 comes first in the guide's order but holds the whole
    model gathered: only tightly (90%). With recomputation ZeRO-2 fits comfortably and, cheaper in
    traffic, wins.
    (Before the policy, autocast kept a bf16 copy of every weight on every device and the plan was TP 2.)
    """
    result = plan("llama_3_1_8b", 8, "80GB", LLAMA_8B_RUN)
    assert layout(result.config) == (1, 8, 1, 1, 3), result.reasons
    priced = {layout(c.config): c for c in result.runners_up}
    assert "fits only tightly (90% of a device)" in priced[1, 8, 1, 1, 2].why
    assert layout(plan("llama_3_1_8b", 8, "80GB", LLAMA_8B_RECOMPUTED).config) == (1, 8, 1, 1, 2)
    assert 7.9e9 < facts("llama_3_1_8b").shape.parameters < 8.1e9


@pytest.mark.serial
def test_llama_3_1_405b_on_512_h100_is_tp8_inside_nodes_pp_across_fsdp_over_the_rest():
    """Meta: TP 8 x PP 16 x DP 4 at seq 8192 (recomputed) with bf16 weights. unison's fp32 weights under
    autocast need twice the parameter bytes, so the plan goes one pipeline depth further: TP 8 x PP 32 x DP 2.
    """
    start = time.perf_counter()
    with torch.device("meta"):
        model = llama_3_1_405b()
    built = time.perf_counter() - start
    assert built < 5, f"building the 405B on meta took {built:.1f} s"
    workload = Workload("bf16-mixed", 1, 8192, activation_checkpointing=True)
    result = planner.plan_parallelism(
        model,
        Hardware(512, parse_memory("80GB"), nodes=64),
        micro_batch_size=1,
        seq_len=8192,
        precision="bf16-mixed",
        activation_checkpointing=True,
    )
    config = result.config
    assert 405e9 < result.model.shape.parameters < 406.5e9 and result.workload == workload
    assert config.tp_size == 8 and config.pp_size in (8, 16, 32)
    assert config.dp_shard_size == 512 // (8 * config.pp_size) and config.zero_stage == 1
    assert (config.pp_size, config.dp_shard_size) == (32, 2)
    assert config.activation_checkpointing == "full"  # priced with recomputation, so prepare() turns it on
    assert config.pp_microbatches >= 4 * config.pp_size and config.pp_schedule == "1f1b"
    assert any("PP across nodes" in line for line in result.reasons)
    # the heaviest stage: 4 of 126 blocks plus the embedding, split 8 ways by TP; one block's bf16 casts
    f = result.model
    held = math.ceil((4 * f.block_parameters + math.ceil(f.root_parameters / 2)) / 8)
    casts = 2 * math.ceil(f.block_parameters / 8)
    assert result.memory.parameters == 4 * held + casts and result.memory.optimizer == 8 * math.ceil(held / 2)
    same = planner.plan_for(f, result.hardware, workload)
    assert same.to_dict() == result.to_dict()  # pure: every rank that plans the same gets the same


def test_gpt2_124m_on_8_a100_is_plain_ddp():
    """nanoGPT: GPT-2 124M on 8 A100s (40 GB: micro-batch 12; 80 GB: 64), plain DDP."""
    f = facts("gpt2_124m")
    assert f.shape.parameters == 124_439_808 and f.heads == 12  # tied embedding counted once
    for device_memory, micro_batch in (("40GB", 12), ("80GB", 64)):
        result = plan("gpt2_124m", 8, device_memory, Workload("bf16-mixed", micro_batch, 1024))
        assert layout(result.config) == (8, 1, 1, 1, None), result.reasons
        assert "case 1" in result.reasons[1]


def test_nothing_fits_says_by_how_much_and_what_would_help():
    with pytest.raises(PlanError, match="nothing fits") as caught:
        plan("llama_3_1_405b", 512, "80GB", Workload("bf16-mixed", 1, 8192), nodes=64)
    message = str(caught.value)
    assert "activation checkpointing: fits as pp=32 x dp_shard=2 x tp=8 (ZeRO-1)" in message
    assert "more devices (up to" in message and "still does not fit" in message
    with pytest.raises(PlanError) as caught:
        plan("llama_1b", 1, "12GB")  # 15.2 GB of fp32 Adam state on one 12 GB device
    message = str(caught.value)
    assert "bf16 weights (model cast to bfloat16): fits as single process" in message
    assert "2 devices (one node): fits as dp_shard=2 (ZeRO-3)" in message


def test_offload_is_proposed_only_when_nothing_else_fits():
    """llama_1b's fp32 training state is 19.8 GB: ZeRO-3 over 2 devices of 12 GB fits, over 2 of 8 GB it
    does not, and only then does the plan keep the shards in host memory (with what that costs)."""
    assert plan("llama_1b", 2, "12GB").config.offload is False
    result = plan("llama_1b", 2, "8GB")
    assert layout(result.config) == (1, 2, 1, 1, 3) and result.config.offload
    host = memory.host_bytes(
        "zero3_offload",
        memory.PRECISIONS[0],
        result.model.shape.parameters,
        result.model.shape.trainable_parameters,
        2,
    )
    assert any(f"host memory: {memory.format_bytes(host)} per process" in line for line in result.reasons)
    assert result.memory.optimizer == 0 and "CPU offload" in result.reasons[-3]


def test_layouts_the_run_cannot_take_are_left_out():
    """parallelism="auto" for a loop without the pipeline step, or a model without a TP plan."""
    no_pipeline = Workload(pipeline=False)
    assert layout(plan("llama_1b", 8, "12GB", no_pipeline, interconnect="pcie").config) == (1, 8, 1, 1, 2)
    run_405b = Workload("bf16-mixed", 1, 8192, activation_checkpointing=True, pipeline=False)
    result = plan("llama_3_1_405b", 512, "80GB", run_405b, nodes=64)
    assert layout(result.config) == (1, 64, 8, 1, 3)  # TP inside nodes, ZeRO-3 across them
    with pytest.raises(PlanError) as caught:
        plan("llama_1b_huge_vocab", 8, "24GB", Workload(tensor_parallel=False))
    assert "allowing tensor parallelism: fits as dp_shard=2 x tp=4 (ZeRO-2)" in str(caught.value)


def test_bad_inputs_are_named_with_the_rule_and_the_fix():
    assert parse_memory("80GB") == parse_memory("80GiB") == parse_memory("80 G") == 80 * GiB
    assert parse_memory("512MB") == 512 * 2**20 and parse_memory("85899345920") == 80 * GiB
    assert parse_memory("1.5TB") == int(1.5 * 2**40)
    for bad in ("80 gigs", "GB", "-1GB", "0", "80iB", "eighty"):
        with pytest.raises(ValueError, match="not (a size|positive)"):
            parse_memory(bad)
    memory_bytes = 80 * GiB
    with pytest.raises(ValueError, match="devices=12 is not divisible by nodes=5"):
        Hardware(12, memory_bytes, nodes=5)
    with pytest.raises(ValueError, match="'ethernet' links nodes: give it as inter_node"):
        Hardware(8, memory_bytes, interconnect="ethernet")
    with pytest.raises(ValueError, match="inter_node='pigeon' is not a link between nodes"):
        Hardware(16, memory_bytes, nodes=2, inter_node="pigeon")
    with pytest.raises(ValueError, match="devices=0"):
        Hardware(0, memory_bytes)
    with pytest.raises(ValueError, match="precision='fp16' is unknown"):
        Workload("fp16")
    with pytest.raises(ValueError, match="activations need both"):
        Workload(micro_batch_size=4)


def test_detect_hardware_on_this_cpu_machine_and_plan_auto_for_the_tiny_gpt():
    from tiny_gpt import make_tiny_gpt

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hardware = planner.detect_hardware(world_size=4, local_world_size=2, device="cpu")
    assert hardware == Hardware(4, ram // 2, nodes=2, interconnect="pcie", inter_node="ethernet")
    assert planner.detect_hardware(4, 2, torch.device("cpu")) == hardware  # the same on every rank
    with pytest.raises(ValueError, match="world_size=3, local_world_size=2"):
        planner.detect_hardware(3, 2, "cpu")
    result = planner.plan_parallelism(make_tiny_gpt(0, 16), planner.detect_hardware(2, 2, "cpu"))
    assert layout(result.config) == (2, 1, 1, 1, None) and "case 1" in result.reasons[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_detect_hardware_reads_the_cuda_device():
    hardware = planner.detect_hardware(1, 1, "cuda")
    assert hardware.device_memory == torch.cuda.get_device_properties(0).total_memory
    assert hardware.devices == 1 and hardware.interconnect == "pcie"  # one GPU: nothing to link


DGX_TOPOLOGY = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tPXB\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t56-111\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t56-111\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X
"""
PCIE_TOPOLOGY = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPHB\t0-31\t0
GPU1\tPHB\t X \t0-31\t0
"""


def test_link_is_read_from_the_nvidia_smi_topology_matrix():
    assert planner.link_from_topology(DGX_TOPOLOGY, 4) == "nvlink"
    assert planner.link_from_topology(DGX_TOPOLOGY, 2, visible_devices="2,3") == "nvlink"
    assert planner.link_from_topology(PCIE_TOPOLOGY, 2) == "pcie"
    assert planner.link_from_topology(PCIE_TOPOLOGY, 4) == "pcie"  # more processes than GPUs listed
    assert planner.link_from_topology("nvidia-smi: command failed", 2) == "pcie"


def test_cli_json_for_scripts():
    result = subprocess.run(
        [sys.executable, "-m", "unison", "plan", "examples/llama/model.py:llama_3_1_405b", "--devices", "512",
         "--nodes", "64", "--device-memory", "80GB", "--precision", "bf16-mixed", "--micro-batch-size", "1",
         "--seq-len", "8192", "--activation-checkpointing", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=budget(120),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    config = ParallelismConfig(**report["config"])  # the fields are ParallelismConfig's own
    assert (config.tp_size, config.pp_size, config.dp_shard_size, config.zero_stage) == (8, 32, 2, 1)
    assert config.validate(512) == config
    keys = {"parameters", "gradients", "optimizer", "activations", "total", "device_memory", "fraction"}
    assert keys <= report["memory"].keys() and report["memory"]["device_memory"] == 80 * GiB
    parts = ("parameters", "gradients", "optimizer", "activations")
    assert report["memory"]["total"] == sum(report["memory"][part] for part in parts)
    assert any("case 2" in reason for reason in report["reasons"])
    assert report["runners_up"] and all({"config", "memory", "why"} <= r.keys() for r in report["runners_up"])


def test_cli_table_prints_config_memory_reasons_and_runners_up(capsys):
    code = _run_cli("plan", "tests/test_planner.py:llama_1b", "--devices", "8", "--device-memory", "12GB")
    out = capsys.readouterr().out
    assert code == 0
    assert "recommended: dp_shard=8 (ZeRO-2)" in out
    assert "  --parallelism dp_shard_size=8,zero_stage=2 " in out  # the layout to paste
    assert "case 2 (the guide: the model does not fit onto one device)" in out
    assert "one node linked by nvlink" in out and "runners-up:" in out and "does not fit" in out
    assert memory.format_bytes(plan("llama_1b", 8, "12GB").memory.total) in out


def test_cli_errors_exit_2_with_the_reason(capsys):
    target = "tests/test_planner.py:llama_1b"
    assert _run_cli("plan", target, "--devices", "12", "--nodes", "5") == 2
    assert "devices=12 is not divisible by nodes=5" in capsys.readouterr().err
    assert _run_cli("plan", target, "--devices", "1", "--device-memory", "12GB") == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "What would help" in err
    for flag, value, reason in (
        ("--interconnect", "ethernet", "'ethernet' is a link for --inter-node"),
        ("--inter-node", "token-ring", "unknown link 'token-ring'"),
        ("--device-memory", "80 gigs", "is not a size"),
    ):
        with pytest.raises(SystemExit) as caught:
            _run_cli("plan", target, "--devices", "8", flag, value)
        assert caught.value.code == 2 and reason in capsys.readouterr().err


def test_plan_and_estimate_memory_count_zero_layouts_alike(capsys):
    """One source of truth: the planner's ZeRO-2/3 rows are estimate-memory's, to the byte."""
    target = "examples/llama/model.py:llama_3_1_8b"
    assert _run_cli("plan", target, "--devices", "8", "--precision", "fp32", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    planned = {
        f"zero{entry['config']['zero_stage']}": entry["memory"]
        for entry in [report, *report["runners_up"]]
        if entry["config"]["dp_shard_size"] == 8
    }
    assert _run_cli("estimate-memory", target, "--devices", "8", "--json") == 0
    estimated = {
        row["strategy"]: row
        for row in json.loads(capsys.readouterr().out)["estimates"]
        if row["precision"] == "fp32"
    }
    assert {"zero2", "zero3"} <= planned.keys()
    for strategy in ("zero2", "zero3"):
        for part in ("parameters", "gradients", "optimizer"):
            assert planned[strategy][part] == estimated[strategy][part], (strategy, part)


def _run_cli(*argv: str) -> int:
    """main() in-process minus its log handler (a subprocess costs ~3 s here), run from the repo root."""
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        args = build_parser().parse_args(list(argv))
        return args.run(args)
    finally:
        os.chdir(cwd)
