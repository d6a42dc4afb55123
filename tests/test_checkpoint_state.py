"""save_state / load_state / save_model in one process: what goes in, what comes back, and the errors."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launching import WORKERS, launch_ok
from safetensors.torch import load_model
from slowness import budget
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, CheckpointError, ProjectConfiguration
from unison.checkpoint import MANIFEST_NAME, sharded, verify_checkpoint, write_checkpoint
from unison.checkpoint.idle_priority import IdlePriority, lowering_is_reversible

pytestmark = pytest.mark.usefixtures("fresh_state")


class Counter:
    """A user object with state, registered for checkpointing."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def build(project_dir, **accelerator_kwargs):
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(project_dir), total_limit=2),
        **accelerator_kwargs,
    )
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=2, shuffle=True)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, counter, accelerator.prepare(model, optimizer, loader, scheduler)


def train_steps(accelerator, prepared, steps: int):
    """Train `steps` optimizer steps from the start of an epoch; return the epoch's iterator."""
    model, optimizer, loader, scheduler = prepared
    iterator = iter(loader)
    for _ in range(steps * accelerator.gradient_accumulation_steps):
        x, y = next(iterator)
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return iterator


def test_round_trip_restores_everything_and_the_loader_continues_mid_epoch(tmp_path):
    accelerator, counter, prepared = build(tmp_path, gradient_accumulation_steps=2)
    iterator = train_steps(accelerator, prepared, 2)
    counter.value = 41
    directory = accelerator.save_state()
    assert directory == tmp_path / "checkpoints" / "checkpoint_2"
    expected_params = [p.detach().clone() for p in prepared[0].parameters()]
    expected_rest = [x for x, _ in iterator]  # the remaining batches of the interrupted epoch

    accelerator2, counter2, prepared2 = build(tmp_path, gradient_accumulation_steps=2)
    assert accelerator2.load_state() == directory
    assert counter2.value == 41
    assert accelerator2.optimizer_steps == 2
    assert prepared2[3].get_last_lr() == prepared[3].get_last_lr()
    assert all(torch.equal(a, b) for a, b in zip(expected_params, prepared2[0].parameters()))
    assert prepared2[1].state_dict()["state"][0]["step"] == 2
    rest = [x for x, _ in prepared2[2]]
    assert len(rest) == len(expected_rest) == 8 - 4
    assert all(torch.equal(a, b) for a, b in zip(rest, expected_rest))


def test_automatic_naming_keeps_total_limit_newest(tmp_path):
    accelerator, _, prepared = build(tmp_path)
    for _ in range(3):
        train_steps(accelerator, prepared, 1)
        accelerator.save_state()
    assert [p.name for p in accelerator.checkpoints()] == ["checkpoint_2", "checkpoint_3"]


class Ballast:
    """Registered for checkpointing: 64 MB that make a background write last long enough to overlap."""

    def __init__(self) -> None:
        self.tensor = torch.zeros(16 * 2**20)

    def state_dict(self) -> dict:
        return {"ballast": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["ballast"]


def test_an_asynchronous_save_holds_the_state_of_its_call_and_one_save_at_a_time(tmp_path, caplog):
    """ProjectConfiguration(async_save=True): save_state returns before the files exist; training on
    changes nothing in them; the next save waits for the one in flight and says so in one line; older
    checkpoints are pruned only once the newer one is complete; load_state resumes the saved state."""
    accelerator, counter, prepared = build(tmp_path)
    accelerator.project_configuration.async_save = True
    ballast = Ballast()
    accelerator.register_for_checkpointing(ballast)
    train_steps(accelerator, prepared, 1)
    counter.value = 7
    expected_params = [p.detach().clone() for p in prepared[0].parameters()]
    first = accelerator.save_state()
    assert accelerator.checkpoint_in_flight == first and not first.exists()  # written in the background
    with torch.no_grad():  # the live state changes at once: the checkpoint keeps the call's
        for param in prepared[0].parameters():
            param.add_(100.0)
    counter.value, ballast.tensor[0] = 8, 1.0
    with caplog.at_level("INFO", logger="unison"):
        second = accelerator.save_state(tmp_path / "elsewhere")  # explicit path, async from the config
    waited = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(waited) == 1 and f"previous asynchronous save ({first})" in waited[0], waited
    assert first.is_dir() and verify_checkpoint(first)  # complete before the next save began
    assert accelerator.wait_for_checkpoint() == second and accelerator.checkpoint_in_flight is None
    accelerator2, counter2, prepared2 = build(tmp_path)
    accelerator2.register_for_checkpointing(restored := Ballast())
    accelerator2.load_state(first)
    assert counter2.value == 7 and restored.tensor[0] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(expected_params, prepared2[0].parameters()))
    for _ in range(2):  # total_limit=2: the third automatic checkpoint removes the first once complete
        train_steps(accelerator, prepared, 1)
        accelerator.save_state()
    assert [path.name for path in accelerator.checkpoints()] == ["checkpoint_1", "checkpoint_2"]
    accelerator.end_training()  # waits for the one in flight
    assert [path.name for path in accelerator.checkpoints()] == ["checkpoint_2", "checkpoint_3"]


