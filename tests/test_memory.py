"""`planning.memory` and `unison estimate-memory`: the formulas against hand-computed bytes, meta builds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn
from launching import REPO_ROOT
from slowness import budget

from unison.commands.main import build_parser
from unison.planning import memory, memory_table

FP32, BF16_MIXED, BF16 = memory.PRECISIONS


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(hidden, hidden, bias=False))


class LlamaBlock(nn.Module):
    """Llama-2-7B's block shapes (no forward needed: only shapes are read)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.self_attn = LlamaAttention(hidden)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.input_layernorm = nn.RMSNorm(hidden)
        self.post_attention_layernorm = nn.RMSNorm(hidden)


class LlamaLike(nn.Module):
    def __init__(self, layers: int = 32, hidden: int = 4096, intermediate: int = 11008, vocab: int = 32000):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaBlock(hidden, intermediate) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def test_model_state_matches_hand_computed_bytes_for_1000_parameters():
    by = {
        (s, p.name): memory.model_state_bytes(s, p, 1000, 1000, 4)
        for s, _, _ in memory.STRATEGIES
        for p in memory.PRECISIONS
    }
    assert by["single", "fp32"] == by["ddp", "fp32"] == (4000, 4000, 8000)  # 16,000 bytes
    assert by["zero1", "fp32"] == (4000, 4000, 2000)  # 8,000 + 2,000
    assert by["zero2", "fp32"] == (4000, 1000, 2000)  # 4,000 + 3,000
    assert by["zero3", "fp32"] == by["tp", "fp32"] == by["pp", "fp32"] == (1000, 1000, 2000)  # 4,000
    assert by["zero3_offload", "fp32"] == (0, 0, 0)  # all in host memory:
    assert memory.host_bytes("zero3_offload", FP32, 1000, 1000, 4) == 4000 == sum(by["zero3", "fp32"])
    assert memory.host_bytes("zero3", FP32, 1000, 1000, 4) == 0
    # mixed_precision="bf16": fp32 master state, as fp32 (not the ZeRO paper's 2+2+12), except that ZeRO-2
    # holds its gathered parameters in bf16 (FSDP2's MixedPrecisionPolicy) beside the fp32 shards
    assert all(by[s, "bf16-mixed"] == by[s, "fp32"] for s, _, _ in memory.STRATEGIES if s != "zero2")
    assert by["zero2", "bf16-mixed"] == (2000 + 1000, 1000, 2000)
    assert memory.model_state_bytes("zero2_offload", BF16_MIXED, 1000, 1000, 4) == (2000, 0, 0)
    assert memory.zero_gathered_unit_bytes("zero3", BF16_MIXED, 100) == (
        200,
        400,
    )  # bf16 gathered, fp32 grads
    assert memory.zero_gathered_unit_bytes("zero3", FP32, 100) == (400, 400)
    # autocast's bf16 copies of fp32 weights: none where FSDP2 already gathers bf16 (ZeRO-2/3)
    assert (
        memory.autocast_copy_bytes(BF16_MIXED, 1000) == 2000 and memory.autocast_copy_bytes(FP32, 1000) == 0
    )
    assert (
        memory.autocast_copy_bytes(BF16_MIXED, 1000, "zero3")
        == 0
        == memory.autocast_copy_bytes(BF16_MIXED, 1000, "zero2")
    )
    assert by["ddp", "bf16"] == (2000, 2000, 4000)
    # frozen parameters carry no gradients and no Adam state; shards round up like padded shards
    assert memory.model_state_bytes("ddp", FP32, 1000, 600, 4) == (4000, 2400, 4800)
    assert memory.model_state_bytes("zero3", FP32, 1001, 1001, 4) == (1004, 1004, 2008)
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        memory.model_state_bytes("zero4", FP32, 1000, 1000, 4)


def test_bf16_autocast_keeps_a_bf16_copy_of_every_weight_for_backward():
    """What bf16-mixed's autocast_copy_bytes prices, measured: the bytes autograd saves that are bf16
    casts of the model's weights (a Llama from examples/llama, every Linear after the embedding)."""
    from tiny_gpt import llama_model

    config = llama_model.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48
    )
    model = llama_model.LlamaForCausalLM(config)
    weights = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    weights |= {shape[::-1] for shape in weights}  # matmuls may save the transposed view
    linear_parameters = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    saved: dict[int, torch.Tensor] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randint(0, 64, (2, 8)))
    cast_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    assert cast_bytes == memory.autocast_copy_bytes(BF16_MIXED, linear_parameters) == 2 * linear_parameters


