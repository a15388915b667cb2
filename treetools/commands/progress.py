"""A one-line progress bar on stderr, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from treetools.shared.render import safe_text


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled if enabled is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = max(int(total), 1)
        self.done = 0
        self.label = ""
        self._last = 0.0
        self._lock = threading.Lock()  # compute_stats advances from several threads

    def start(self, label: str) -> None:
        with self._lock:
            self.label = label
            self._draw()

    def advance(self, nbytes: int) -> None:
        with self._lock:
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
        label = safe_text(self.label)  # a leaf's name, read from the checkpoint
        label = label if len(label) <= 40 else "..." + label[-37:]
        self.stream.write(f"\r[{bar:<30}] {frac:6.1%} {label:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()
