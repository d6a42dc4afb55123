"""Launched by tests/test_errors_catalogue.py: the misuse cases of docs/errors.md, all in one launch.

Usage: misuse_worker.py OUT_DIR [FULL_DISK_DIR]. Each case is a function named after its row's id in
docs/errors.md; it runs inside try/except on every rank, and the message it raised (or None) goes to
OUT_DIR/rank{r}.json with the checks that show nothing was lost (a refused load left the model as it
was, a failed save left the previous checkpoint loadable). A barrier after each case keeps the ranks
together, so an error raised on one rank only shows up as a divergence report, not as the next case's
failure. FULL_DISK_DIR is a small file system (a 1 MiB tmpfs) for the full-disk case, absent where
the test could not mount one.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from unison import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    PartialState,
    init_empty_weights,
    ops,
)
from unison.random import set_seed

state = PartialState(cpu=True)
rank = state.process_index
out_dir = Path(sys.argv[1])
full_disk_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else None
errors: dict[str, str | None] = {}
checks: dict[str, object] = {}
cases = []


def case(function):
    """Register `function` as a case, run in the order of this file."""
    cases.append(function)
    return function


def two_layers(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))


def prepared(accelerator: Accelerator, optimizer_class=torch.optim.SGD, width: int = 8):
    """A prepared model and optimizer after one optimizer step (one accumulation window)."""
    model = two_layers(width)
    model, optimizer = accelerator.prepare(model, optimizer_class(model.parameters(), lr=0.1))
    for _ in range(accelerator.gradient_accumulation_steps):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def same(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


def saved_checkpoint(name: str) -> Path:
    """A checkpoint of a prepared two-layer model and its SGD after one step, saved by every rank."""
    accelerator = Accelerator()
    prepared(accelerator)
    return accelerator.save_state(out_dir / name)


def damaged_copy(name: str, damage) -> Path:
    """A copy of checkpoint_1 that process 0 damages with `damage(directory)`."""
    directory = out_dir / name
    if state.is_main_process:
        shutil.copytree(out_dir / "checkpoint_1", directory)
        damage(directory)
    state.wait_for_everyone()
    return directory


class Stream(IterableDataset):
    """A dataset without __len__, as a reader of shards or a generator is."""

    def __iter__(self):
        return iter(torch.arange(20.0).reshape(10, 2))


# -- configuration --------------------------------------------------------------------------------
@case
def mixed_precision():
    Accelerator(mixed_precision="fp8")


@case
def timeout_not_seconds():
    Accelerator(timeout="10")


@case
def accumulation_zero():
    Accelerator(gradient_accumulation_steps=0)


@case
def accumulation_twice():
    Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(4))


@case
def degrees_world_size():
    Accelerator(parallelism="tp_size=3")


@case
def parallelism_unknown():
    Accelerator(parallelism="fsdp")


@case
def auto_facts_half():
    Accelerator(parallelism="auto:global_batch_size=64")


@case
def ddp_options_under_zero3():
    options = [DistributedDataParallelKwargs(find_unused_parameters=True)]
    Accelerator(parallelism="zero3", kwargs_handlers=options).prepare(two_layers())


@case
def backend_for_device():
    Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="nccl")])


@case
def tracker_unknown():
    Accelerator(log_with="tensorbored")


@case
def precision_conflict():
    Accelerator(mixed_precision="bf16")  # the run's state was created with "no" (PartialState above)


@case
def dataloader_config_dict():
    Accelerator(dataloader_config={"split_batches": True})


@case
def offload_outside_zero23():
    Accelerator(parallelism="zero1,offload=true")


@case
def expert_parallel_beside_tensor_parallel():
    Accelerator(parallelism="ep_size=2,tp_size=2")


@case
def convert_outputs_auto():
    Accelerator(convert_outputs_to_fp32="auto")


@case
def activation_checkpointing_mode():
    Accelerator(activation_checkpointing="every")


@case
def activation_checkpointing_no_blocks():
    Accelerator(activation_checkpointing="full").prepare(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    )


@case
def empty_weights_real_buffers():
    with init_empty_weights(include_buffers=False):
        two_layers()


# -- prepare ----------------------------------------------------------------------------------------
@case
def prepare_other_object():
    Accelerator().prepare("model.pt")


@case
def prepared_twice():
    accelerator = Accelerator()
    model = two_layers()
    accelerator.prepare(model)  # returns a DDP wrapper; preparing that again would return it as it is
    accelerator.prepare(model)


@case
def optimizer_before_model():
    accelerator = Accelerator(parallelism="zero3")
    model = two_layers()
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.prepare(model)
    del optimizer


@case
def optimizer_stepped_before_prepare():
    model = two_layers()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    Accelerator(parallelism="zero3").prepare(model, optimizer)


@case
def optimizer_not_prepared():
    accelerator = Accelerator(parallelism="zero3")
    model = two_layers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before prepare() ...
    model = accelerator.prepare(model)  # ... and never prepared: it holds the replaced parameters
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()


def optimizer_after_prepare_trains() -> bool:
    """The right order under ZeRO-3: prepare the model, build the optimizer from it, prepare that."""
    accelerator = Accelerator(parallelism="zero3")
    model = accelerator.prepare(two_layers())
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    return all(not torch.equal(p.detach().full_tensor(), b) for p, b in zip(model.parameters(), before))


@case
def auto_loader_first():
    Accelerator(parallelism="auto").prepare(DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2))


# -- data -------------------------------------------------------------------------------------------
@case
def split_batches_indivisible():
    loader = DataLoader(TensorDataset(torch.ones(12, 2)), batch_size=3)
    Accelerator(split_batches=True).prepare(loader)


@case
def uneven_rounds_sharded():
    even = DataLoaderConfiguration(even_batches=False)
    loader = DataLoader(TensorDataset(torch.arange(18.0)), batch_size=4)  # 2 processes: 3 and 2 batches
    Accelerator(parallelism="zero3", dataloader_config=even).prepare(two_layers(), loader)


@case
def loader_without_length():
    loader = Accelerator().prepare(DataLoader(Stream(), batch_size=2))
    len(loader)


@case
def uneven_stream():
    loader = DataLoader(Stream(), batch_size=2)
    Accelerator(even_batches=False, dispatch_batches=False).prepare(loader)


# -- the training step ------------------------------------------------------------------------------
class WithUnusedHead(nn.Module):
    """A body the loss uses and a head it never reaches (an auxiliary head left out of the loss)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.body(x)