def test_activation_formula_is_korthikanti_34sbh_in_16_bit():
    shape = memory.ModelShape(parameters=0, trainable_parameters=0, blocks="h", layers=2, hidden=8)
    s, b, h, L = 16, 3, 8, 2
    assert memory.activation_bytes(shape, b, s, element_bytes=2) == 34 * s * b * h * L
    assert memory.activation_bytes(shape, b, s, element_bytes=4) == 66 * s * b * h * L
    assert memory.activation_bytes(shape, b, s, 2, tensor_parallel=4) == (10 + 24 / 4) * s * b * h * L
    a = 2  # stored attention scores add 5·a·s²·b per block in 16-bit
    assert (
        memory.activation_bytes(shape, b, s, 2, attention_heads=a) == (34 * s * b * h + 5 * a * s * s * b) * L
    )
    with_vocab = memory.ModelShape(0, 0, "h", layers=2, hidden=8, vocab=100)
    assert memory.activation_bytes(with_vocab, b, s, 2) == 34 * s * b * h * L + 4 * s * b * 100


def test_estimate_memory_counts_the_loss_gradients_that_start_backward():
    """estimate-memory's peak adds G = 8·s·b·V (the fp32 gradients of the log-probabilities and the
    logits, together at backward's start: 30-45% of the peak missed on an H100 without them); with
    checkpointing, the larger of G and one rebuilt block. The planner's figure stays without G."""
    from unison.planning.activation_memory import activation_parts, estimate_activation_bytes

    shape = memory.ModelShape(0, 0, "h", layers=2, hidden=8, vocab=100)
    s, b = 16, 3
    table = memory_table.estimate(shape, 1, b, s)
    single = next(r for r in table.rows if r.precision == "bf16-mixed" and r.strategy == "single")
    assert single.activations == 34 * s * b * 8 * 2 + 4 * s * b * 100 + 8 * s * b * 100
    assert estimate_activation_bytes(shape, b, s, 2) == 34 * s * b * 8 * 2 + 4 * s * b * 100  # the planner's
    kept, rebuilt = activation_parts(shape, b, s, 2, "full")
    full = memory_table.estimate(shape, 1, b, s, activation_checkpointing="full")
    single = next(r for r in full.rows if r.precision == "bf16-mixed" and r.strategy == "single")
    assert single.activations == kept + max(rebuilt, 8 * s * b * 100)


def test_real_model_counts_tied_weights_once_and_finds_its_blocks():
    sys.path.insert(0, str(REPO_ROOT / "examples" / "gpt"))
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.pop(0)
    model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=4, vocab_size=50, block_size=16))
    shape = memory.inspect_model(model)
    assert shape.parameters == sum(p.numel() for p in model.parameters()) == model.num_parameters()
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert shape.parameters == untied - 50 * 32  # lm_head and wte share one matrix
    assert (shape.blocks, shape.layers, shape.hidden, shape.vocab) == ("transformer.h", 3, 32, 50)
    model.transformer.wpe.weight.requires_grad_(False)
    assert memory.inspect_model(model).trainable_parameters == shape.parameters - 16 * 32


def test_non_transformer_gets_no_activation_estimate():
    mlp = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    shape = memory.inspect_model(mlp)
    assert shape.parameters == 10 * 20 + 20 + 20 * 5 + 5 and shape.layers is None
    result = memory_table.estimate(shape, devices=2, micro_batch_size=4, seq_len=8)
    assert all(row.activations is None for row in result.rows)
    assert any("not recognised as a transformer" in note for note in result.notes)
    assert len(result.rows) == len(memory.PRECISIONS) * len(memory.STRATEGIES)


