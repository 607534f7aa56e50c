"""--use-toy-data: a task a tiny model learns in a few dozen steps, with no corpus and no
tokenizer: a smoke test of the whole trainer in seconds."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from minigpt.core.data import Batches, Data


@dataclass(eq=False)
class ToyBatches(Batches):
    """Rows (start + k * stride) mod vocab, a random start and a stride 1..4 that only the context
    reveals; seeded as Batches are, so a resume is exact."""

    vocab_size: int = 64

    def windows(self, rng: np.random.Generator) -> np.ndarray:
        start = rng.integers(0, self.vocab_size, size=(self.batch_size, 1))
        stride = rng.integers(1, 5, size=(self.batch_size, 1))
        return (start + stride * np.arange(self.seq_len + 1)) % self.vocab_size


def toy_data(cfg, rank: int, pin: bool) -> Data:
    shape = dict(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.data_seed, pin_memory=pin)
    toy = functools.partial(ToyBatches, np.zeros(0, "<u2"), vocab_size=cfg.vocab_size, **shape)
    return Data(toy(rank=rank), functools.partial(toy, stream=1), "toy sequences", cfg.vocab_size, None, None)
