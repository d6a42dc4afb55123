"""The fine-tuning example (examples/finetune): a tiny GPT from the GPT example, fine-tuned on 2 processes
with a summed masked-token loss and num_items, against references computed here."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launching import REPO_ROOT, launch_ok
from slowness import budget
from torch.utils.data import DataLoader

from unison.checkpoint import load_object
from unison.checkpoint.dcp_reading import read_full_model_state

EXAMPLES = REPO_ROOT / "examples"
TINY_GPT = ("--block-size", "16", "--n-layer", "1", "--n-head", "2", "--n-embd", "16")


def _load(path: Path, name: str):
    """Import an example's file under a private name (the examples are scripts, not packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


gpt_model = _load(EXAMPLES / "gpt" / "model.py", "finetune_test_gpt_model")
gpt_data = _load(EXAMPLES / "gpt" / "data.py", "finetune_test_gpt_data")
spans = _load(EXAMPLES / "finetune" / "spans.py", "finetune_test_spans")


def _run(*args: str, timeout: float = 120) -> str:
    """One process, no launcher: `python SCRIPT ARGS` from the repository root; its stdout."""
    result = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=budget(timeout)
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def gpt_project(tmp_path_factory) -> Path:
    """A GPT example project with one checkpoint: a tiny model trained for 2 steps on one process."""
    project = tmp_path_factory.mktemp("gpt")
    _run(
        str(EXAMPLES / "gpt" / "train.py"),
        *TINY_GPT,
        *("--max-steps", "2", "--batch-size", "4", "--eval-batches", "1", "--sample-chars", "0"),
        *("--save-every", "2", "--project-dir", str(project)),
    )
    return project


def _finetune_args(gpt_project: Path, out: Path, batch: int, accum: int, normalize: str) -> list[str]:
    return [
        *("--init-from", str(gpt_project), "--n-head", "2", "--max-steps", "3", "--log-interval", "1"),
        *("--batch-size", str(batch), "--grad-accum", str(accum), "--normalize", normalize),
        *("--project-dir", str(out)),
    ]


def _weights(project: Path) -> dict[str, torch.Tensor]:
    return load_object(project / "checkpoints" / "checkpoint_3" / "model_0.pt")


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key] - b[key]).abs().max().item() for key in a)


def _first_window_reference(gpt_project: Path, micro_batches: int, batch: int) -> tuple[float, float]:
    """Step 1's loss per counted token and mean of per-micro-batch means, computed here in one process:
    the first `micro_batches` batches of the script's shuffled loader, through the checkpoint's weights."""
    weights = load_object(gpt_project / "checkpoints" / "checkpoint_2" / "model_0.pt")
    vocab, n_embd = weights["transformer.wte.weight"].shape
    config = gpt_model.GPTConfig(block_size=16, vocab_size=vocab, n_layer=1, n_head=2, n_embd=n_embd)
    model = gpt_model.GPT(config)
    model.load_state_dict(weights)
    tokenizer = gpt_data.CharTokenizer(gpt_data.load_corpus())
    text, counted = spans.load_finetune_text(None, gpt_data.DEFAULT_CORPUS_CHARS)
    tokens = torch.tensor(tokenizer.encode(text))
    n_train = int(len(tokens) * 0.9)
    dataset = spans.MaskedWindows(tokens[:n_train], counted[:n_train], 16)
    loader = DataLoader(
        dataset, batch_size=batch, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1337)
    )
    sums, counts = [], []
    with torch.no_grad():
        for (x, labels), _ in zip(loader, range(micro_batches)):
            logits, _ = model(x)
            losses = F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
            )
            sums.append(losses.sum().item())
            counts.append((labels != -100).sum().item())
    assert len(set(counts)) > 1, counts  # the counts differ between micro-batches: the point of the example
    return sum(sums) / sum(counts), sum(s / c for s, c in zip(sums, counts)) / micro_batches


def _logged(out: str) -> list[tuple[float, float]]:
    """(loss per token, mean of micro-batch means) of each training log line."""
    pattern = r"loss per token (\d+\.\d+) \| mean of micro-batch means (\d+\.\d+)"
    return [tuple(map(float, match)) for match in re.findall(pattern, out)]


