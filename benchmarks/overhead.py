"""What does unison cost over hand-written torch DDP? The GPT example's training loop, both ways.

    unison launch --nproc-per-node 2 --cpu benchmarks/overhead.py [--rounds 40 --steps-per-round 2]

Two comparisons, each in interleaved rounds inside the same two processes (raw, unison, raw,
unison, ...), so whatever else the machine is doing hits both alike:

1. Training step, gradient accumulation 2. "raw" is the loop as nanoGPT's train_gpt2.py writes it:
   init_process_group, DistributedSampler, DDP, no_sync() on the non-final micro-step, the loss
   divided by the accumulation steps, clipping, and the logged loss all-reduced across processes.
   "unison" is the same loop through Accelerator.prepare / accumulate / backward / reduce.
   Reported: the median step time of each and unison/raw (target <= 1.01).
2. Data loading alone: batches/s of the raw DataLoader with a DistributedSampler against the
   prepared DataLoader, over the same dataset, each batch ending on the training device (the raw
   loop calls .to(device) as train_gpt2.py does; the prepared loader places batches itself).
   Reported: prepared/raw (target >= 0.98).

The main process prints a table and writes everything as JSON to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from data import CharTokenizer, CharWindows, load_corpus, train_val_split  # noqa: E402
from machine import describe_machine  # noqa: E402  (benchmarks/, the script's own folder)
from model import GPT, GPTConfig  # noqa: E402

DEVICE = torch.device("cpu")  # both loops train on the CPU over gloo (the Accelerator gets cpu=True)

from unison import Accelerator  # noqa: E402

STEP_TARGET = 1.01  # unison step time / raw step time, at most
LOADER_TARGET = 0.98  # prepared loader batches/s / raw loader batches/s, at least


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arg = parser.add_argument
    arg("--rounds", type=int, default=40, help="interleaved rounds of raw and unison training steps")
    arg("--steps-per-round", type=int, default=2, help="optimizer steps of each loop per round")
    arg("--warmup-steps", type=int, default=3, help="untimed steps of each loop before the first round")
    arg("--grad-accum", type=int, default=2)
    arg("--batch-size", type=int, default=32, help="sequences per micro-batch, per process")
    arg("--block-size", type=int, default=64)
    arg("--n-layer", type=int, default=4)
    arg("--n-head", type=int, default=4)
    arg("--n-embd", type=int, default=128)
    arg("--loader-rounds", type=int, default=20, help="interleaved rounds of the data-loading comparison")
    arg("--loader-epochs-per-round", type=int, default=3)
    arg("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "overhead.json")
    return parser.parse_args()


def forever(loader: DataLoader, set_epoch: Callable[[int], None]) -> Iterator:
    """Batches of `loader`, epoch after epoch, with a new shuffle each epoch."""
    epoch = 0
    while True:
        set_epoch(epoch)
        yield from loader
        epoch += 1


def new_model_and_optimizer(config: GPTConfig):
    torch.manual_seed(0)  # both loops start from the same weights
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
    return model, optimizer, scheduler


# ---- the two training steps -------------------------------------------------------------------
def raw_step(model: DDP, optimizer, scheduler, batches, accum: int, world_size: int) -> float:
    loss_accum = torch.zeros(())
    for micro_step in range(accum):
        x, y = next(batches)
        x, y = x.to(DEVICE), y.to(DEVICE)  # as train_gpt2.py does; a prepared loader does it for you
        last = micro_step == accum - 1
        with contextlib.nullcontext() if last else model.no_sync():  # all-reduce only on the last
            _, loss = model(x, y)
            (loss / accum).backward()
        loss_accum += loss.detach() / accum
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_accum)  # gloo has no ReduceOp.AVG: sum, then divide
    return (loss_accum / world_size).item()


def unison_step(accelerator: Accelerator, model, optimizer, scheduler, batches, accum: int) -> float:
    loss_accum = torch.zeros(())
    for _ in range(accum):
        x, y = next(batches)
        with accelerator.accumulate(model):
            _, loss = model(x, y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        loss_accum += loss.detach() / accum
    if not accelerator.sync_gradients:
        raise RuntimeError("the unison loop did not synchronise on its last micro-step: the loops differ")
    return accelerator.reduce(loss_accum, "mean").item()


def timed(step) -> tuple[float, float]:
    start = time.perf_counter()
    loss = step()
    return time.perf_counter() - start, loss


def batches_per_second(loader: DataLoader, set_epoch, epochs: range, to_device: bool) -> float:
    """Batches/s, each batch ending on the device: the raw loop moves it there itself (to_device)."""
    dist.barrier()  # both processes start together, as in training
    start, count = time.perf_counter(), 0
    for epoch in epochs:
        set_epoch(epoch)
        for x, y in loader:
            if to_device:
                x, y = x.to(DEVICE), y.to(DEVICE)
            count += 1
    return count / (time.perf_counter() - start)


def main() -> None:
    args = parse_args()
    # raw: what train_gpt2.py does by hand (the launcher set RANK, WORLD_SIZE, MASTER_ADDR/PORT)
    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # unison: adopts the process group that already exists
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, cpu=True)

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    train_tokens, _ = train_val_split(torch.tensor(tokenizer.encode(text), dtype=torch.long))
    windows = CharWindows(train_tokens, args.block_size)
    # whole accumulation windows per epoch on every process: epoch ends fall on sync steps in both loops
    unit = world_size * args.batch_size * args.grad_accum
    dataset = Subset(windows, range(len(windows) // unit * unit))
    config = GPTConfig(
        block_size=args.block_size,
        vocab_size=tokenizer.vocab_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )

    def raw_loader() -> tuple[DataLoader, DistributedSampler]:
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=0, drop_last=True)
        return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True), sampler

    def user_loader() -> DataLoader:
        return DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)

    # ---- 1. training steps
    raw_model, raw_opt, raw_sched = new_model_and_optimizer(config)
    raw_model = DDP(raw_model)
    loader, sampler = raw_loader()
    raw_batches = forever(loader, sampler.set_epoch)

    uni_model, uni_opt, uni_sched = new_model_and_optimizer(config)
    uni_model, uni_opt, uni_dl, uni_sched = accelerator.prepare(uni_model, uni_opt, user_loader(), uni_sched)
    uni_batches = forever(uni_dl, uni_dl.set_epoch)

    def raw():
        return raw_step(raw_model, raw_opt, raw_sched, raw_batches, args.grad_accum, world_size)

    def uni():
        return unison_step(accelerator, uni_model, uni_opt, uni_sched, uni_batches, args.grad_accum)

    for _ in range(args.warmup_steps):
        raw()
        uni()
    times: dict[str, list[float]] = {"raw": [], "unison": []}
    losses: dict[str, float] = {}
    for round_index in range(args.rounds):
        # alternate which loop goes first, so neither always follows the other
        order = [("raw", raw), ("unison", uni)] if round_index % 2 == 0 else [("unison", uni), ("raw", raw)]
        for name, step in order:
            dist.barrier()
            for _ in range(args.steps_per_round):
                seconds, losses[name] = timed(step)
                times[name].append(seconds)

    # ---- 2. data loading alone
    loader, sampler = raw_loader()
    prepared = accelerator.prepare(user_loader())
    rates: dict[str, list[float]] = {"raw": [], "prepared": []}
    per_round = args.loader_epochs_per_round
    batches_per_second(loader, sampler.set_epoch, range(1), to_device=True)  # warm-up
    batches_per_second(prepared, prepared.set_epoch, range(1), to_device=False)
    for round_index in range(args.loader_rounds):
        epochs = range(round_index * per_round, (round_index + 1) * per_round)
        runs = [("raw", loader, sampler.set_epoch, True), ("prepared", prepared, prepared.set_epoch, False)]
        for name, dl, set_epoch, to_device in runs if round_index % 2 == 0 else runs[::-1]:
            rates[name].append(batches_per_second(dl, set_epoch, epochs, to_device))

    # the slower process sets the pace of a step: report the elementwise max over processes
    all_times = accelerator.gather_object(times)
    all_rates = accelerator.gather_object(rates)
    if accelerator.is_main_process:
        step_times = {k: [max(t[k][i] for t in all_times) for i in range(len(times[k]))] for k in times}
        loader_rates = {k: [min(r[k][i] for r in all_rates) for i in range(len(rates[k]))] for k in rates}
        report(args, step_times, losses, loader_rates, len(prepared), world_size)
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


def report(args, step_times, losses, loader_rates, batches_per_epoch, world_size) -> None:
    raw_s, uni_s = statistics.median(step_times["raw"]), statistics.median(step_times["unison"])
    raw_bps, prep_bps = statistics.median(loader_rates["raw"]), statistics.median(loader_rates["prepared"])
    step_ratio, loader_ratio = uni_s / raw_s, prep_bps / raw_bps
    # the fastest round of each: the least disturbed by the machine (timeit's rule for noisy boxes)
    raw_best, prep_best = max(loader_rates["raw"]), max(loader_rates["prepared"])
    # the ratio within each round (both loops under the same machine noise), and its median
    n = args.steps_per_round
    round_ratios = [
        statistics.median(step_times["unison"][i : i + n]) / statistics.median(step_times["raw"][i : i + n])
        for i in range(0, len(step_times["raw"]), n)
    ]
    info = describe_machine()
    print(
        f"unison overhead: {world_size} processes on {info['cores']} cores ({info['cpu']}), "
        f"torch {info['torch']}, {info['date']}\n"
        f"GPT {args.n_layer}x{args.n_embd}, {args.batch_size}x{args.block_size} tokens per micro-batch, "
        f"accumulation {args.grad_accum}; {args.rounds} rounds x {n} steps each\n"
        f"{'':28}{'raw torch':>12}{'unison':>12}{'ratio':>9}{'target':>9}\n"
        f"{'median step time (ms)':28}{1000 * raw_s:12.1f}{1000 * uni_s:12.1f}{step_ratio:9.3f}"
        f"{'<= ' + str(STEP_TARGET):>9}\n"
        f"{'loader batches/s (median)':28}{raw_bps:12.0f}{prep_bps:12.0f}{loader_ratio:9.3f}"
        f"{'>= ' + str(LOADER_TARGET):>9}\n"
        f"{'loader batches/s (best)':28}{raw_best:12.0f}{prep_best:12.0f}{prep_best / raw_best:9.3f}\n"
        f"step ratio within each round: median {statistics.median(round_ratios):.3f} "
        f"(min {min(round_ratios):.3f}, max {max(round_ratios):.3f})\n"
        f"last logged loss: raw {losses['raw']:.3f}, unison {losses['unison']:.3f}"
    )
    result = {
        "benchmark": "overhead",
        "machine": info,
        "processes": world_size,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "step": {
            "raw_median_s": raw_s,
            "unison_median_s": uni_s,
            "ratio": step_ratio,
            "target_max": STEP_TARGET,
            "meets_target": step_ratio <= STEP_TARGET,
            "round_ratios": round_ratios,
            "median_round_ratio": statistics.median(round_ratios),
            "raw_s": step_times["raw"],
            "unison_s": step_times["unison"],
            "last_loss": losses,
        },
        "loader": {
            "batches_per_epoch_per_process": batches_per_epoch,
            "raw_median_batches_per_s": raw_bps,
            "prepared_median_batches_per_s": prep_bps,
            "ratio": loader_ratio,
            "target_min": LOADER_TARGET,
            "meets_target": loader_ratio >= LOADER_TARGET,
            "raw_best_batches_per_s": raw_best,
            "prepared_best_batches_per_s": prep_best,
            "best_ratio": prep_best / raw_best,
            "raw_batches_per_s": loader_rates["raw"],
            "prepared_batches_per_s": loader_rates["prepared"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
