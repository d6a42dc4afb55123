"""Train a small CNN on scikit-learn's bundled 8x8 digits with unison, and measure its test accuracy.

    python examples/image/train.py                                        # one process
    unison launch --nproc-per-node 2 --cpu examples/image/train.py        # two processes, gloo on CPU

The same file runs everywhere: prepare() shards the training images over the processes and wraps the
model in DDP. The evaluation is where a distributed loop most often goes quietly wrong: each process
predicts its own share of the test set, and the last round of batches is topped up with repeated
images so that every process has the same number of batches. accelerator.gather_for_metrics() joins
the shares and drops those repeats, so the accuracy counts each of the 360 test images exactly once.

The loss and learning rate of every step and the accuracy of every epoch go to
PROJECT_DIR/digits/metrics.jsonl (the "jsonl" tracker, written by the main process); the progress
display shows them as it goes. Needs scikit-learn: pip install 'unison[examples]'.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from data import load_digits_split
from model import DigitsCNN
from torch.utils.data import DataLoader

from unison import Accelerator, ProjectConfiguration, set_seed

RUN_NAME = "digits"
"""The tracker's run: metrics go to PROJECT_DIR/RUN_NAME/metrics.jsonl."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = parser.add_argument
    arg("--epochs", type=int, default=8, help="passes over the 1,437 training images")
    arg("--batch-size", type=int, default=32, help="training images per batch, per process")
    arg("--eval-batch-size", type=int, default=64, help="test images per batch, per process")
    arg("--channels", type=int, default=32, help="channels of the first convolution (the second: twice)")
    arg("--lr", type=float, default=3e-3, help="peak learning rate of the one-cycle schedule")
    arg("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    arg("--cpu", action="store_true", help="train on the CPU even if a GPU is visible")
    arg("--seed", type=int, default=0, help="seeds the weights and the shuffle")
    arg("--split-seed", type=int, default=0, help="seeds the train/test split (the same in every run)")
    arg("--project-dir", default="runs/image", help="checkpoints, final weights and metrics go here")
    arg("--resume", action="store_true", help="continue from the newest checkpoint in --project-dir, if any")
    arg(
        "--progress-interval",
        type=float,
        default=10.0,
        help="seconds between progress lines when stderr is not a terminal (a terminal gets a tqdm bar)",
    )
    args = parser.parse_args()
    for name in ("epochs", "batch_size", "eval_batch_size", "channels"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} {getattr(args, name)}: a count, so 1 or more (e.g. {flag} 1)")
    return args


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's layout and shows each option's default, except a flag's False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


@torch.no_grad()
def evaluate(model, test_dl, accelerator: Accelerator) -> tuple[int, int]:
    """(correct, counted) over the whole test set, the same numbers on every process.

    Each process predicts its own batches; gather_for_metrics joins them in order and drops the images
    repeated to even out the last round, so `counted` is the size of the test set, not a multiple of
    the batch size times the number of processes.
    """
    model.eval()
    correct = counted = 0
    for images, labels in test_dl:
        predictions = model(images).argmax(dim=-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))
        correct += (predictions == labels).sum().item()
        counted += labels.numel()
    model.train()
    return correct, counted


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(
        cpu=args.cpu or None,
        log_with="jsonl",
        project_config=ProjectConfiguration(project_dir=args.project_dir, total_limit=2),
        numerics="unison",  # unison's numbers, chosen: no notes for scripts that came from Accelerate
    )
    set_seed(args.seed)  # identical initial weights on every process, and the shuffle's seed

    # ---- data: every process builds the same split; prepare() gives each its own share of the batches
    train_ds, test_ds = load_digits_split(args.split_seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True)
    test_dl = DataLoader(test_ds, batch_size=args.eval_batch_size)

    # ---- model, optimizer, and a schedule that steps every optimizer step
    model = DigitsCNN(args.channels)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model, optimizer, train_dl, test_dl = accelerator.prepare(model, optimizer, train_dl, test_dl)
    steps_per_epoch = len(train_dl)  # this process's batches: one optimizer step each
    total_steps = args.epochs * steps_per_epoch
    scheduler = accelerator.prepare(
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    )
    accelerator.init_trackers(RUN_NAME, config=vars(args))
    if args.resume:
        resumed_from = accelerator.load_state(missing_ok=True)
        if resumed_from is None:
            accelerator.print(f"--resume: no checkpoint in {args.project_dir}/checkpoints, starting afresh")
        else:
            accelerator.print(f"resumed from {resumed_from} at epoch {train_dl.epoch}")

    processes = accelerator.num_processes
    accelerator.print(
        f"{processes} process(es) on {accelerator.device} | {n_params:,} parameters | "
        f"{len(train_ds):,} training and {len(test_ds)} test images\n"
        f"{args.batch_size} images per batch x {processes} process(es) = {args.batch_size * processes} "
        f"per step | {steps_per_epoch} steps per epoch"
    )

    # ---- train, evaluating and saving at the end of every epoch
    step = first_step = accelerator.optimizer_steps  # 0, or where --resume picked up
    start = time.perf_counter()
    while train_dl.epoch < args.epochs:
        epoch = train_dl.epoch + 1  # counted from 1 in what is printed and logged
        batches = accelerator.progress(train_dl, desc=f"epoch {epoch}", interval=args.progress_interval)
        for images, labels in batches:
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            mean_loss = accelerator.reduce(loss.detach(), "mean").item()  # every process's batch
            accelerator.log({"loss": mean_loss, "lr": scheduler.get_last_lr()[0]}, step=step)
        correct, counted = evaluate(model, test_dl, accelerator)
        accuracy = 100 * correct / counted
        accelerator.log({"epoch": epoch, "test_accuracy": accuracy}, step=step)
        accelerator.print(
            f"epoch {epoch} | test accuracy {accuracy:.2f}% ({correct} of {counted}) | "
            f"{time.perf_counter() - start:.1f} s"
        )
        accelerator.save_state()  # every process takes part; the main process writes

    if step == first_step:
        accelerator.print(f"nothing to train: the run is at epoch {train_dl.epoch} of --epochs {args.epochs}")
    else:
        accelerator.print(
            f"trained {step - first_step} steps (steps {first_step + 1}-{step}) in "
            f"{time.perf_counter() - start:.1f} s"
        )
    # the trained weights as one plain file, loadable without unison (every process takes part)
    weights = accelerator.save_model(model, Path(args.project_dir) / "model", safe_serialization=False)
    accelerator.print(f"weights saved to {weights}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
