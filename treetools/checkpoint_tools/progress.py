"""A one-line progress bar on stderr, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from treetools.shared.render import safe_text

CELLS = 30
"""Width of the bar: every block that moves it by a cell is drawn, however soon after the last draw."""
PAUSE = 0.1
"""Seconds between two draws that move only the percentage (tenths of a percent): millions of small blocks
cost a few draws a second, and a checkpoint of a few blocks still shows each one."""


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal.

    ``advance`` is called per block (from several threads): the bar is drawn
    whenever it moves by a cell, and the percentage, which moves by tenths,
    at most every ``PAUSE`` seconds. Rate-limited, but no step of the bar is skipped.
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled if enabled is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = max(int(total), 1)
        self.done = 0
        self.label = ""
        self._last = -float("inf")
        self._drawn = (0, 0)  # (cells, tenths of a percent) last drawn
        self._lock = threading.Lock()  # compute_stats advances from several threads

    def start(self, label: str) -> None:
        with self._lock:
            self.label = label
            self._draw()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += int(nbytes)
            cells, tenths = self._shown()
            if cells != self._drawn[0] or (tenths != self._drawn[1] and time.monotonic() - self._last >= PAUSE):
                self._draw()

    def _shown(self) -> tuple[int, int]:
        frac = min(self.done / self.total, 1.0)
        return int(frac * CELLS), int(frac * 1000)

    def _draw(self) -> None:
        if not self.enabled:
            return
        cells, tenths = self._drawn = self._shown()
        self._last = time.monotonic()
        label = safe_text(self.label)  # a leaf's name, read from the checkpoint
        label = label if len(label) <= 40 else "..." + label[-37:]
        self.stream.write(f"\r[{'#' * cells:<{CELLS}}] {tenths / 10:5.1f}% {label:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()