def _val_losses(out: str) -> list[float]:
    return [float(value) for value in re.findall(r"val loss (\d+\.\d+)", out)]


def test_finetune_normalizes_by_the_global_count_on_any_split(gpt_project, tmp_path):
    """2 processes x 2 micro-steps: step 1's two losses are the references computed here, and the weights
    after 3 steps are those of 1 process x 4 micro-steps; trained on per-micro-batch means, they are not."""
    script = EXAMPLES / "finetune" / "train.py"
    two = launch_ok(script, 2, *_finetune_args(gpt_project, tmp_path / "two", 2, 2, "global"), timeout=180)
    assert "[rank0]: 2 process(es) | from " + str(gpt_project / "checkpoints" / "checkpoint_2") in two.stdout
    logged = _logged(two.stdout)
    assert len(logged) == 3, two.stdout
    per_token, mean_of_means = _first_window_reference(gpt_project, micro_batches=4, batch=2)
    assert logged[0] == pytest.approx((per_token, mean_of_means), abs=1.5e-4)
    assert abs(per_token - mean_of_means) > 3e-4, (per_token, mean_of_means)  # visibly apart
    assert "[rank0]: saved " + str(tmp_path / "two" / "checkpoints" / "checkpoint_3") in two.stdout

    one = _run(str(script), *_finetune_args(gpt_project, tmp_path / "one", 2, 4, "global"))
    assert _max_difference(_weights(tmp_path / "two"), _weights(tmp_path / "one")) < 1e-5
    # the validation loss covers every validation window once, however many processes share them
    assert _val_losses(two.stdout) == pytest.approx(_val_losses(one), abs=2e-4)
    assert len(_val_losses(one)) == 2 and _val_losses(one)[1] < _val_losses(one)[0]  # and it trains

    # the usual recipe, per-micro-batch means, on the same split: the weights end elsewhere (one micro-batch
    # of all 8 windows per step would give the global mean again, so the split decides where)
    _run(str(script), *_finetune_args(gpt_project, tmp_path / "per-batch", 2, 4, "per-batch"))
    assert _max_difference(_weights(tmp_path / "per-batch"), _weights(tmp_path / "one")) > 1e-4


def test_finetune_with_lora_under_tensor_parallelism_trains_as_one_process(gpt_project, tmp_path):
    """--lora 2 under tp_size=2 (the GPT's fused q|k|v, its other projections and their adapters split over
    2 processes that read the same batches) against one process with the same micro-steps: the same
    logged losses, adapters within AdamW's rounding, the GPT itself unchanged."""
    pytest.importorskip("peft")
    script = EXAMPLES / "finetune" / "train.py"
    args = [*_finetune_args(gpt_project, tmp_path / "tp", 2, 2, "global"), "--lora", "2"]
    tp = launch_ok(script, 2, *args, launch_args=["--parallelism", "tp_size=2"], timeout=180)
    assert "LoRA r=2: " in tp.stdout and "layout tp=2" in tp.stdout, tp.stdout
    one = _run(str(script), *_finetune_args(gpt_project, tmp_path / "one", 2, 2, "global"), "--lora", "2")
    assert _logged(tp.stdout) == pytest.approx(_logged(one), abs=1e-4)
    trained = read_full_model_state(tmp_path / "tp" / "checkpoints" / "checkpoint_3" / "model_0")
    expected = _weights(tmp_path / "one")
    adapters = {key for key in expected if ".lora_" in key}
    assert len(adapters) == 4 * 2  # A and B beside c_attn, attn.c_proj, c_fc and mlp.c_proj of its 1 block
    assert max((trained[k] - expected[k]).abs().max().item() for k in adapters) < 1e-5
    assert all(torch.equal(trained[k], expected[k]) for k in expected if k not in adapters)


def test_finetune_without_a_checkpoint_says_how_to_make_one(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune" / "train.py"), "--init-from", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert result.returncode != 0
    assert f"--init-from {tmp_path}: no GPT checkpoint there" in result.stderr
    assert "bash scripts/demo.sh --max-steps 100" in result.stderr
