"""Fine-tune the GPT example's model on comments and docstrings, with a summed loss and num_items.

    python examples/gpt/train.py --max-steps 100                                 # first, a GPT to start from
    unison launch --nproc-per-node 2 --cpu examples/finetune/train.py            # then fine-tune it
    unison launch --nproc-per-node 2 --cpu examples/finetune/train.py --normalize per-batch
    unison launch --nproc-per-node 2 --cpu --parallelism tp_size=2 examples/finetune/train.py --lora 8

The model reads Python source it has not seen, but only the characters inside comments and
docstrings are targets (the others are labelled -100), so the number of counted tokens varies a lot
between micro-batches and processes. Each micro-step back-propagates the loss *summed* over its
counted tokens with `accelerator.backward(loss, num_items=count)`; unison divides the step's
gradients by the count over all processes and micro-steps, so each token weighs the same wherever it
landed, and the run ends with the same weights (to rounding) on any number of processes. Every log
line prints that loss (summed losses / global count) beside the usual recipe's number (each
micro-batch's own mean, then averaged over micro-steps and processes); `--normalize per-batch` trains
the usual way, to compare. `--lora R` freezes the GPT and trains PEFT's LoRA adapters of rank R on
every projection instead (pip install 'unison[peft]'), under any layout `unison launch --parallelism`
names (docs/fine-tuning.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from spans import IGNORE, MaskedWindows, load_finetune_text
from torch.utils.data import DataLoader

from unison import Accelerator, ProjectConfiguration
from unison.checkpoint import CheckpointError, load_object, newest_checkpoint, verify_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))  # the GPT example's model and data
from data import DEFAULT_CORPUS_CHARS, CharTokenizer, load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

MAKE_ONE = (
    "Train the GPT example first, e.g. `bash scripts/demo.sh --max-steps 100` or "
    "`python examples/gpt/train.py --max-steps 100`: both save to runs/gpt/checkpoints/."
)


def positive(value: str) -> int:
    """argparse type: an integer >= 1 (a count of steps, windows or batches)."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(
            f"{value} is not allowed: it counts steps or batches, pass 1 or more"
        )
    return number


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = parser.add_argument
    arg("--init-from", default="runs/gpt", help="the GPT example's --project-dir or one of its checkpoints")
    arg(
        "--n-head", type=int, default=4, help="the GPT's --n-head (its other sizes are read from its tensors)"
    )
    arg(
        "--base-data",
        default=None,
        help="the GPT's --data, which made its vocabulary (default: stdlib source)",
    )
    arg(
        "--data",
        default=None,
        help="a .py file or folder of them to fine-tune on (default: 300,000 characters of stdlib source "
        "after the GPT's corpus)",
    )
    arg(
        "--normalize",
        choices=["global", "per-batch"],
        default="global",
        help="global: summed loss and num_items, every counted token weighs the same; per-batch: each "
        "micro-batch's own mean, the usual recipe",
    )
    arg("--max-steps", type=positive, default=100, help="optimizer steps")
    arg("--batch-size", type=positive, default=4, help="windows per micro-batch, per process")
    arg("--grad-accum", type=positive, default=2, help="micro-batches per optimizer step")
    arg("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    arg("--seed", type=int, default=1337, help="seeds the shuffle")
    arg("--log-interval", type=positive, default=10, help="print the training losses every N steps")
    arg("--project-dir", default="runs/finetune", help="the end state is saved to PROJECT_DIR/checkpoints/")
    arg(
        "--lora",
        type=positive,
        default=None,
        metavar="R",
        help="freeze the GPT and train LoRA adapters of rank R on its projections (PEFT; default: every "
        "weight trains)",
    )
    return parser.parse_args()


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's layout and shows each default, except None (the help says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def find_checkpoint(init_from: str) -> Path:
    """The checkpoint directory `init_from` names: itself, or the newest under init_from/checkpoints."""
    path = Path(init_from)
    if (path / "manifest.json").is_file():
        return path
    newest = newest_checkpoint(path / "checkpoints")
    if newest is None:
        raise FileNotFoundError(
            f"--init-from {init_from}: no GPT checkpoint there (neither a checkpoint directory nor a project "
            f"directory with checkpoints/checkpoint_<step>). {MAKE_ONE}"
        )
    return newest


def load_gpt(checkpoint: Path, n_head: int) -> GPT:
    """The GPT saved in `checkpoint` by the GPT example's save_state, its sizes read from its tensors."""
    verify_checkpoint(checkpoint)  # every file's size and checksum, before anything is read
    if not (checkpoint / "model_0.pt").is_file():
        raise CheckpointError(
            f"{checkpoint} holds its model in sharded form (model_0/, saved under ZeRO, tensor or pipeline "
            "parallelism); this example reads the one-file form that a DDP or one-process run saves. "
            f"Train the GPT with the default layout. {MAKE_ONE}"
        )
    weights = load_object(checkpoint / "model_0.pt", map_location="cpu")
    vocab_size, n_embd = weights["transformer.wte.weight"].shape
    n_layer = sum(key.endswith(".ln_1.weight") for key in weights)
    if n_head < 1 or n_embd % n_head:
        raise ValueError(
            f"--n-head {n_head} does not divide the checkpoint's n_embd={n_embd}; pass the GPT's --n-head."
        )
    config = GPTConfig(
        block_size=weights["transformer.wpe.weight"].shape[0],
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        bias="transformer.ln_f.bias" in weights,
    )
    model = GPT(config)
    model.load_state_dict(weights)
    return model


LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]  # every projection of a block: attention's and the MLP's


