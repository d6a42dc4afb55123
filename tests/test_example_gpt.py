"""The GPT example (examples/gpt): its model and data alone, then one real 2-process training run."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from launching import REPO_ROOT, WORKERS, launch_ok
from slowness import budget

EXAMPLE = REPO_ROOT / "examples" / "gpt"


def _load(name: str):
    """Import examples/gpt/NAME.py under a private name (the example is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"gpt_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


model_lib = _load("model")
data_lib = _load("data")


def tiny_config(**overrides):
    settings = dict(block_size=16, vocab_size=50, n_layer=2, n_head=4, n_embd=32)
    return model_lib.GPTConfig(**{**settings, **overrides})


def test_model_shapes_initial_loss_tying_and_generate():
    torch.manual_seed(0)
    model = model_lib.GPT(tiny_config())
    idx = torch.randint(0, 50, (3, 16))
    logits, loss = model(idx, torch.randint(0, 50, (3, 16)))
    assert logits.shape == (3, 16, 50)
    # small init: near-uniform predictions, so the loss starts at about ln(vocab)
    assert abs(loss.item() - math.log(50)) < 0.1, loss.item()
    assert model(idx)[1] is None
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.h, nn.ModuleList) and len(model.transformer.h) == 2
    # each parameter once: the tied matrix is not counted twice
    assert model.num_parameters() == sum(p.numel() for p in set(model.parameters()))
    # residual projections get the smaller, depth-scaled init
    c_proj_std = model.transformer.h[0].attn.c_proj.weight.std().item()
    c_fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert c_proj_std < 0.7 * c_fc_std

    out = model.generate(idx[:1, :3], max_new_tokens=20, top_k=5)
    assert out.shape == (1, 23) and torch.equal(out[:, :3], idx[:1, :3])
    assert out.max() < 50
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_runs_unchanged_on_a_share_of_the_heads():
    """Two halves of the heads (as two tensor-parallel ranks would hold them) sum to the full output.

    This is why attention reshapes with view(B, T, -1, head_dim) and splits q/k/v with chunk: the
    same forward must run on c_attn/c_proj slices that hold n_head/tp heads.
    """
    torch.manual_seed(0)
    config = tiny_config(bias=False)
    attn = model_lib.CausalSelfAttention(config)
    x = torch.randn(2, 10, config.n_embd)
    full = attn(x)
    C, half = config.n_embd, config.n_embd // 2
    w_q, w_k, w_v = attn.c_attn.weight.detach().split(C)
    total = torch.zeros_like(full)
    for rank in range(2):
        rows = slice(rank * half, (rank + 1) * half)  # this rank's heads
        shard = copy.deepcopy(attn)
        shard.c_attn = nn.Linear(C, 3 * half, bias=False)
        shard.c_attn.weight.data = torch.cat([w_q[rows], w_k[rows], w_v[rows]])
        shard.c_proj = nn.Linear(half, C, bias=False)
        shard.c_proj.weight.data = attn.c_proj.weight.detach()[:, rows].clone()
        total += shard(x)
    torch.testing.assert_close(total, full, atol=1e-5, rtol=1e-5)


def test_default_corpus_is_deterministic_and_the_tokenizer_round_trips():
    first, second = data_lib.load_corpus(), data_lib.load_corpus()
    assert first == second
    assert len(first) == data_lib.DEFAULT_CORPUS_CHARS
    assert "def " in first and "import " in first  # it is Python source
    tokenizer = data_lib.CharTokenizer(first)
    assert tokenizer.chars == sorted(set(first))
    sample = first[123_456:125_000]
    assert tokenizer.decode(tokenizer.encode(sample)) == sample
    assert tokenizer.decode(torch.tensor(tokenizer.encode(sample))) == sample
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        tokenizer.encode("\x00")


def test_data_path_reads_files_and_folders_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("third\n")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    assert data_lib.load_corpus(tmp_path) == "first\nsecond\nthird\n"
    assert data_lib.load_corpus(tmp_path / "b.txt") == "second\n"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data_lib.load_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a UTF-8 text file"):
        data_lib.load_corpus(tmp_path / "blob.bin")


def test_windows_are_shifted_pairs_that_tile_the_text_and_the_split_is_90_10():
    tokens = torch.arange(1000)
    train, val = data_lib.train_val_split(tokens)
    assert len(train) == 900 and len(val) == 100 and torch.equal(torch.cat([train, val]), tokens)
    windows = data_lib.CharWindows(train, block_size=16)
    assert len(windows) == (900 - 1) // 16  # non-overlapping, each with its one-token-later target
    xs = [windows[i][0] for i in range(len(windows))]
    assert torch.equal(torch.cat(xs), train[: 16 * len(windows)])
    x, y = windows[len(windows) - 1]
    assert x.shape == y.shape == (16,) and torch.equal(y[:-1], x[1:]) and y[-1] == x[-1] + 1
    assert len(data_lib.CharWindows(train, block_size=16, stride=8)) == (900 - 1 - 16) // 8 + 1
    with pytest.raises(ValueError, match="block_size=16"):
        data_lib.CharWindows(torch.arange(16), block_size=16)


