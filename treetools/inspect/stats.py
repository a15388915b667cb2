"""Per-leaf statistics, streamed in bounded blocks with float64 accumulation.

``mean``, ``std`` (population, ddof=0), ``min``, ``max``, ``l2`` and
``abs_max`` are taken over the *finite* elements; ``zeros``, ``nan``,
``posinf`` and ``neginf`` count elements. Blocks are merged with Chan et al.'s
pairwise update of (count, mean, M2), which stays accurate where a running
sum of squares would cancel. A leaf with no finite element gets NaN for the
float statistics (``null`` in JSON).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Iterable, TextIO

import numpy as np

from treetools.inspect.arrays import DEFAULT_CHUNK_BYTES, ArrayReader

__all__ = ["StatsAccumulator", "array_stats", "leaf_stats", "Progress"]

STAT_KEYS = ("mean", "std", "min", "max", "l2", "abs_max", "zeros", "nan", "posinf", "neginf")


def _pieces(block: np.ndarray, max_elems: int) -> Iterable[np.ndarray]:
    flat = np.ravel(block)
    for a in range(0, flat.size, max_elems):
        yield flat[a:a + max_elems]


@dataclasses.dataclass
class StatsAccumulator:
    """Running statistics of a stream of blocks; ``merge`` combines two streams.

    >>> acc = StatsAccumulator()
    >>> acc.update(np.array([1.0, 2.0, np.nan, 0.0], np.float32))
    >>> r = acc.result(); (r["mean"], r["max"], r["zeros"], r["nan"])
    (1.0, 2.0, 1, 1)
    """

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    sumsq: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    zeros: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    piece_elems: int = DEFAULT_CHUNK_BYTES // 8

    def update(self, block: np.ndarray) -> None:
        """Fold one block in, converting at most ``piece_elems`` elements to float64 at a time."""
        for piece in _pieces(block, self.piece_elems):
            x = piece.astype(np.float64) if not np.iscomplexobj(piece) else np.abs(piece).astype(np.float64)
            finite = np.isfinite(x)
            n_finite = int(np.count_nonzero(finite))
            if n_finite != x.size:
                self.nan += int(np.count_nonzero(np.isnan(x)))
                self.posinf += int(np.count_nonzero(x == np.inf))
                self.neginf += int(np.count_nonzero(x == -np.inf))
                x = x[finite]
            del finite
            if n_finite == 0:
                continue
            self.zeros += int(np.count_nonzero(x == 0))
            self.min = min(self.min, float(x.min()))
            self.max = max(self.max, float(x.max()))
            self.sumsq += float(np.dot(x, x))
            mean_b = float(x.mean())
            x -= mean_b  # in place: no second float64 copy
            self._combine(n_finite, mean_b, float(np.dot(x, x)))

    def _combine(self, n_b: int, mean_b: float, m2_b: float) -> None:
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * n_a * n_b / n
        self.count = n

    def merge(self, other: "StatsAccumulator") -> "StatsAccumulator":
        """A new accumulator holding both streams (used for ``--depth`` groups)."""
        out = dataclasses.replace(self)
        if other.count:
            out._combine(other.count, other.mean, other.m2)
        out.sumsq += other.sumsq
        out.min, out.max = min(self.min, other.min), max(self.max, other.max)
        for key in ("zeros", "nan", "posinf", "neginf"):
            setattr(out, key, getattr(self, key) + getattr(other, key))
        return out

    def result(self) -> dict[str, Any]:
        """The ten statistics; floats are NaN when no element was finite."""
        if self.count == 0:
            floats = dict.fromkeys(("mean", "std", "min", "max", "l2", "abs_max"), math.nan)
        else:
            floats = {
                "mean": self.mean,
                "std": math.sqrt(max(self.m2, 0.0) / self.count),
                "min": self.min,
                "max": self.max,
                "l2": math.sqrt(self.sumsq),
                "abs_max": max(abs(self.min), abs(self.max)),
            }
        ints = {"zeros": self.zeros, "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf}
        return {k: {**floats, **ints}[k] for k in STAT_KEYS}

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


def array_stats(array: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
    """The statistics of one in-memory array (same definitions as ``--stats``).

    >>> array_stats(np.array([3.0, -4.0]))["l2"]
    5.0
    """
    acc = StatsAccumulator(piece_elems=max(1, chunk_bytes // 8))
    acc.update(np.asarray(array))
    return acc.result()


def leaf_stats(reader: ArrayReader, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               progress: "Progress | None" = None) -> StatsAccumulator:
    """Stream one stored array through a ``StatsAccumulator`` in blocks of about ``chunk_bytes``.

    >>> from treetools.inspect.arrays import InMemoryReader
    >>> leaf_stats(InMemoryReader(np.arange(4.0)), chunk_bytes=16).result()["max"]
    3.0
    """
    acc = StatsAccumulator(piece_elems=max(1, chunk_bytes // 8))
    for block in reader.storage_blocks(chunk_bytes):
        acc.update(block)
        if progress is not None:
            progress.advance(block.size * reader.dtype.itemsize)
        del block
    return acc


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled if enabled is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = max(int(total), 1)
        self.done = 0
        self.label = ""
        self._last = 0.0

    def start(self, label: str) -> None:
        self.label = label
        self._draw()

    def advance(self, nbytes: int) -> None:
        self.done += int(nbytes)
        now = time.monotonic()
        if now - self._last > 0.1:
            self._draw()
            self._last = now

    def _draw(self) -> None:
        if not self.enabled:
            return
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        label = self.label if len(self.label) <= 40 else "..." + self.label[-37:]
        self.stream.write(f"\r[{bar:<30}] {frac:6.1%} {label:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()