def with_lora(model: GPT, rank: int) -> torch.nn.Module:
    """The GPT frozen, with PEFT's LoRA adapters of `rank` beside its projections (lora_alpha = 2 x rank,
    the usual choice; lora_B starts at zero, so the first forward is the GPT's)."""
    try:
        import peft
    except ImportError as error:
        message = f"--lora needs PEFT, which is not installed: pip install 'unison[peft]' ({error})"
        raise SystemExit(message) from None
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def masked_losses(model, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy summed over the counted targets of a batch, and their number."""
    logits, _ = model(x)
    summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return summed, (labels != IGNORE).sum()


@torch.no_grad()
def evaluate(model, val_dl, accelerator: Accelerator) -> float:
    """Validation loss per counted token over the whole validation set: every window's summed loss and
    count, gathered without the windows repeated to even out the processes' last batches."""
    model.eval()
    total = torch.zeros(2, device=accelerator.device)
    for x, labels in val_dl:
        logits, _ = model(x)
        losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
        per_window = torch.stack([losses.sum(1), (labels != IGNORE).sum(1).to(losses.dtype)], 1)
        total += accelerator.gather_for_metrics(per_window).sum(0)  # inside the loop: it knows the batch
    model.train()
    loss_sum, count = total
    return (loss_sum / count).item()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        project_config=ProjectConfiguration(project_dir=args.project_dir),
        numerics="unison",  # unison's numbers, chosen: no notes for scripts that came from Accelerate
    )
    checkpoint = find_checkpoint(args.init_from)
    model = load_gpt(checkpoint, args.n_head)
    config, n_params = model.config, model.num_parameters()
    if args.lora:
        torch.manual_seed(args.seed)  # lora_A's random start: the same on any number of processes
        model = with_lora(model, args.lora)
    trainable = [p for p in model.parameters() if p.requires_grad]

    # the GPT's vocabulary is the sorted set of characters of its corpus: rebuilt from the same corpus
    tokenizer = CharTokenizer(load_corpus(args.base_data))
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(
            f"the checkpoint's vocabulary has {config.vocab_size} characters, --base-data "
            f"{args.base_data or '(stdlib source)'} gives {tokenizer.vocab_size}: pass the --data the GPT "
            "was trained on."
        )
    text, counted = load_finetune_text(args.data, DEFAULT_CORPUS_CHARS)
    unknown = sum(ch not in tokenizer.stoi for ch in set(text))
    text = "".join(ch if ch in tokenizer.stoi else "?" for ch in text)  # characters the GPT never saw
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    n_train = int(len(tokens) * 0.9)  # the last 10% for validation
    train_ds = MaskedWindows(tokens[:n_train], counted[:n_train], config.block_size)
    val_ds = MaskedWindows(tokens[n_train:], counted[n_train:], config.block_size)
    # the loader's own generator: the order depends on --seed alone, on any number of processes
    shuffle = torch.Generator().manual_seed(args.seed)
    train_dl = DataLoader(train_ds, args.batch_size, shuffle=True, drop_last=True, generator=shuffle)
    if len(train_ds) < args.batch_size * accelerator.num_processes:
        raise ValueError(
            f"{len(train_ds)} training windows cannot give each of {accelerator.num_processes} process(es) a "
            f"batch of --batch-size {args.batch_size}: pass a smaller --batch-size or more --data."
        )
    val_dl = DataLoader(val_ds, batch_size=64)  # forward only: larger batches cost no more memory here

    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    accelerator.print(
        f"{accelerator.num_processes} process(es) | from {checkpoint} ({n_params:,} parameters"
        + (f"; LoRA r={args.lora}: {sum(p.numel() for p in trainable):,} trained)" if args.lora else ")")
        + f" | layout {accelerator.parallelism.describe()}"
        f" | {len(text):,} characters, {counted.float().mean():.0%} of them in comments or "
        f"docstrings, {unknown} unknown | {len(train_ds):,} training windows of {config.block_size} | "
        f"normalize {args.normalize}\n"
        f"{args.batch_size} windows per micro-batch x {args.grad_accum} micro-step(s) x "
        f"{accelerator.num_processes} process(es) per step"
    )
    accelerator.print(f"step {0:4d} | val loss {evaluate(model, val_dl, accelerator):.4f}")

    # this process's since the last line: summed loss, counted tokens, sum of micro-batch means, micro-batches
    window = torch.zeros(4, device=accelerator.device)
    counts: list[torch.Tensor] = []  # counted tokens of each micro-batch since the last line
    step = 0
    while step < args.max_steps:
        for x, labels in train_dl:
            with accelerator.accumulate(model):
                summed, count = masked_losses(model, x, labels)
                if args.normalize == "global":
                    accelerator.backward(summed, num_items=count)
                else:
                    accelerator.backward(summed / count)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            loss = summed.detach()
            window += torch.stack([loss, count.to(loss.dtype), loss / count, torch.ones_like(loss)])
            counts.append(count)
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step == 1 or step % args.log_interval == 0 or step == args.max_steps:
                loss_sum, items, sum_of_means, micro_batches = accelerator.reduce(window, "sum").tolist()
                fewest, most = accelerator.gather(torch.stack(counts)).aminmax()
                accelerator.print(
                    f"step {step:4d} | loss per token {loss_sum / items:.4f} | mean of micro-batch means "
                    f"{sum_of_means / micro_batches:.4f} | {int(items):,} tokens in {int(micro_batches)} "
                    f"micro-batches of {fewest}-{most} tokens"
                )
                window.zero_()
                counts.clear()
            if step == args.max_steps:
                break

    accelerator.print(f"step {step:4d} | val loss {evaluate(model, val_dl, accelerator):.4f}")
    path = accelerator.save_state()
    accelerator.print(f"saved {path}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
