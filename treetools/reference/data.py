"""A synthetic next-token task with learnable structure, and its resumable iterator.

Each sequence follows a fixed random permutation of the vocabulary (next =
perm[current]) and jumps to a uniform random token with probability
``noise``. A model that learns the permutation reaches a loss close to the
entropy of that process (``optimal_loss``); an untrained one is at log(vocab).
Batch ``i`` is a pure function of ``(seed, i)``, so the iterator's whole state
is two integers, saved as a JSON checkpoint item.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class MarkovTask:
    def __init__(self, vocab: int, seq_len: int, batch_size: int, *, seed: int = 0, noise: float = 0.1):
        self.vocab, self.seq_len, self.batch_size, self.seed, self.noise = vocab, seq_len, batch_size, seed, noise
        self.perm = np.random.default_rng(seed).permutation(vocab)
        self.index = 0

    def batch(self, index: int) -> np.ndarray:
        """Tokens of shape (batch_size, seq_len + 1): inputs ``[:, :-1]``, targets ``[:, 1:]``."""
        rng = np.random.default_rng([self.seed, index])
        out = np.empty((self.batch_size, self.seq_len + 1), np.int32)
        out[:, 0] = rng.integers(0, self.vocab, self.batch_size)
        jumps = rng.random((self.batch_size, self.seq_len)) < self.noise
        randoms = rng.integers(0, self.vocab, (self.batch_size, self.seq_len))
        for t in range(self.seq_len):
            out[:, t + 1] = np.where(jumps[:, t], randoms[:, t], self.perm[out[:, t]])
        return out

    def __next__(self) -> np.ndarray:
        batch = self.batch(self.index)
        self.index += 1
        return batch

    def __iter__(self) -> "MarkovTask":
        return self

    def get_state(self) -> dict[str, Any]:
        return {"seed": self.seed, "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"the checkpoint's data seed is {state['seed']}, not --seed {self.seed}; resume with "
                             f"--seed {state['seed']}, or start a new run in another --workdir.")
        self.index = int(state["index"])

    def optimal_loss(self) -> float:
        """Entropy (nats) of the next token given the current one."""
        p_hit = 1 - self.noise + self.noise / self.vocab
        p_other = self.noise / self.vocab
        return -(p_hit * math.log(p_hit) + (self.vocab - 1) * p_other * math.log(p_other))