EXITS_AFTER_AN_ASYNC_SAVE = """
import sys, torch
from unison import Accelerator
accelerator = Accelerator(cpu=True)
model, optimizer = accelerator.prepare(torch.nn.Linear(2048, 2048), torch.optim.SGD([torch.zeros(1)], lr=0.1))
accelerator.save_state(sys.argv[1], async_save=True)
print("in flight:", accelerator.checkpoint_in_flight is not None, flush=True)
"""  # and the script ends: no end_training, no wait


def test_a_script_that_ends_right_after_an_asynchronous_save_leaves_it_complete(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", EXITS_AFTER_AN_ASYNC_SAVE, str(tmp_path / "checkpoint")],
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert result.returncode == 0 and "in flight: True" in result.stdout, result.stderr
    assert verify_checkpoint(tmp_path / "checkpoint")["files"]  # the exit waited for the write
    assert not list(tmp_path.glob(".*.tmp"))


needs_reversible_idle = pytest.mark.skipif(
    not lowering_is_reversible(), reason="this process cannot take a thread to SCHED_IDLE and back"
)


def policy_of_this_thread() -> int:
    return os.sched_getscheduler(threading.get_native_id())


@needs_reversible_idle
def test_the_background_writer_runs_on_idle_cpu_until_somebody_waits_for_it():
    """The writer and the threads it starts (checksums, DCP) run under SCHED_IDLE, so training keeps its
    cores; a wait returns them all to normal priority, and a writer that starts after the wait began
    does not lower itself."""
    priority, policies = IdlePriority(), {}
    lowered, restored, done = threading.Event(), threading.Event(), threading.Event()

    def child() -> None:
        policies["child started"] = policy_of_this_thread()
        restored.wait()
        policies["child after the wait"] = policy_of_this_thread()

    def writer() -> None:
        priority.lower_this_thread()
        policies["writer"] = policy_of_this_thread()
        started = threading.Thread(target=child)
        started.start()
        lowered.set()
        restored.wait()
        policies["writer after the wait"] = policy_of_this_thread()
        started.join()
        done.set()

    threading.Thread(target=writer).start()
    lowered.wait()
    priority.restore()  # from the "training" thread, as AsyncCheckpointWriter.wait does
    restored.set()
    done.wait()
    assert policies == {
        "writer": os.SCHED_IDLE,
        "child started": os.SCHED_IDLE,
        "writer after the wait": os.SCHED_OTHER,
        "child after the wait": os.SCHED_OTHER,
    }
    assert policy_of_this_thread() == os.SCHED_OTHER

    late = IdlePriority()
    late.restore()  # waited for before the writer ran: it keeps normal priority
    thread = threading.Thread(
        target=lambda: (late.lower_this_thread(), policies.update(late=policy_of_this_thread()))
    )
    thread.start()
    thread.join()
    assert policies["late"] == os.SCHED_OTHER


BUSY_LOOP = "import time\nend = time.time() + 120\nwhile time.time() < end: pass"
SAVES_BESIDE_BUSY_CORES = """
import sys, time, torch
from unison import Accelerator
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)]))  # 100 MB
accelerator.save_state(sys.argv[1], async_save=True)
started = time.perf_counter()
accelerator.wait_for_checkpoint()
print(f"waited {time.perf_counter() - started:.1f}", flush=True)
"""


@pytest.mark.serial  # asserts seconds, and keeps every core busy: alone, not beside the parallel part
@needs_reversible_idle
def test_a_wait_for_a_background_write_does_not_starve_beside_busy_cores(tmp_path):
    """A thread under SCHED_IDLE gets almost no CPU while other work keeps every core busy (a 336 MB write
    took 226 s beside two busy loops, against 1.7 s synchronously): the wait must raise the writer's
    priority. Starved, this 100 MB write waited 51 s here; with the priority raised, a few seconds."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(os.cpu_count() or 1)]
    try:
        result = subprocess.run(
            [sys.executable, "-c", SAVES_BESIDE_BUSY_CORES, str(tmp_path / "checkpoint")],
            capture_output=True,
            text=True,
            timeout=budget(180),
        )
    finally:
        for loop in loops:
            loop.kill()
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) < 30, result.stdout
    assert verify_checkpoint(tmp_path / "checkpoint")["files"]


@pytest.mark.skipif(
    not (shutil.which("setpriv") and shutil.which("prlimit")), reason="util-linux drops the capability"
)
def test_a_process_without_cap_sys_nice_keeps_its_writer_at_normal_priority():
    """Without CAP_SYS_NICE (a plain user, Docker's default root) SCHED_IDLE is a one-way door: the
    writer is not lowered at all, so nothing can starve it."""
    probe = "from unison.checkpoint.idle_priority import lowering_is_reversible as r; print(r())"
    drop = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"]  # a root without it, too
    result = subprocess.run(
        ["prlimit", "--nice=0", *drop, sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stdout + result.stderr


def test_load_without_a_checkpoint(tmp_path):
    accelerator, _, _ = build(tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        accelerator.load_state()
    assert accelerator.load_state(missing_ok=True) is None
    no_project = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="no project directory"):
        no_project.save_state()


def test_checkpoint_of_another_run_layout_is_refused_naming_the_files(tmp_path):
    accelerator, _, _ = build(tmp_path)
    directory = accelerator.save_state(tmp_path / "small")
    accelerator2, _, _ = build(tmp_path / "other")
    accelerator2.prepare(nn.Linear(2, 2))  # one more model than the saved run had
    with pytest.raises(CheckpointError, match="model_1.pt"):
        accelerator2.load_state(directory)


def test_edited_checkpoint_is_refused_naming_the_file(tmp_path):
    accelerator, _, _ = build(tmp_path)
    directory = accelerator.save_state(tmp_path / "ckpt")
    with open(directory / "optimizer_0.pt", "r+b") as file:
        file.seek(40)
        byte = file.read(1)
        file.seek(40)
        file.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="optimizer_0.pt"):
        accelerator.load_state(directory)


class RunsCode:
    """Unpickling it calls open(marker, "w"), as a crafted checkpoint would call os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def crafted_copy(saved: Path, target: Path, name: str, write) -> Path:
    """`saved` with the file (or DCP part) `name` written by `write(path)` instead, and a manifest that
    matches it (written by write_checkpoint as for a real save): the checksums pass, only the pickle is
    hostile."""
    with write_checkpoint(target) as staging:
        for path in saved.iterdir():
            if path.name not in (MANIFEST_NAME, name, f"{name}.pt"):
                shutil.copy(path, staging / path.name)
        write(staging / name)
    return target


def test_a_checkpoint_crafted_to_run_code_is_refused_before_anything_runs_or_is_applied(tmp_path):
    """Every file load_state reads (model, optimizer, scheduler, loader position, registered objects,
    counters, RNG states), and DCP parts (their metadata, their non-tensor values), holding a pickle
    that would run code: refused with a CheckpointError naming the file, the code never runs, and the
    live state is untouched."""
    accelerator, counter, prepared = build(tmp_path)
    train_steps(accelerator, prepared, 1)
    saved = accelerator.save_state(tmp_path / "saved")
    model, optimizer = prepared[0], prepared[1]
    marker = tmp_path / "code_ran"
    payload = {"weight": RunsCode(marker), "state": {}, "param_groups": []}
    torch.save(payload, tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)  # the crafted pickle does run code, unguarded
    assert marker.exists()
    marker.unlink()

    def dcp_model(path: Path) -> None:  # a DCP part whose .metadata would run code
        sharded.save_model_state(model, path)
        (path / sharded.DCP_METADATA).write_bytes(pickle.dumps(RunsCode(marker)))

    def dcp_optimizer(path: Path) -> None:  # a DCP part with a hostile non-tensor value (a learning rate)
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        state = get_optimizer_state_dict(model, optimizer.optimizer, options=flat)
        dcp.save({**state, "param_groups.weight.lr": RunsCode(marker)}, storage_writer=FileSystemWriter(path))

    cases = {
        name: lambda path: torch.save(payload, path) for name in sorted(verify_checkpoint(saved)["files"])
    }
    cases.update({"model_0": dcp_model, "optimizer_0": dcp_optimizer})
    with torch.no_grad():
        model.weight.fill_(7.0)
    counter.value, counters = -1, (accelerator.optimizer_steps, accelerator.step)
    for index, (name, write) in enumerate(cases.items()):
        crafted = crafted_copy(saved, tmp_path / f"crafted_{index}", name, write)
        with pytest.raises(CheckpointError, match="io.open") as refused:
            accelerator.load_state(crafted)
        assert f"crafted_{index}/{name}" in str(refused.value), str(refused.value)
        assert not marker.exists(), name
        assert (model.weight == 7.0).all() and counter.value == -1, name
        assert (accelerator.optimizer_steps, accelerator.step) == counters, name
    assert len(cases) == 9


def test_register_for_checkpointing_needs_state_dict_methods(tmp_path):
    accelerator, _, _ = build(tmp_path)
    with pytest.raises(TypeError, match="str.*state_dict"):
        accelerator.register_for_checkpointing("not stateful")


def test_fp16_scaler_state_is_saved(tmp_path):
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model, optimizer = accelerator.prepare(
        nn.Linear(3, 1), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    )
    accelerator.backward(model(torch.ones(1, 3)).sum())  # the scaler creates its scale on first use
    accelerator.scaler.update(new_scale=128.0)
    directory = accelerator.save_state(tmp_path / "ckpt")
    accelerator.scaler.update(new_scale=4.0)
    accelerator.load_state(directory)
    assert accelerator.scaler.get_scale() == 128.0


def test_save_model_writes_safetensors_loadable_without_unison(tmp_path):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(TiedModel())
    path = accelerator.save_model(model, tmp_path / "export")
    assert path == tmp_path / "export" / "model.safetensors"
    fresh = TiedModel()
    load_model(fresh, str(path))
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, accelerator.unwrap_model(model).embed.weight)


def test_save_model_without_safetensors_names_the_extra_and_writes_nothing(tmp_path, monkeypatch):
    """safetensors is an optional extra: without it save_model says how to get it (or to opt out)."""
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(TiedModel())
    monkeypatch.setitem(sys.modules, "safetensors", None)  # what `import safetensors` meets when absent
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install 'unison\[safetensors\]'.*safe_serialization=False"):
        accelerator.save_model(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    path = accelerator.save_model(model, tmp_path / "export", safe_serialization=False)
    assert path == tmp_path / "export" / "pytorch_model.bin" and path.is_file()


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_save_model_above_max_shard_size_writes_hugging_face_shards_that_from_pretrained_loads(
    tmp_path, safe_serialization
):
    """A transformers GPT-2 (tied lm_head) saved in shards with an index, as save_pretrained does, and
    read back by transformers' own from_pretrained."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(transformers.GPT2LMHeadModel(config))
    index = accelerator.save_model(
        model, tmp_path / "gpt2", max_shard_size="40KB", safe_serialization=safe_serialization
    )
    suffix = ".safetensors" if safe_serialization else ".bin"
    stem = "model" if safe_serialization else "pytorch_model"
    assert index == tmp_path / "gpt2" / f"{stem}{suffix}.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 2 and files[0] == f"{stem}-00001-of-{len(files):05d}{suffix}"
    assert "lm_head.weight" not in weight_map  # tied to transformer.wte.weight: stored once
    config.save_pretrained(tmp_path / "gpt2")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    original = accelerator.unwrap_model(model).state_dict()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in original.items())
    with pytest.raises(ValueError, match=r"max_shard_size='10 parsecs' is not a size"):
        accelerator.save_model(model, tmp_path / "bad", max_shard_size="10 parsecs")


def test_save_and_load_state_pre_hooks_under_zero3_on_two_processes(tmp_path):
    """A save hook that saves model 0 its own way (and pops its weights on the main process only) and
    a load hook that takes it out of the list: model 0 is neither saved nor loaded by unison, on every
    process alike (its ZeRO-3 save is collective), the hook's file is part of the checkpoint, and the
    other model round-trips."""
    launch_ok(WORKERS / "state_hooks_worker.py", 2, tmp_path, timeout=180)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for record in records:
        assert record["calls"] == [["save", 2, 2], ["load", 2, True]], record["calls"]
        assert "first" in record["files"] and "model_0" not in record["files"], record["files"]
        assert "model_1" in record["files"] and "optimizer_0" in record["files"], record["files"]
        assert "model_0" in record["files_after_remove"], record["files_after_remove"]
    assert records[0]["second_restored"] and records[0]["first_left_alone"]