def _saves(out: str) -> list[tuple[int, str, float]]:
    """(step, path, MB) of each "saved <path> (<size> MB) in <seconds> s" line."""
    pattern = r"step +(\d+)/\d+ \| saved (\S+) \((\d+\.\d) MB\) in \d+\.\d\d s$"
    return [(int(step), path, float(mb)) for step, path, mb in re.findall(pattern, out, flags=re.M)]


def _megabytes(directory: Path) -> float:
    assert directory.is_dir(), directory
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) / 1e6


def test_train_py_under_two_processes_logs_from_rank_0_and_runs_the_requested_steps(tmp_path):
    result = launch_ok(
        EXAMPLE / "train.py",
        2,
        *("--max-steps", 6, "--batch-size", 4, "--block-size", 16, "--n-layer", 1, "--n-head", 2),
        *("--n-embd", 32, "--log-interval", 2, "--eval-interval", 3, "--eval-batches", 2),
        *("--sample-chars", 40, "--warmup-steps", 2, "--project-dir", tmp_path, "--resume"),
        # both reach the workers through the environment: Accelerator() and throughput.peak_flops()
        launch_args=("--gradient-accumulation-steps", "2", "--peak-flops", "1e12"),
        timeout=120,
    )
    lines = result.stdout.splitlines()
    # --resume with no checkpoint says so; the one save (--save-every 100: only the last step) is reported
    # with its path, size and time; every such line comes from the main process alone
    assert f"[rank0]: --resume: no checkpoint in {tmp_path}/checkpoints, starting at step 0" in lines
    checkpoint_6 = tmp_path / "checkpoints" / "checkpoint_6"
    [(step, path, mb)] = _saves(result.stdout)
    assert (step, path) == (6, str(checkpoint_6)) and mb == pytest.approx(_megabytes(checkpoint_6), abs=0.05)
    assert sum("| saved " in line or "--resume" in line for line in lines) == 2, result.stdout
    loss_lines = [line for line in lines if "| loss " in line]
    val_lines = [line for line in lines if "| val loss " in line]
    assert len(loss_lines) == 4 and len(val_lines) == 2, result.stdout
    assert all(line.startswith("[rank0]:") for line in loss_lines + val_lines), result.stdout
    assert [int(re.search(r"step +(\d+)/6", line).group(1)) for line in loss_lines] == [1, 2, 4, 6]
    assert [int(re.search(r"step +(\d+)/6", line).group(1)) for line in val_lines] == [3, 6]
    header = next(line for line in lines if "tokens per step" in line)
    vocab = int(re.search(r"vocab (\d+)", result.stdout).group(1))
    losses = [float(re.search(r"loss (\d+\.\d+)", line).group(1)) for line in loss_lines]
    assert abs(losses[0] - math.log(vocab)) < 0.3, losses  # starts near ln(vocab)
    assert losses[-1] < losses[0] - 0.1, losses  # and it trains
    # 4 sequences x 16 tokens x 2 micro-steps x 2 processes
    assert (
        "x 2 data-parallel process(es)" in header
        and "x 2 micro-step(s)" in header
        and "= 256 tokens per step" in header
    )
    assert "trained 6 steps (steps 1-6, " in result.stdout
    assert result.stdout.count("---- sample ----") == 1
    assert not any(line.startswith("[rank1]:") and "loss" in line for line in lines)

    # the same values in PROJECT_DIR/gpt/metrics.jsonl, written by the main process alone (one line per
    # log call, no second copy from rank 1), and MFU against --peak-flops 1e12 per process
    metrics = tmp_path / "gpt" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [list(record) for record in records[:1]] == [["config"]] and records[0]["config"]["max_steps"] == 6
    train = [record for record in records[1:] if "loss" in record]
    val = [record for record in records[1:] if "val_loss" in record]
    assert len(train) + len(val) == len(records) - 1
    assert [record["step"] for record in train] == [1, 2, 4, 6] and [record["step"] for record in val] == [
        3,
        6,
    ]
    assert all(set(record) == {"step", "time", "loss", "lr", "tokens_per_s", "mfu"} for record in train)
    assert [round(record["loss"], 4) for record in train] == losses
    printed_val = [float(re.search(r"val loss (\d+\.\d+)", line).group(1)) for line in val_lines]
    assert [round(record["val_loss"], 4) for record in val] == printed_val
    for record, line in zip(train, loss_lines):
        tokens_per_s = float(re.search(r"\| +([\d,]+) tok/s", line).group(1).replace(",", ""))
        assert round(record["tokens_per_s"]) == tokens_per_s
        # MFU = tokens/s x FLOPs per token / (peak x processes), FLOPs per token = 6N + 12 L d T
        n_params = int(re.search(r"([\d,]+) parameters", result.stdout).group(1).replace(",", ""))
        flops_per_token = 6 * n_params + 12 * 1 * 32 * 16
        assert record["mfu"] == pytest.approx(record["tokens_per_s"] * flops_per_token / 2e12)
        assert line.endswith(f"| MFU {record['mfu']:.1%}"), line
    # the progress line (stderr, not a terminal: plain lines) ends at 6/6, from the main process only
    progress = [line for line in result.stderr.splitlines() if "train: " in line and " it/s" in line]
    assert progress and progress[-1].startswith("[rank0]: train: 6/6 (100%)"), result.stderr
    assert all(line.startswith("[rank0]:") for line in progress), progress
    # the plot command it prints runs as printed, after installing the plot extra the demo's set-up leaves out
    plot_line = next(line for line in lines if "plot them: " in line)
    install, plot = plot_line.split("plot them: ", 1)[1].split(" && ")
    assert install == "pip install 'unison[plot]'", plot_line
    command = plot.split()[1:]
    assert command == [
        "plot",
        str(tmp_path),
        "--metric",
        "loss",
        "--metric",
        "val_loss",
        "-o",
        f"{tmp_path}/loss.png",
    ]
    plotted = subprocess.run(
        [sys.executable, "-m", "unison", *command],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert plotted.returncode == 0, plotted.stderr
    assert f"wrote {tmp_path}/loss.png: loss, val_loss of gpt" in plotted.stdout


def test_train_py_resumes_from_its_checkpoint_where_it_stopped(tmp_path):
    """Checkpoints at steps 4 and 6; drop the last, resume from step 4: steps 5-6 end exactly as before."""
    tiny = ["--max-steps", "6", "--batch-size", "4", "--block-size", "16", "--n-layer", "1", "--n-head", "2"]
    tiny += ["--n-embd", "32", "--log-interval", "1", "--eval-interval", "6", "--eval-batches", "2"]
    tiny += ["--sample-chars", "0", "--save-every", "2", "--project-dir", str(tmp_path)]

    def train(*extra: str) -> str:
        result = subprocess.run(
            [sys.executable, str(EXAMPLE / "train.py"), *tiny, *extra],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=budget(120),
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    first = train("--resume")  # nothing to resume yet: says so and starts at step 0
    assert f"--resume: no checkpoint in {tmp_path}/checkpoints, starting at step 0" in first
    assert "trained 6 steps (steps 1-6, " in first
    # each save is reported with its path, its size on disk and its time; the newest two are kept
    checkpoints = tmp_path / "checkpoints"
    saves = _saves(first)
    assert [(step, path) for step, path, _ in saves] == [
        (n, str(checkpoints / f"checkpoint_{n}")) for n in (2, 4, 6)
    ]
    assert not (checkpoints / "checkpoint_2").exists()
    for step, path, mb in saves[1:]:
        assert mb == pytest.approx(_megabytes(Path(path)), abs=0.05), (step, mb)

    shutil.rmtree(checkpoints / "checkpoint_6")
    resumed = train("--resume")
    assert f"resumed from {checkpoints / 'checkpoint_4'} at step 4, epoch 0" in resumed
    assert [line for line in resumed.splitlines() if "| loss " in line][0].startswith("step     5/6")
    assert "trained 2 steps (steps 5-6, " in resumed  # this run's steps, not the run's total
    [(step, path, mb)] = _saves(resumed)
    assert (step, path) == (6, str(checkpoints / "checkpoint_6")) and mb == pytest.approx(
        _megabytes(checkpoints / "checkpoint_6"), abs=0.05
    )

    finished = train("--resume")  # a finished run: nothing left to train, and it says so
    assert f"resumed from {checkpoints / 'checkpoint_6'} at step 6, epoch 0" in finished
    assert "nothing to train: the run is at step 6 of --max-steps 6" in finished
    assert "| loss " not in finished and "| saved " not in finished and "trained " not in finished

    def tail(out: str) -> list[str]:  # the loss and val loss lines of steps 5 and 6, without timings
        lines = [
            line for line in out.splitlines() if re.match(r"step +[56]/6", line) and "| saved" not in line
        ]
        return [line.split(" | lr")[0] if "| loss " in line else line for line in lines]

    assert tail(resumed) == tail(first) and len(tail(first)) == 3

    # one metrics.jsonl across the three runs: what the first logged after checkpoint_4 was dropped
    # when the second resumed there and logged steps 5-6 again, so each step is in it once
    records = [json.loads(line) for line in (tmp_path / "gpt" / "metrics.jsonl").read_text().splitlines()]
    assert sum("config" in record for record in records) == 3
    assert [record["step"] for record in records if "loss" in record] == [1, 2, 3, 4, 5, 6]
    assert [record["step"] for record in records if "val_loss" in record] == [6]


def test_train_py_help_gives_every_option_a_help_text_and_shows_every_default(monkeypatch, capsys):
    """In-process (a subprocess would spend its time importing torch): train.py's own parse_args()."""
    monkeypatch.setitem(sys.modules, "data", data_lib)  # train.py imports its neighbours by these names
    monkeypatch.setitem(sys.modules, "model", model_lib)
    train_lib = _load("train")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    defaults = vars(train_lib.parse_args())
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        train_lib.parse_args()
    assert stop.value.code == 0
    usage = capsys.readouterr().out
    options = re.split(r"\n  (?=-)", usage.split("\noptions:\n", 1)[1])
    assert len(options) == len(defaults) + 1  # and -h, --help
    for option in options:
        text = " ".join(option.split())  # argparse wraps lines
        # the flag, its metavar (MAX_STEPS, {no,bf16,fp16}) if it takes a value, then a help text
        flag = re.match(r"(-h, )?--([\w-]+)( [A-Z_]+| \{[^}]*\})? \S*[a-z]", text)
        assert flag, text
        name = flag.group(2)
        default = defaults.get(name.replace("-", "_"))
        if default is not None and default is not False:
            assert text.endswith(f"(default: {default})"), text
        else:  # unset means "the launcher's", "the stdlib source", "off": said in the help, not as None
            assert "(default: None)" not in text and "(default: False)" not in text, text


def test_train_py_logs_the_same_losses_under_every_layout(tmp_path):
    """The main job under DDP, ZeRO-3, tensor and pipeline parallel on 2 processes: one global batch of 8
    sequences per step everywhere (4 per process where both read different data), the same losses, and
    the same validation loss over the same 16 validation windows. One launch runs train.py's main() for
    each layout in turn (tests/workers/gpt_layouts_worker.py: the layout set as --parallelism sets it)."""
    common = (
        *("--max-steps", 4, "--block-size", 16, "--n-layer", 2, "--n-head", 2, "--n-embd", 32),
        *("--log-interval", 1, "--eval-interval", 4, "--sample-chars", 0),
        *("--warmup-steps", 2, "--save-every", 0),
    )
    layouts = {  # layout: (sequences per micro-batch, how the run's header describes it)
        "ddp": (4, "dp_replicate=2"),
        "zero3": (4, "dp_shard=2 (ZeRO-3)"),
        "tp_size=2": (8, "tp=2"),
        "pp_size=2,pp_microbatches=2": (8, "pp=2, pp_schedule=1f1b"),
    }
    runs = []
    for layout, (batch, _) in layouts.items():
        sizes = ("--batch-size", batch, "--eval-batches", 16 // batch)
        runs.append([layout, [*common, *sizes, "--project-dir", tmp_path / layout]])
    result = launch_ok(WORKERS / "gpt_layouts_worker.py", 2, json.dumps(runs, default=str), timeout=4 * 180)
    outputs = re.split(r"^\[rank0\]: ==== run (.*)$", result.stdout, flags=re.M)[1:]
    assert outputs[::2] == list(layouts), result.stdout
    losses, val_losses = {}, {}
    for layout, out in zip(outputs[::2], outputs[1::2]):
        header = re.search(r"\| layout (.*) \| mixed precision", out)
        assert header and header.group(1) == layouts[layout][1], out  # the run ran under that layout
        losses[layout] = [float(v) for v in re.findall(r"\| loss (\d+\.\d+)", out)]
        assert len(losses[layout]) == 4, out
        val_losses[layout] = [float(v) for v in re.findall(r"\| val loss (\d+\.\d+)", out)]
        assert len(val_losses[layout]) == 1, out
    for layout, logged in losses.items():
        assert logged == pytest.approx(losses["ddp"], abs=2e-4), (layout, logged, losses["ddp"])
        assert val_losses[layout] == pytest.approx(val_losses["ddp"], abs=2e-4), (layout, val_losses)
