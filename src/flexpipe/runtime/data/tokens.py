"""A token stream from disk, as one 1-D integer array (``read_tokens``):

- a UTF-8 text file, or a folder of them (every file under it, in sorted path order, joined by
  a newline): tokenised with a ``tokenizers`` tokenizer file (``tokenizer.json``) when one is
  given, else its UTF-8 bytes (vocabulary 256);
- a ``.npy`` array (its own dtype) or a ``.bin`` file of uint16 tokens (nanoGPT's and
  Megatron's layout), memory-mapped: nothing is read before a window is;
- a folder written by ``datasets.Dataset.save_to_disk`` (the ``datasets`` extra): its
  ``input_ids`` column when it has one, else its ``text`` column tokenised as text is (a
  ``DatasetDict``: its ``train`` split).

Every failure is a ``ConfigError`` naming the path and what is wrong."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flexpipe.errors import ConfigError

BYTES_VOCAB = 256
DATASETS_MARKS = ("dataset_info.json", "dataset_dict.json")
"""A folder holding one of these was written by ``datasets``' ``save_to_disk``."""
BIN_DTYPE = np.uint16
"""The token type of a ``.bin`` file (nanoGPT's ``train.bin``)."""


@dataclass(frozen=True)
class Tokens:
    """A token stream and the vocabulary it needs (None: not known before a scan)."""

    ids: np.ndarray
    vocab: int | None
    kind: str
    """How it was read: ``bytes``, ``tokenizer``, ``array`` or ``datasets``."""


def read_tokens(path: str, tokenizer: str | None = None) -> Tokens:
    """The tokens at ``path`` (see the module's docstring)."""
    where = Path(path)
    if not where.exists():
        raise ConfigError(f"--data {path!r}: no such file or folder")
    if where.is_dir() and any((where / name).exists() for name in DATASETS_MARKS):
        return _from_datasets(where, tokenizer)
    if where.suffix in (".npy", ".bin"):
        if tokenizer is not None:
            raise ConfigError(f"--data {path!r} is already tokenised; --tokenizer applies to "
                              "text only")
        return Tokens(_array(where), None, "array")
    return _from_text(_texts(where), tokenizer, path)


def _array(path: Path) -> np.ndarray:
    """A memory-mapped 1-D integer token array."""
    try:
        ids = np.load(path, mmap_mode="r") if path.suffix == ".npy" else \
            np.memmap(path, dtype=BIN_DTYPE, mode="r")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--data {str(path)!r}: cannot read it as a token array ({exc})") \
            from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"--data {str(path)!r}: expected a 1-D integer token array, got "
                          f"shape {ids.shape} of {ids.dtype}")
    return ids


def _texts(where: Path) -> Iterable[tuple[str, str]]:
    """(name, text) of the file, or of every file under the folder in sorted order."""
    files = sorted(p for p in where.rglob("*") if p.is_file()) if where.is_dir() else [where]
    if not files:
        raise ConfigError(f"--data {str(where)!r}: the folder holds no file")
    for file in files:
        try:
            yield str(file), file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"--data {str(file)!r}: not UTF-8 text (byte {exc.start}); give "
                              "a .bin/.npy token array for tokenised data") from None
        except OSError as exc:
            raise ConfigError(f"--data {str(file)!r}: cannot read it ({exc.strerror})") \
                from None


def _from_text(texts: Iterable[tuple[str, str]], tokenizer: str | None, path: str) -> Tokens:
    """The texts joined by newlines, tokenised."""
    text = "\n".join(body for _, body in texts)
    if not text:
        raise ConfigError(f"--data {path!r}: the text is empty")
    if tokenizer is None:
        return Tokens(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), BYTES_VOCAB, "bytes")
    encode, vocab = load_tokenizer(tokenizer)
    return Tokens(np.asarray(encode(text), dtype=np.int64), vocab, "tokenizer")


def load_tokenizer(path: str) -> tuple[Callable[[str], list[int]], int]:
    """``tokenizers``' tokenizer saved at ``path`` (its ``encode`` and vocabulary size)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the tokenizers library: pip install "
                          "'flexpipe[data]' (or tokenizers)") from None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own Exception types
        raise ConfigError(f"--tokenizer {path!r}: cannot load it ({exc})") from None
    return (lambda text: tok.encode(text).ids), int(tok.get_vocab_size())


def _from_datasets(where: Path, tokenizer: str | None) -> Tokens:
    """A ``datasets.load_from_disk`` folder's tokens."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"--data {str(where)!r} is a Hugging Face datasets folder: reading "
                          "it needs the datasets extra (pip install 'flexpipe[data]')") from None
    data = datasets.load_from_disk(str(where))
    if "train" in getattr(data, "keys", lambda: ())():
        data = data["train"]
    columns = list(getattr(data, "column_names", []))
    if "input_ids" in columns:
        rows = data["input_ids"]
        return Tokens(np.asarray([t for row in rows for t in row], dtype=np.int64), None,
                      "datasets")
    if "text" in columns:
        rows = data["text"]
        return _from_text(((str(where), str(row)) for row in rows), tokenizer, str(where))
    raise ConfigError(f"--data {str(where)!r}: the dataset has no input_ids or text column "
                      f"(it has {', '.join(columns) or 'none'})")