def two_steps(accelerator: Accelerator, model: nn.Module) -> None:
    model = accelerator.prepare(model)
    for _ in range(2):
        accelerator.backward(model(torch.ones(2, 4)).sum())


@case
def unused_parameters():
    two_steps(Accelerator(), WithUnusedHead())


def unused_parameter_fixes_work() -> bool:
    """Each fix the message names trains the same model: find_unused_parameters, or the head frozen."""
    options = [DistributedDataParallelKwargs(find_unused_parameters=True)]
    two_steps(Accelerator(kwargs_handlers=options), WithUnusedHead())
    frozen = WithUnusedHead()
    frozen.head.requires_grad_(False)
    two_steps(Accelerator(), frozen)
    return True


@case
def num_items_negative():
    accelerator = Accelerator()
    model = accelerator.prepare(two_layers())
    accelerator.backward(model(torch.ones(2, 4)).sum(), num_items=-1)


@case
def gather_non_tensor():
    Accelerator().gather({"loss": torch.ones(1), "name": "x"})


@case
def reduce_unknown():
    Accelerator().reduce(torch.ones(1), "median")


@case
def broadcast_out_of_range():
    ops.broadcast(torch.ones(1), from_process=2)


@case
def shapes_differ_debug():
    accelerator = Accelerator()
    accelerator.state.debug = True  # as `unison launch --debug` starts it, switched at run time
    try:
        accelerator.gather(torch.zeros(rank + 1, 3))
    finally:
        accelerator.state.debug = False


