"""Launched by tests/test_accelerate_compat.py: a script written in Accelerate 1.x's idioms, with only
the import lines changed, trained against a plain-torch reference that each rank computes itself.

Usage: accelerate_style_worker.py OUT_DIR. Each rank writes OUT_DIR/rank{R}.json:
- "max_param_diff": dataloader_config (split_batches) + gradient_accumulation_plugin (num_steps=2,
  sync_each_batch=True) + a scheduler that changes the rate every step, against one process that
  reads each optimizer step's global batch at once;
- "sync_pattern": which micro-steps synchronise over two epochs of 3 rounds with num_steps=2, with
  sync_with_dataloader True and False;
- "fp16_hook": DDP's gradient all-reduce through torch's fp16 compression hook, against the fp32
  mean of every rank's local gradient;
- "strict_loads": load_state(strict=True / False) of checkpoints saved under DDP and ZeRO-3 into the
  model with one more parameter under ZeRO-3 and DDP, and back (see strict_loads below);
- "join": join_uneven_inputs over a DDP model with even_batches=False and 2n + 1 batches, against a
  one-process reference of what torch's Join computes; and the layouts it refuses;
- "profile": the trace files every process sees after profile() with output_trace_dir, and the aten ops
  of its own trace; the broadcasts profile() counts in each pass of a loop (broadcasts_per_pass);
- "sync_in_backward": trigger_sync_in_backward after forwards under no_sync (the gradients' mean over the
  processes), unwrap_model of a model compiled before prepare(), should_save_model;
- "local_sgd": LocalSGD's cases and refusal (local_sgd_case.py, whose reference the test computes);
- "triggers", "last_process", "distributed_type_checks", "destroyed": the rest of the surface.
Before the group is destroyed, the same launch runs the file's shorter workers, each with the state
reset first: on 2 processes static_graph_worker.py's run (OUT_DIR/static_graph.txt), on 3
logging_worker.py's (OUT_DIR/log.txt).
"""

import json
import sys
from pathlib import Path

import local_sgd_case
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import unison
from unison import Accelerator
from unison.utils import (
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    ProfileKwargs,
    find_executable_batch_size,
    set_seed,
)

out_dir = Path(sys.argv[1])
GLOBAL_BATCH, STEPS, ACCUMULATION = 12, 4, 2  # 12 rows: split evenly over 2 or 3 processes


