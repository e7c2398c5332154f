"""A synthetic, deterministic text dataset (nothing is downloaded): token sequences from a
fixed random bigram process with a few strong transitions, so a language model can learn it.
Batch ``k`` of a given seed is the same on every rank and every run."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TextData:
    """Sequences of ``seq + 1`` tokens over ``vocab``; inputs are tokens 0..seq-1 and targets
    tokens 1..seq."""

    vocab: int = 256
    seq: int = 32
    seed: int = 0

    def transitions(self) -> torch.Tensor:
        """Each token's four likely successors (fixed by the seed)."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.vocab, (self.vocab, 4), generator=gen)

    def batch(self, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of ``size`` sequences: (inputs, targets), both int64 (size, seq)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        nxt = self.transitions()
        tokens = torch.empty(size, self.seq + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab, (size,), generator=gen)
        choice = torch.randint(0, 4, (size, self.seq), generator=gen)
        noise = torch.rand(size, self.seq, generator=gen) < 0.1
        rand = torch.randint(0, self.vocab, (size, self.seq), generator=gen)
        for i in range(self.seq):
            step = nxt[tokens[:, i], choice[:, i]]
            tokens[:, i + 1] = torch.where(noise[:, i], rand[:, i], step)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