@case
def autocast_bool():
    with Accelerator().autocast(False):
        pass


@case
def seed_float():
    set_seed(1.5)


# -- checkpoints ------------------------------------------------------------------------------------
@case
def save_without_directory():
    Accelerator().save_state()


@case
def nothing_to_resume():
    Accelerator(project_dir=out_dir / "new_project").load_state()


@case
def load_missing_directory():
    Accelerator().load_state(out_dir / "chekpoint_12")


@case
def load_other_model_shapes():
    accelerator = Accelerator()
    model, _ = prepared(accelerator, width=16)
    before = snapshot(model)
    try:
        accelerator.load_state(out_dir / "checkpoint_1")
    finally:
        checks["other_model_untouched"] = same(model, before)


@case
def load_other_model_keys():
    accelerator = Accelerator()
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(2, 2))  # a layer more
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = snapshot(model)
    try:
        accelerator.load_state(out_dir / "checkpoint_1")
    finally:
        checks["other_keys_untouched"] = same(model, before)


@case
def load_more_objects_than_saved():
    accelerator = Accelerator()
    prepared(accelerator)
    accelerator.prepare(two_layers())  # a second model the saved run did not have
    accelerator.load_state(out_dir / "checkpoint_1")


@case
def load_other_optimizer():
    accelerator = Accelerator()
    model, _ = prepared(accelerator, optimizer_class=torch.optim.AdamW)
    before = snapshot(model)
    try:
        accelerator.load_state(out_dir / "checkpoint_1")
    finally:
        checks["other_optimizer_untouched"] = same(model, before)


def switching_optimizers_as_the_message_says() -> bool:
    """The message's way to change optimizers: the model alone, load_state, then the new optimizer."""
    accelerator = Accelerator()
    model = accelerator.prepare(two_layers())
    accelerator.load_state(out_dir / "checkpoint_1")
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    return True


@case
def load_other_accumulation():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, _ = prepared(accelerator)
    accelerator.prepare(DataLoader(TensorDataset(torch.arange(32.0)), batch_size=2))
    with accelerator.accumulate(model):  # one micro-batch into a window of 2
        accelerator.backward(model(torch.ones(2, 4)).sum())
    accelerator.save_state(out_dir / "mid_window")
    with accelerator.accumulate(model):  # the window's end: the gradient state (shared) syncs again
        accelerator.backward(model(torch.ones(2, 4)).sum())
    resumed = Accelerator(gradient_accumulation_steps=2)
    prepared(resumed)
    # half the micro-batch: accumulation 4 keeps the saved global batch (checkpoint/global_batch.py)
    resumed.prepare(DataLoader(TensorDataset(torch.arange(32.0)), batch_size=1))
    resumed.load_state(out_dir / "mid_window")


@case
def load_other_global_batch():
    accelerator = Accelerator()
    prepared(accelerator)
    accelerator.prepare(DataLoader(TensorDataset(torch.arange(48.0)), batch_size=3))
    accelerator.save_state(out_dir / "steps_of_6")  # 2 processes x 3 samples per optimizer step
    resumed = Accelerator()
    prepared(resumed)
    resumed.prepare(DataLoader(TensorDataset(torch.arange(48.0)), batch_size=4))  # 8 per micro-step
    resumed.load_state(out_dir / "steps_of_6")


@case
def load_loader_position():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(32.0)), batch_size=2))
    next(iter(loader))  # 2 samples on each of 2 processes: 4 consumed
    accelerator.save_state(out_dir / "mid_epoch")
    resumed = Accelerator()
    resumed.prepare(DataLoader(TensorDataset(torch.arange(32.0)), batch_size=3))  # steps of 6 samples
    resumed.load_state(out_dir / "mid_epoch")


