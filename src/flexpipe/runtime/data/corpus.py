"""Micro-batches of a token stream (``flexpipe.runtime.data.tokens``) for training: the stream
is cut into windows of ``seq + 1`` tokens (inputs, then the same shifted by one as the
targets); the last ``val_fraction`` of the windows is held out for the validation loss and the
rest is visited in a shuffled order, a new permutation per pass over the data (epoch), each a
pure function of the seed and the epoch.

Sequence ``k`` of the run is window ``perm(epoch)[k mod N]`` with ``epoch = k div N``; the
micro-batch ``j`` of step ``s`` on data-parallel replica ``r`` of ``dp`` holds sequences
``((s x dp + r) x m + j) x b ...`` (``b`` per micro-batch), so the replicas read disjoint
windows, and their batches together are the single-device batch of the step. The data position
of a run is the number of sequences its steps have read (global samples, whatever the
data-parallel degree): a checkpoint records it, and a resumed run reads on from there, at any
dp, exactly what an uninterrupted one would."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.data.tokens import Tokens, read_tokens

Sample = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(frozen=True)
class DataConfig:
    """Where the data is and how to read it (picklable: every rank that needs data opens it
    itself)."""

    path: str
    tokenizer: str | None = None
    val_fraction: float = 0.1
    """The held-out share of the windows (the last ones of the stream)."""

    def describe(self) -> dict[str, object]:
        """What a checkpoint records of the data (a resume on other data is refused)."""
        return {"path": self.path, "tokenizer": self.tokenizer, "val_fraction": self.val_fraction}


@dataclass
class Corpus:
    """The windows of a token stream, split, shuffled and sharded."""

    tokens: Tokens
    seq: int
    seed: int
    val_fraction: float = 0.1
    _perms: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        windows = (len(self.tokens.ids) - 1) // self.seq
        held = int(round(windows * self.val_fraction))
        if windows - held < 1:
            raise ConfigError(f"--data holds {len(self.tokens.ids):,} tokens: fewer than one "
                              f"training window of --seq {self.seq} + 1 after holding out "
                              f"{self.val_fraction:.0%} for validation")
        if self.val_fraction > 0 and held < 1:
            raise ConfigError(f"--data holds {windows} windows of --seq {self.seq}: too few to "
                              f"hold out {self.val_fraction:.0%} for the validation loss")
        self.train_windows, self.val_windows = windows - held, held

    def window(self, index: int) -> np.ndarray:
        """Window ``index`` (of all of them, the held-out ones last): ``seq + 1`` tokens."""
        start = index * self.seq
        return np.asarray(self.tokens.ids[start:start + self.seq + 1], dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """The training windows' order in pass ``epoch`` over them."""
        if epoch not in self._perms:
            gen = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perms = {epoch: gen.permutation(self.train_windows)}  # one pass kept
        return self._perms[epoch]

    def sequence(self, k: int) -> np.ndarray:
        """Training sequence ``k`` of the run."""
        epoch, at = divmod(k, self.train_windows)
        return self.window(int(self.order(epoch)[at]))

    def sample(self, first: int, size: int, held_out: bool = False) -> Sample:
        """Sequences ``first`` .. ``first + size - 1`` as ((inputs,), targets), int64
        (size, seq); ``held_out``: the validation windows, in order (wrapping around)."""
        rows = [self.window(self.train_windows + (first + i) % self.val_windows) if held_out
                else self.sequence(first + i) for i in range(size)]
        block = torch.from_numpy(np.stack(rows))
        return (block[:, :-1].contiguous(),), block[:, 1:].contiguous()

    def batch(self, step: int, microbatches: int, size: int, replica: int = 0,
              replicas: int = 1) -> list[Sample]:
        """The micro-batches of ``step`` for data-parallel ``replica`` of ``replicas``."""
        return self.batch_at((step * replicas + replica) * microbatches * size, microbatches,
                             size)

    def batch_at(self, first: int, microbatches: int, size: int) -> list[Sample]:
        """``microbatches`` micro-batches of ``size`` sequences from training sequence
        ``first`` on (``batch``; a resumed run reads on from its data position)."""
        return [self.sample(first + j * size, size) for j in range(microbatches)]

    def validation(self, microbatches: int, size: int, replica: int = 0,
                   replicas: int = 1) -> list[Sample]:
        """The held-out micro-batches of ``replica``: the same ones at every evaluation."""
        base = replica * microbatches
        return [self.sample((base + j) * size, size, held_out=True)
                for j in range(microbatches)]


@lru_cache(maxsize=2)
def open_corpus(data: DataConfig, seq: int, seed: int) -> Corpus:
    """The corpus of ``data`` (read once per process)."""
    return Corpus(read_tokens(data.path, data.tokenizer), seq, seed, data.val_fraction)


def vocab_needed(data: DataConfig) -> int:
    """The vocabulary the model needs for ``data``: the tokenizer's (bytes: 256), else one
    more than the largest token of the array."""
    tokens = read_tokens(data.path, data.tokenizer)
    if tokens.vocab is not None:
        return tokens.vocab
    if len(tokens.ids) == 0:
        raise ConfigError(f"--data {data.path!r}: the token array is empty")
    if int(tokens.ids.min()) < 0:
        raise ConfigError(f"--data {data.path!r}: the token array holds negative ids")
    return int(tokens.ids.max()) + 1