def make_model() -> nn.Module:
    set_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def make_data(rows: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(rows, 6, generator=generator), torch.randn(rows, 2, generator=generator))


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def reference(dataset: TensorDataset) -> nn.Module:
    """One process, plain torch: each optimizer step takes the mean over its window's samples."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = schedule(optimizer)
    x, y = dataset.tensors
    window = GLOBAL_BATCH * ACCUMULATION
    for step in range(STEPS):
        rows = slice(step * window, (step + 1) * window)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model


class Scaled(nn.Module):
    """make_model's network times a buffer, which DDP broadcasts from process 0 before each training
    forward (broadcast_buffers=True, as BERT's position_ids are)."""

    def __init__(self):
        super().__init__()
        self.inner = make_model()
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def broadcasts_per_pass(accelerator: Accelerator) -> list[int]:
    """The c10d::broadcast_ calls a profile() sees in each of two passes of 2 steps over a shuffled loader
    (Accelerate's examples/by_feature/profiler.py counts them in its table): the loader agrees on process
    0's generator states in one broadcast per pass, DDP broadcasts the buffer once per step. A first pass
    runs unprofiled: DDP rebuilds its buckets once, at the second forward (two more broadcasts)."""
    model = accelerator.prepare(Scaled())
    rows = make_data(4 * accelerator.num_processes)
    shuffled = accelerator.prepare(DataLoader(rows, batch_size=2, shuffle=True))

    def one_pass() -> None:
        for x, y in shuffled:
            accelerator.backward(nn.functional.mse_loss(model(x), y))

    one_pass()
    counts = []
    for _ in range(2):
        with accelerator.profile(ProfileKwargs(activities=["cpu"])) as prof:
            one_pass()
        counts.append(sum(event.count for event in prof.key_averages() if event.key == "c10d::broadcast_"))
    return counts


def main() -> None:
    """Inside a function, so every prepared model is freed before the interpreter's teardown: a DDP model
    left in a global can abort the process after its work is done (docs/failures.md)."""
    dataset = make_data(GLOBAL_BATCH * ACCUMULATION * STEPS)
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=ACCUMULATION, sync_each_batch=True),
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH)  # split_batches: the global batch, cut per process
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, schedule(optimizer))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    plain = reference(dataset)
    record = {
        "max_param_diff": max(
            (a - b).abs().max().item()
            for a, b in zip(accelerator.unwrap_model(model).parameters(), plain.parameters())
        ),
        "lr_after": scheduler.get_last_lr()[0],
    }

    patterns = {}
    for sync_with_dataloader in (True, False):
        looping = Accelerator(
            cpu=True,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=ACCUMULATION, sync_with_dataloader=sync_with_dataloader
            ),
        )
        net = looping.prepare(make_model())
        rounds = looping.prepare(DataLoader(make_data(3 * 2 * looping.num_processes), batch_size=2))
        pattern = []
        for _epoch in range(2):
            for x, y in rounds:
                with looping.accumulate(net):
                    looping.backward(nn.functional.mse_loss(net(x), y))
                    pattern.append(looping.sync_gradients)
        patterns[str(sync_with_dataloader)] = pattern
    record["sync_pattern"] = patterns

    # DDPCommunicationHookType.FP16: gradients averaged in fp16 (so each is an fp16 value), close to fp32's.
    hooked = Accelerator(
        cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)]
    )
    net = hooked.prepare(make_model())
    plain = make_model()
    inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + hooked.process_index))
    hooked.backward(net(inputs).pow(2).mean())
    plain(inputs).pow(2).mean().backward()
    exact = [p.grad / hooked.num_processes for p in plain.parameters()]
    for grad in exact:
        dist.all_reduce(grad)
    synced = [p.grad for p in net.parameters()]
    record["fp16_hook"] = {
        "representable_in_fp16": all(torch.equal(g, g.half().float()) for g in synced),
        "max_relative_error": max(
            ((g - e).abs().max() / e.abs().max()).item() for g, e in zip(synced, exact)
        ),
        "differs_from_fp32": any(not torch.equal(g, e) for g, e in zip(synced, exact)),
    }

    # find_executable_batch_size: only the last process runs out of memory (a real allocator failure) above
    # 60, before any collective of its attempt; every process must go on at the same size.
    attempts = []

    @find_executable_batch_size(starting_batch_size=100)
    def train_with(batch_size: int) -> int:
        attempts.append(batch_size)
        if accelerator.is_last_process and batch_size > 60:
            torch.empty(2**62, dtype=torch.uint8)  # more than any machine has
        return batch_size

    chosen = torch.tensor([train_with()])
    dist.all_reduce(chosen)  # the size every process went on with, summed
    record["executable_batch_size"] = {"summed": chosen.item(), "attempts": attempts}

    # A flag raised on the last process alone stops every process at the same step.
    seen = []
    for step in range(4):
        if step == 2 and accelerator.is_last_process:
            accelerator.set_trigger()
        seen.append(accelerator.check_trigger())
    record["triggers"] = seen

    @accelerator.on_last_process
    def mark_last() -> int:
        return accelerator.process_index

    record["last_process"] = mark_last()
    record["distributed_type_checks"] = [
        accelerator.distributed_type == DistributedType.MULTI_CPU,
        accelerator.distributed_type
        in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.XLA),
        accelerator.distributed_type == DistributedType.MULTI_XPU,
    ]
    # Trackers: the main process writes the run's files; every process calls the same lines.
    tracked = Accelerator(cpu=True, project_dir=out_dir / "runs", log_with=["jsonl", "csv"])
    tracked.init_trackers("exp", config={"lr": 0.5})
    tracked.log({"loss": torch.tensor(float(tracked.process_index)), "step_time": 0.25}, step=1)
    record["trackers_here"] = [tracker.name for tracker in tracked.trackers]
    record["runs_dir"] = str(out_dir / "runs")
    tracked.end_training()

    # load_state(strict=...): checkpoints of the model saved under DDP (one torch file) and ZeRO-3 (DCP
    # shards)
    # loaded into the same model with one more parameter, under ZeRO-3 and DDP; and that model's ZeRO-3
    # checkpoint loaded back into the model without it (a key the checkpoint holds and the model has not).
    class WithExtra(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            set_seed(11)  # other values than make_model's: a load that did nothing would show
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
            self.extra = nn.Parameter(torch.full((3,), 5.0))

    def plain_net() -> nn.Module:
        model = nn.Module()
        model.net = make_model()
        return model

    def strict_loads(into: str, model: nn.Module, source: Path) -> dict:
        """Load `source` into `model` under layout `into`, strict then not; what each process saw."""
        loader = Accelerator(cpu=True, parallelism=into)
        prepared = loader.prepare(model)
        try:
            loader.load_state(source)
            refused = ""
        except unison.CheckpointError as error:
            refused = str(error)
        loader.load_state(source, strict=False)
        state = loader.get_state_dict(prepared)  # the whole model, on process 0
        expected = plain_net().state_dict()
        return {
            "refused": refused,
            "loaded_equal": not state or all(torch.equal(state[k], v) for k, v in expected.items()),
            "extra": state["extra"].tolist() if "extra" in state else None,
            "prepared": prepared,
            "accelerator": loader,
        }

    checkpoints = {}
    for layout in ("ddp", "zero3"):
        saver = Accelerator(cpu=True, parallelism=layout)
        saver.prepare(plain_net())
        checkpoints[layout] = saver.save_state(out_dir / f"plain_{layout}")
    strict = {}
    for into, source in (("ddp", "zero3"), ("zero3", "ddp"), ("zero3", "zero3")):
        result = strict_loads(into, WithExtra(), checkpoints[source])
        strict[f"{source}->{into}"] = {key: result[key] for key in ("refused", "loaded_equal", "extra")}
    extra_checkpoint = result["accelerator"].save_state(out_dir / "extra_zero3")  # DCP shards
    for into in ("zero3", "ddp"):
        result = strict_loads(into, plain_net(), extra_checkpoint)
        strict[f"extra->{into}"] = {key: result[key] for key in ("refused", "loaded_equal", "extra")}
    record["strict_loads"] = strict

    # join_uneven_inputs: 2n + 1 batches of 2 (the last of one sample) dealt without top-up, so process 0 has
    # 3 batches and the others 2. Join's reference, on one process: each step's gradient is the sum over the
    # processes that still had a batch, divided by n (the joined ones all-reduce zeros), and every process
    # ends with the parameters of the last to join.
    def join_reference(x: torch.Tensor, y: torch.Tensor, n: int, lr: float) -> tuple[list, nn.Module]:
        model = make_model()
        gradients = []
        for step in range(3):
            for p in model.parameters():
                p.grad = None
            for process in range(n):
                index = step * n + process
                if index * 2 < len(x):
                    loss = nn.functional.mse_loss(
                        model(x[index * 2 : index * 2 + 2]), y[index * 2 : index * 2 + 2]
                    )
                    (loss / n).backward()
            gradients.append([p.grad.clone() for p in model.parameters()])
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        return gradients, model

    joiner = Accelerator(cpu=True)  # even_batches=True by default: overridden for the context only
    n = joiner.num_processes
    uneven = make_data(2 * (2 * n) + 1)
    net = make_model()
    net, opt, rows = joiner.prepare(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(uneven, batch_size=2)
    )
    lengths = {"before": len(rows)}
    seen_gradients = []
    with joiner.join_uneven_inputs([net], even_batches=False):
        lengths["inside"] = len(rows)
        for x, y in rows:
            joiner.backward(nn.functional.mse_loss(net(x), y))
            seen_gradients.append([p.grad.clone() for p in net.parameters()])
            opt.step()
            opt.zero_grad()
    lengths["after"] = len(rows)
    expected_gradients, expected = join_reference(*uneven.tensors, n, lr=0.1)
    record["join"] = {
        "lengths": lengths,
        "steps": len(seen_gradients),
        "max_grad_diff": max(
            (a - b).abs().max().item()
            for step, grads in enumerate(seen_gradients)
            for a, b in zip(grads, expected_gradients[step])
        ),
        "max_param_diff": max(
            (a - b).abs().max().item()
            for a, b in zip(joiner.unwrap_model(net).parameters(), expected.parameters())
        ),
    }
    refusals = {}
    for name, make in (
        ("zero3", lambda: Accelerator(cpu=True, parallelism="zero3")),
        ("accumulation", lambda: Accelerator(cpu=True, gradient_accumulation_steps=2)),
    ):
        refuser = make()
        model = refuser.prepare(make_model())
        try:
            with refuser.join_uneven_inputs([model], even_batches=False):
                refusals[name] = ""
        except ValueError as error:
            refusals[name] = str(error)
    with joiner.join_uneven_inputs([net]):  # even batches: nothing to join
        refusals["even"] = ""
    record["join"]["refusals"] = refusals

    # profile(): each process writes its Chrome trace, named by its process index, and finds all of them
    # after.
    traces = out_dir / "traces"
    profiled = Accelerator(
        cpu=True, kwargs_handlers=[ProfileKwargs(activities=["cpu"], output_trace_dir=str(traces))]
    )
    with profiled.profile():
        for _ in range(2):
            joiner.backward(nn.functional.mse_loss(net(uneven.tensors[0][:2]), uneven.tensors[1][:2]))
    own = json.loads((traces / f"profile_{profiled.process_index}.json").read_text())
    record["profile"] = {
        "files": sorted(path.name for path in traces.iterdir()),
        "ops": sorted(
            {event["name"] for event in own["traceEvents"] if event.get("name", "").startswith("aten::")}
        ),
        "broadcasts_per_pass": broadcasts_per_pass(profiled),
    }

    # trigger_sync_in_backward: two forwards under no_sync, the first backward local, the second synchronised;
    # unwrap_model of a model compiled before prepare() (DDP around torch.compile's OptimizedModule).
    synced = Accelerator(cpu=True)
    twin = synced.prepare(make_model())
    inputs = [
        torch.randn(4, 6, generator=torch.Generator().manual_seed(20 + 2 * r + i))
        for r in range(n)
        for i in (0, 1)
    ]
    mine = inputs[2 * synced.process_index : 2 * synced.process_index + 2]
    with synced.no_sync(twin):
        loss_a, loss_b = (twin(x).pow(2).mean() for x in mine)
    synced.backward(loss_a)
    after_a = [p.grad.clone() for p in twin.parameters()]
    with synced.trigger_sync_in_backward(twin):
        synced.backward(loss_b)
    after_b = [p.grad.clone() for p in twin.parameters()]
    twin.zero_grad()
    with synced.trigger_sync_in_backward(
        twin
    ):  # a forward outside no_sync: DDP's own all-reduce, nothing more
        synced.backward(twin(mine[0]).pow(2).mean())
    armed = [p.grad.clone() for p in twin.parameters()]

    def local_gradients(batches: list[torch.Tensor]) -> list[torch.Tensor]:
        model = make_model()
        for x in batches:
            model(x).pow(2).mean().backward()
        return [p.grad for p in model.parameters()]

    mean = [sum(grads) / n for grads in zip(*(local_gradients(inputs[2 * r : 2 * r + 2]) for r in range(n)))]
    first_mean = [
        sum(grads) / n for grads in zip(*(local_gradients(inputs[2 * r : 2 * r + 1]) for r in range(n)))
    ]
    compiled_user = torch.compile(make_model(), backend="eager")
    compiled_prepared = synced.prepare(compiled_user)
    record["sync_in_backward"] = {
        "first_local": max((a - b).abs().max().item() for a, b in zip(after_a, local_gradients(mine[:1]))),
        "second_mean": max((a - b).abs().max().item() for a, b in zip(after_b, mean)),
        "armed_mean": max((a - b).abs().max().item() for a, b in zip(armed, first_mean)),
        "unwrap_compiled": [
            synced.unwrap_model(compiled_prepared) is compiled_user,
            synced.unwrap_model(compiled_prepared, keep_torch_compile=False) is compiled_user._orig_mod,
            type(compiled_prepared).__name__,
        ],
        "should_save_model": synced.should_save_model,
    }

    record["local_sgd"] = local_sgd_case.run()

    rank = accelerator.process_index
    # accelerator.save: the main process writes, whoever calls (here: every process, each its own value)
    accelerator.save({"writer": torch.tensor([rank])}, out_dir / "saved.pt")
    accelerator.wait_for_everyone()
    record["saved_by"] = torch.load(out_dir / "saved.pt")["writer"].item()
    # save_state into a directory of each process's own (Accelerate allows it): refused on every process
    try:
        accelerator.save_state(out_dir / f"own_{rank}")
    except unison.CheckpointError as error:
        record["own_directories"] = str(error)
    record["own_directories_created"] = sorted(
        p.name for p in out_dir.iterdir() if p.name.startswith(("own_", ".own"))
    )
    accelerator.wait_for_everyone()
    world = accelerator.num_processes
    if world in (2, 3):  # the file's shorter workers, in this launch: one launch fewer each
        import logging_worker
        import static_graph_worker

        unison.AcceleratorState._reset_state()
        unison.GradientState._reset_state()
        if world == 2:
            static_graph_worker.run(out_dir / "static_graph.txt")
        else:
            logging_worker.run(out_dir / "log.txt")
    state = accelerator.state  # as Accelerate's test scripts end: the shared state reset, then the group
    unison.AcceleratorState._reset_state()  # ended through the state object kept
    state.destroy_process_group()
    record["destroyed"] = not dist.is_initialized()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
