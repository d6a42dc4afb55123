"""Train a character-level GPT with unison: nanoGPT's train_gpt2.py, minus the distributed boilerplate.

    python examples/gpt/train.py                                        # one process
    unison launch --nproc-per-node 2 --cpu examples/gpt/train.py        # two processes, gloo on CPU
    unison launch --nproc-per-node 4 examples/gpt/train.py --n-layer 6  # four GPUs, NCCL

The same file runs everywhere. What train_gpt2.py does by hand, unison does here: reading RANK and
WORLD_SIZE, pinning the device, init/destroy_process_group, wrapping in DDP, giving each process its
own shard of the data, skipping the gradient all-reduce on all but the last micro-step, and dividing
the loss by the accumulation steps. What stays visible is the training itself.

The layout is the launcher's choice, not this file's: `unison launch --parallelism zero3 ...` shards
the model ZeRO-3 style, `--parallelism tp_size=2` splits every layer over 2 processes,
`--parallelism pp_size=2,pp_microbatches=4` runs it as a 2-stage pipeline. One line of the loop is
what makes the pipeline possible: `accelerator.forward_backward(model, x, y, next_token_loss)` in
place of `loss = model(x, y)[1]; accelerator.backward(loss)`, since under pipeline parallelism no
process holds the whole model; in every other layout it is exactly those two lines.

Every log line is printed by the main process only; losses are averaged over all processes first.
The same values go to PROJECT_DIR/RUN_NAME/metrics.jsonl (the `jsonl` tracker) for `unison plot`, and
a progress line (a bar on a terminal) goes to stderr. MFU is shown where the device's peak FLOP/s is
known: a data-centre GPU, or any device with --peak-flops (docs/tracking.md).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from data import CharTokenizer, CharWindows, load_corpus, train_val_split
from model import GPT, GPTConfig
from torch.utils.data import DataLoader, Subset

from unison import Accelerator, ProjectConfiguration, set_seed
from unison.throughput import Throughput, check_peak_flops, peak_flops, transformer_flops_per_token


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = parser.add_argument
    arg(
        "--data",
        default=None,
        help="text file or folder of text files (default: this Python's stdlib source)",
    )
    arg("--max-steps", type=int, default=300, help="optimizer steps to train for")
    arg("--batch-size", type=int, default=32, help="sequences per micro-batch, per process")
    arg("--block-size", type=int, default=64, help="context length in characters")
    arg("--n-layer", type=int, default=4, help="transformer blocks")
    arg("--n-head", type=int, default=4, help="attention heads per block")
    arg("--n-embd", type=int, default=128, help="width of the residual stream")
    arg("--dropout", type=float, default=0.0, help="dropout probability")
    arg(
        "--n-experts",
        type=int,
        default=0,
        help="experts per block: each block's MLP becomes a mixture of this many experts, 2 per token "
        "(0: dense; with --parallelism ep_size=N they are divided over the processes)",
    )
    arg("--lr", type=float, default=3e-3, help="peak learning rate")
    arg("--min-lr-ratio", type=float, default=0.1, help="the cosine schedule ends at lr * this")
    arg("--warmup-steps", type=int, default=30, help="optimizer steps of linear warmup")
    arg("--weight-decay", type=float, default=0.1, help="AdamW weight decay of matrices and embeddings")
    arg(
        "--grad-accum",
        type=int,
        default=None,
        help="micro-batches per optimizer step (default: the launcher's, else 1)",
    )
    arg("--mixed-precision", choices=["no", "bf16", "fp16"], help="default: the launcher's, else no")
    arg("--cpu", action="store_true", help="train on the CPU even if a GPU is visible")
    arg("--seed", type=int, default=1337, help="seeds the weights, the shuffle and the sample")
    arg(
        "--project-dir",
        default="runs/gpt",
        help="checkpoints go to PROJECT_DIR/checkpoints/, metrics to PROJECT_DIR/RUN_NAME/metrics.jsonl",
    )
    arg("--run-name", default="gpt", help="the run's folder in --project-dir, for its metrics.jsonl")
    arg("--save-every", type=int, default=100, help="checkpoint every N steps and at the end; 0: never")
    arg("--resume", action="store_true", help="continue from the newest checkpoint in --project-dir, if any")
    arg("--log-interval", type=int, default=20, help="print and log the training loss every N steps")
    arg(
        "--eval-interval",
        type=int,
        default=100,
        help="print and log the validation loss every N steps and at the end",
    )
    arg(
        "--eval-batches",
        type=int,
        default=16,
        help="validation batches of --batch-size windows for each evaluation, shared by the processes: "
        "the same windows, and so the same validation loss, on any number of processes",
    )
    arg("--sample-chars", type=int, default=300, help="characters of text to generate at the end; 0: none")
    arg(
        "--peak-flops",
        type=positive_flops,
        default=None,
        help="one device's peak FLOP/s, e.g. 1e12, to show MFU where unison's table has none (a CPU, an "
        "unlisted GPU; default: the table's, or UNISON_PEAK_FLOPS as `unison launch --peak-flops` sets it)",
    )
    return parser.parse_args()


def positive_flops(text: str) -> float:
    """--peak-flops: a number of FLOP/s above 0, or argparse's usage error naming the fix."""
    try:
        return check_peak_flops(text, "--peak-flops")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's layout and shows each option's default, except where the help
    already says what an unset option (None, or a flag's False) means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def megabytes(directory: Path) -> float:
    """The size of everything under `directory`, in MB."""
    return sum(file.stat().st_size for file in directory.rglob("*") if file.is_file()) / 1e6


def drop_steps_after(metrics: Path, step: int) -> None:
    """Forget what an interrupted run logged after the checkpoint it resumes from: those steps are
    trained again, and logged again, so the metrics file keeps one line per step."""
    if not metrics.is_file():
        return
    lines = metrics.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and (json.loads(line).get("step") or 0) <= step]
    if len(kept) < len(lines):  # and a last line cut short by the interruption
        metrics.write_text("".join(kept))