def truncate(directory: Path) -> None:
    data = (directory / "model_0.pt").read_bytes()
    (directory / "model_0.pt").write_bytes(data[: len(data) // 2])


def flip_a_byte(directory: Path) -> None:
    data = bytearray((directory / "model_0.pt").read_bytes())
    data[100] ^= 0xFF
    (directory / "model_0.pt").write_bytes(bytes(data))


@case
def load_truncated():
    Accelerator().load_state(damaged_copy("truncated", truncate))


@case
def load_corrupted():
    Accelerator().load_state(damaged_copy("corrupted", flip_a_byte))


@case
def load_incomplete():
    Accelerator().load_state(
        damaged_copy("incomplete", lambda directory: (directory / "manifest.json").unlink())
    )


@case
def save_different_directories():
    accelerator = Accelerator()
    prepared(accelerator)
    accelerator.save_state(out_dir / f"run_of_rank_{rank}")


@case
def save_under_a_file():
    if state.is_main_process:
        (out_dir / "notes.txt").write_text("a file, not a directory")
    state.wait_for_everyone()
    accelerator = Accelerator()
    prepared(accelerator)
    accelerator.save_state(out_dir / "notes.txt" / "checkpoint")


@case
def save_disk_full():
    """The first checkpoint fits on the small disk; then the disk fills up and the second cannot."""
    if full_disk_dir is None:
        raise LookupError("no small file system was mounted: the test skips this case")
    accelerator = Accelerator()
    model = nn.Linear(256, 256)  # a 263 kB checkpoint
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    first = accelerator.save_state(full_disk_dir / "checkpoint_1")
    if state.is_main_process:  # another job's files fill the disk: 20 kB stay free
        free = shutil.disk_usage(full_disk_dir).free
        (full_disk_dir / "other_job.bin").write_bytes(bytes(free - 20_000))
    state.wait_for_everyone()
    saved = snapshot(model)
    with torch.no_grad():
        model.module.weight.add_(1.0)
    try:
        accelerator.save_state(full_disk_dir / "checkpoint_2")
    finally:
        state.wait_for_everyone()  # process 0 has removed what the failed save wrote
        checks["full_disk_left"] = sorted(path.name for path in full_disk_dir.iterdir())
        accelerator.load_state(first)  # the previous checkpoint still loads, whole
        checks["full_disk_previous_loads"] = same(model, saved)


@case
def save_async_disk_full():
    """save_disk_full with async_save=True, on the disk save_disk_full left full: save_state returns once
    the state is copied, the background write fails, and the next wait raises on every rank."""
    if full_disk_dir is None:
        raise LookupError("no small file system was mounted: the test skips this case")
    accelerator = Accelerator()
    model = nn.Linear(256, 256)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    first = full_disk_dir / "checkpoint_1"
    accelerator.load_state(first)
    saved = snapshot(model)
    with torch.no_grad():
        model.module.weight.add_(1.0)
    returned = accelerator.save_state(full_disk_dir / "checkpoint_3", async_save=True)
    checks["async_save_returned"] = str(returned)
    try:
        accelerator.wait_for_checkpoint()
    finally:
        state.wait_for_everyone()
        checks["async_full_disk_left"] = sorted(path.name for path in full_disk_dir.iterdir())
        accelerator.load_state(first)
        checks["async_full_disk_previous_loads"] = same(model, saved)


@case
def register_without_state_dict():
    Accelerator().register_for_checkpointing("model.pt")


def run() -> None:
    torch.set_num_threads(1)
    saved_checkpoint("checkpoint_1")
    for function in cases:
        try:
            function()
            errors[function.__name__] = None
        except Exception as error:
            errors[function.__name__] = f"{type(error).__name__}: {error}"
        state.wait_for_everyone()
    checks["optimizer_after_prepare_trains"] = optimizer_after_prepare_trains()
    checks["unused_parameter_fixes_work"] = unused_parameter_fixes_work()
    checks["switching_optimizers_as_the_message_says"] = switching_optimizers_as_the_message_says()
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"errors": errors, "checks": checks}, indent=1))


run()