@pytest.mark.serial
def test_7b_llama_like_builds_on_meta_instantly(tmp_path):
    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaLike()
    shape = memory.inspect_model(model)
    elapsed = time.perf_counter() - start
    assert all(p.is_meta for p in model.parameters())
    assert elapsed < 5, f"meta build of a 7B model took {elapsed:.1f} s"
    hidden, inter, vocab = 4096, 11008, 32000
    expected = 32 * (4 * hidden**2 + 3 * hidden * inter + 2 * hidden) + 2 * vocab * hidden + hidden
    assert shape.parameters == expected and 6.5e9 < expected < 7e9
    assert (shape.layers, shape.hidden, shape.vocab) == (32, 4096, 32000)
    row = next(
        r
        for r in memory_table.estimate(shape, 8).rows
        if (r.precision, r.strategy) == ("bf16-mixed", "zero3")
    )
    unit = 2 * vocab * hidden + hidden  # embedding, output layer and final norm: larger than a block
    assert shape.largest_unit == unit
    # FSDP2 gathers that unit's params whole in bf16 and holds its fp32 grads whole; no autocast casts
    assert row.total == 16 * expected // 8 + (2 + 4) * unit
    assert row.parameters == 4 * expected // 8 + 2 * unit


FACTORIES = """\
import torch.nn as nn

def small():
    return nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))

def needs_config(config):
    return nn.Linear(config, config)

def not_a_module():
    return 42

def broken():
    raise RuntimeError("no weights on disk")
"""


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unison", "estimate-memory", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=budget(120),
    )


def test_cli_json_and_clear_errors_for_bad_targets(tmp_path, capsys):
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    result = run_cli(f"{path}:small", "--devices", "4", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"]["parameters"] == 220 and report["devices"] == 4
    rows = {(r["precision"], r["strategy"]): r for r in report["estimates"]}
    assert rows["fp32", "ddp"]["total"] == 16 * 220
    assert (rows["fp32", "zero1"]["parameters"], rows["fp32", "zero1"]["optimizer"]) == (880, 8 * 55)
    # ZeRO-3: the shards plus one Linear (the largest FSDP2 unit) gathered, its parameters and gradients
    assert rows["fp32", "zero3"]["total"] == 16 * 55 + (4 + 4) * 110
    assert rows["fp32", "zero3"]["activations"] is None

    bad = {
        "factories.py": "not of the form module:factory",
        "no_such_module_xyz:build": "module 'no_such_module_xyz' not found",
        f"{tmp_path}/missing.py:build": "does not exist",
        f"{path}:absent": "has no attribute 'absent'",
        f"{path}:needs_config": "needs arguments (config)",
        f"{path}:not_a_module": "returned a int, not an nn.Module",
        f"{path}:broken": "no weights on disk",
    }
    result = run_cli(f"{path}:needs_config")  # the real exit code of the real command
    assert result.returncode == 2 and "needs arguments (config)" in result.stderr, result.stderr
    for target, reason in bad.items():  # the rest in-process: a subprocess costs ~3 s here
        args = build_parser().parse_args(["estimate-memory", target])  # main() minus its log handler
        assert args.run(args) == 2, target
        stderr = capsys.readouterr().err
        assert target in stderr and reason in stderr, (target, stderr)

    for flags, reason in [  # options that only price activations need the activation shape
        (["--micro-batch-size", "2"], "need both --micro-batch-size and --seq-len"),
        (["--attention-heads", "12"], "--attention-heads 12 prices the attention scores"),
    ]:
        args = build_parser().parse_args(["estimate-memory", f"{path}:small", *flags])
        assert args.run(args) == 2, flags
        assert reason in capsys.readouterr().err, flags


def test_cli_table_on_the_gpt_example_with_activations(tmp_path):
    wrapper = tmp_path / "gpt_wrapper.py"
    wrapper.write_text(
        textwrap.dedent(f"""\
            import sys
            sys.path.insert(0, {str(REPO_ROOT / "examples" / "gpt")!r})
            from model import GPT, GPTConfig

            def build():
                return GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024))
            """)
    )
    result = run_cli(f"{wrapper}:build", "--devices", "8", "--micro-batch-size", "4", "--seq-len", "1024")
    assert result.returncode == 0, result.stderr
    assert "124,475,904 parameters" in result.stdout  # GPT-2 small with nanoGPT's padded vocabulary
    assert "ZeRO-3" in result.stdout and "tensor parallel (est.)" in result.stdout
    assert "Korthikanti" in result.stdout and "12 blocks (transformer.h), hidden 768" in result.stdout
    assert "GiB" in result.stdout
