"""Text in, (x, y) windows of character ids out.

The default corpus needs no download: it is the source code of the Python standard library of the
interpreter that runs this file, picked by a fixed rule (the top-level `*.py` files in sorted order,
joined, cut at DEFAULT_CORPUS_CHARS), so every process, and every run on the same Python, builds the
same text. `load_corpus(path)` reads any text file or folder instead.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

DEFAULT_CORPUS_CHARS = 1_000_000


def stdlib_corpus(max_chars: int = DEFAULT_CORPUS_CHARS) -> str:
    """The first max_chars characters of this interpreter's top-level stdlib .py files, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def _read_text_file(path: Path) -> str | None:
    """The file's text, or None for a binary file (NUL bytes or not UTF-8)."""
    raw = path.read_bytes()
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def load_corpus(path: str | Path | None = None) -> str:
    """The training text: the stdlib corpus (path None), one file, or every text file under a folder.

    A folder's files are read in sorted order of their relative paths, skipping binary files, so the
    text is the same on every process.
    """
    if path is None:
        return stdlib_corpus()
    path = Path(path)
    if path.is_file():
        text = _read_text_file(path)
        if text is None:
            raise ValueError(f"--data {path} is not a UTF-8 text file; pass a text file or a folder of them.")
        return text
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        texts = [t for t in map(_read_text_file, files) if t]
        if not texts:
            raise ValueError(f"--data {path} holds no UTF-8 text files; pass a folder with some text in it.")
        return "".join(texts)
    raise FileNotFoundError(f"--data {path} does not exist; pass a text file or a folder of text files.")


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of characters of the corpus."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as missing:
            raise ValueError(
                f"character {missing.args[0]!r} is not in the tokenizer's vocabulary of {self.vocab_size} "
                "characters; encode only text drawn from the training corpus."
            ) from None

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


class CharWindows(Dataset):
    """Windows of block_size tokens: item i is (x, y) with y = x shifted one character on.

    Windows start every `stride` tokens (default block_size: non-overlapping), so an epoch is a
    fixed, finite list that a distributed sampler can split between processes.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None):
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride or block_size
        if len(tokens) <= block_size:
            raise ValueError(
                f"{len(tokens)} tokens cannot fill one window of block_size={block_size} plus its target; "
                "use more text or a smaller --block-size."
            )

    def __len__(self) -> int:
        return (len(self.tokens) - 1 - self.block_size) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (1 - val_fraction) of the tokens for training, the rest for validation."""
    n_train = int(len(tokens) * (1 - val_fraction))
    return tokens[:n_train], tokens[n_train:]
