"""The fine-tuning text and which of its characters count: Python source whose comments and docstrings
are the targets.

The default text is the stdlib source the GPT example did NOT train on: the top-level `*.py` files
after the one its 1,000,000-character corpus ends in, in sorted order, whole files up to
DEFAULT_FINETUNE_CHARS. The model reads all of it as context, but only the characters inside `#`
comments and triple-quoted strings (docstrings, mostly) are predicted in the loss, so the number of
counted tokens swings from 1 to the whole window between windows: exactly where the per-micro-batch
mean and the global token mean part ways.
"""

from __future__ import annotations

import io
import sysconfig
import tokenize
from pathlib import Path

import torch
from torch.utils.data import Dataset

DEFAULT_FINETUNE_CHARS = 300_000
IGNORE = -100  # the label of a target that does not count (F.cross_entropy's default ignore_index)


def _stdlib_files_after_gpt_corpus(gpt_corpus_chars: int) -> list[Path]:
    """The sorted top-level stdlib files that come after the GPT example's corpus (data.stdlib_corpus)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    total = 0
    for i, path in enumerate(files):
        total += len(path.read_text(encoding="utf-8", errors="replace"))
        if total >= gpt_corpus_chars:
            return files[i + 1 :]
    return []


def _python_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(path.rglob("*.py"))
    raise FileNotFoundError(f"--data {path} does not exist; pass a .py file or a folder of .py files.")


def comment_and_docstring_mask(source: str) -> torch.Tensor | None:
    """A bool per character of `source`: True inside a `#` comment or a triple-quoted string.

    None when `source` does not tokenize as Python (such a file is skipped).
    """
    line_starts = [0]
    for line in io.StringIO(source):
        line_starts.append(line_starts[-1] + len(line))
    mask = torch.zeros(len(source), dtype=torch.bool)
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            is_docstring = token.type == tokenize.STRING and token.string.lstrip("rbuRBU")[:3] in (
                '"""',
                "'''",
            )
            if token.type == tokenize.COMMENT or is_docstring:
                (row, col), (end_row, end_col) = token.start, token.end
                mask[line_starts[row - 1] + col : line_starts[end_row - 1] + end_col] = True
    except (tokenize.TokenError, SyntaxError):
        return None
    return mask


def load_finetune_text(
    path: str | Path | None, gpt_corpus_chars: int, max_chars: int = DEFAULT_FINETUNE_CHARS
) -> tuple[str, torch.Tensor]:
    """The fine-tuning text and its mask of counted characters (whole files, in sorted order).

    path None: the stdlib files after the GPT corpus, up to max_chars; else a .py file or every .py file
    under a folder (all of them). Files that do not tokenize are skipped.
    """
    files = _stdlib_files_after_gpt_corpus(gpt_corpus_chars) if path is None else _python_files(Path(path))
    texts, masks, total = [], [], 0
    for file in files:
        source = file.read_text(encoding="utf-8", errors="replace")
        mask = comment_and_docstring_mask(source)
        if mask is None:
            continue
        texts.append(source)
        masks.append(mask)
        total += len(source)
        if path is None and total >= max_chars:
            break
    if not texts:
        raise ValueError(
            f"--data {path} holds no Python source that tokenizes; pass a .py file or a folder of them."
        )
    return "".join(texts), torch.cat(masks)


class MaskedWindows(Dataset):
    """Non-overlapping windows (x, labels): labels is x shifted one character on, IGNORE where the
    target character is outside a comment or docstring. Windows without any counted target are left
    out: they would teach nothing, and a per-micro-batch mean over zero tokens is 0/0."""

    def __init__(self, tokens: torch.Tensor, counted: torch.Tensor, block_size: int):
        if len(tokens) <= block_size:
            raise ValueError(
                f"{len(tokens)} tokens cannot fill one window of block_size={block_size} plus its target; "
                "use more text."
            )
        starts = range(0, len(tokens) - block_size, block_size)
        self.tokens, self.block_size = tokens, block_size
        self.labels = torch.where(counted, tokens, IGNORE)
        self.starts = [s for s in starts if counted[s + 1 : s + 1 + block_size].any()]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.starts[i]
        return (
            self.tokens[start : start + self.block_size],
            self.labels[start + 1 : start + 1 + self.block_size],
        )