def micro_batches(train_dl, epoch: int):
    """train_dl's batches epoch after epoch, from `epoch` on (a resumed run's position inside it kept)."""
    while True:
        train_dl.set_epoch(epoch)  # the epoch, for the dataset and a resumed run's position
        yield from train_dl
        epoch += 1


def lr_lambda(warmup_steps: int, max_steps: int, min_ratio: float):
    """Multiplier of the peak lr at optimizer step `step`: linear warmup, then cosine decay to min_ratio."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def next_token_loss(output: tuple[torch.Tensor, None], targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the model's logits (its output without targets: (logits, None))."""
    logits, _ = output
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(model, val_dl, accelerator: Accelerator) -> float:
    """Mean validation loss over every process's share of val_dl (forward only, any layout)."""
    model.eval()
    losses = torch.stack([accelerator.forward_loss(model, x, y, next_token_loss) for x, y in val_dl])
    model.train()
    return accelerator.reduce(losses.mean(), "mean").item()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        mixed_precision=args.mixed_precision,
        cpu=args.cpu or None,
        project_config=ProjectConfiguration(project_dir=args.project_dir, total_limit=2),
        log_with="jsonl",
        numerics="unison",  # unison's numbers, chosen: no notes for scripts that came from Accelerate
    )
    # Identical initial weights on every process; the shuffle is the plain DataLoader's, drawn from
    # process 0's generator and shared by all (docs/data-order.md).
    set_seed(args.seed)

    # ---- data: every process builds the same text and vocabulary; prepare() gives each its own shard
    text = load_corpus(args.data)
    tokenizer = CharTokenizer(text)
    train_tokens, val_tokens = train_val_split(torch.tensor(tokenizer.encode(text), dtype=torch.long))
    train_ds = CharWindows(train_tokens, args.block_size)
    val_ds = CharWindows(val_tokens, args.block_size)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)

    # ---- model, optimizer, schedule
    config = GPTConfig(
        block_size=args.block_size,
        vocab_size=tokenizer.vocab_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
        n_experts=args.n_experts,
    )
    model = GPT(config)
    n_params = model.num_parameters()  # before prepare(), which may shard or split it
    # weight decay on matrices and embeddings only, not on biases and LayerNorm gains (as nanoGPT)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=False,
    )
    # the schedule counts optimizer steps: the prepared scheduler steps once per real optimizer step
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.warmup_steps, args.max_steps, args.min_lr_ratio)
    )

    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    # evaluate on a fixed slice of the validation windows, whatever the number of processes: the same
    # validation loss for the same weights on 1 process or 8 (each reads its share of the slice)
    val_ds = Subset(val_ds, range(min(len(val_ds), args.eval_batches * args.batch_size)))
    val_dl = accelerator.prepare(DataLoader(val_ds, batch_size=args.batch_size))
    # --resume: weights, optimizer, schedule, RNG and the data position inside the interrupted epoch
    if args.resume:
        resumed_from = accelerator.load_state(missing_ok=True)
        if resumed_from is None:
            accelerator.print(
                f"--resume: no checkpoint in {args.project_dir}/checkpoints, starting at step 0"
            )
        else:
            accelerator.print(
                f"resumed from {resumed_from} at step {accelerator.optimizer_steps}, epoch {train_dl.epoch}"
            )
    metrics = Path(args.project_dir) / args.run_name / "metrics.jsonl"
    if args.resume and accelerator.is_main_process:
        drop_steps_after(metrics, accelerator.optimizer_steps)
    accelerator.init_trackers(args.run_name, config=vars(args))

    accum = accelerator.gradient_accumulation_steps
    dp_size = accelerator.parallelism.dp_size  # processes that read different data
    steps_per_epoch = math.ceil(len(train_dl) / accum)  # len(train_dl): this process's batches
    # model FLOPs utilisation where the device's peak is known (a data-centre GPU, or --peak-flops):
    # nanoGPT's 6N + 12·L·d·T FLOPs per token against every process's device together
    flops_per_token = transformer_flops_per_token(n_params, args.n_layer, args.n_embd, args.block_size)
    meter = Throughput(
        flops_per_token, peak_flops(accelerator.device, args.peak_flops), accelerator.num_processes
    )
    accelerator.print(
        f"{accelerator.num_processes} process(es) on {accelerator.device} | layout "
        f"{accelerator.parallelism.describe()} | mixed precision {accelerator.mixed_precision} | "
        f"{n_params:,} parameters | vocab {tokenizer.vocab_size} | {len(text):,} characters\n"
        f"{args.batch_size} x {args.block_size} tokens per micro-batch x {accum} micro-step(s) x {dp_size} "
        f"data-parallel process(es) = {args.batch_size * args.block_size * accum * dp_size:,} tokens per "
        f"step | {steps_per_epoch} steps per epoch"
    )

    # ---- train: one iteration per optimizer step, each of `accum` micro-batches (fewer at an epoch's end)
    first_step = accelerator.optimizer_steps  # 0, or where --resume picked up
    step, batches = first_step, micro_batches(train_dl, train_dl.epoch)
    loss_sum, micro_steps, tokens = torch.zeros((), device=accelerator.device), 0, 0
    start = time.perf_counter()
    for step in accelerator.progress(range(first_step + 1, args.max_steps + 1), desc="train"):
        while True:
            x, y = next(batches)
            with accelerator.accumulate(model):
                # forward + backward (divided by the accumulation steps); a pipeline's whole schedule
                loss = accelerator.forward_backward(model, x, y, next_token_loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()  # these three do nothing until the last micro-step of the window
                scheduler.step()
                optimizer.zero_grad()
            loss_sum += loss
            micro_steps += 1
            tokens += x.numel() * dp_size
            if accelerator.sync_gradients:
                break
        meter.step(tokens=tokens)
        tokens = 0

        if step == 1 or step % args.log_interval == 0 or step == args.max_steps:
            # the mean loss of this process's micro-steps since the last line, then of all processes
            train_loss = accelerator.reduce(loss_sum / micro_steps, "mean").item()
            rates, lr = meter.compute(), scheduler.get_last_lr()[0]
            ms_per_step = 1000 * meter.elapsed / meter.steps
            mfu = f" | MFU {rates['mfu']:.1%}" if "mfu" in rates else ""
            accelerator.print(
                f"step {step:5d}/{args.max_steps} | loss {train_loss:.4f} | lr {lr:.2e} | "
                f"{rates['tokens_per_s']:7,.0f} tok/s | {ms_per_step:4.0f} ms/step{mfu}"
            )
            rates.pop("samples_per_s")
            accelerator.log({"loss": train_loss, "lr": lr, **rates}, step=step)
            loss_sum.zero_()
            micro_steps = 0
            meter.reset()
        with meter.paused():  # evaluation and checkpoints do not count against tokens/s and MFU
            if step % args.eval_interval == 0 or step == args.max_steps:
                val_loss = evaluate(model, val_dl, accelerator)
                accelerator.print(f"step {step:5d}/{args.max_steps} | val loss {val_loss:.4f}")
                accelerator.log({"val_loss": val_loss}, step=step)
            if args.save_every and (step % args.save_every == 0 or step == args.max_steps):
                began = time.perf_counter()
                path = accelerator.save_state()  # every process takes part; the main process writes
                seconds = time.perf_counter() - began
                accelerator.print(
                    f"step {step:5d}/{args.max_steps} | saved {path} ({megabytes(path):.1f} MB) "
                    f"in {seconds:.2f} s"
                )

    batches.close()  # ends the epoch's iteration where it stopped, as leaving a for loop over train_dl does
    elapsed = time.perf_counter() - start
    if step == first_step:
        accelerator.print(f"nothing to train: the run is at step {step} of --max-steps {args.max_steps}")
    else:
        accelerator.print(
            f"trained {step - first_step} steps (steps {first_step + 1}-{step}, {step / steps_per_epoch:.2f} "
            f"epochs in all) in {elapsed:.1f} s"
        )
        accelerator.print(
            f"metrics in {metrics}; plot them: pip install 'unison[plot]' && unison plot {args.project_dir} "
            f"--metric loss --metric val_loss -o {args.project_dir}/loss.png"
        )

    # ---- a sample from the trained model, written by the main process. The weights are gathered into
    # one plain model first (every process takes part): a sharded or split model is whole nowhere.
    weights = accelerator.get_state_dict(model)
    if args.sample_chars > 0 and accelerator.is_main_process:
        raw_model = GPT(config).to(accelerator.device)
        raw_model.load_state_dict(weights)
        raw_model.eval()
        start_token = tokenizer.stoi.get("\n", 0)
        context = torch.tensor([[start_token]], device=accelerator.device)
        generator = torch.Generator(device=accelerator.device).manual_seed(args.seed)
        out = raw_model.generate(context, args.sample_chars, temperature=0.8, top_k=20, generator=generator)
        print("---- sample ----\n" + tokenizer.decode(out[0, 1:]) + "\n----------------")
    accelerator.end_training()


if __name__ == "__main__":
    main()
