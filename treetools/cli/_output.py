"""What the command line prints, on stdout and stderr alike, through one escaping function (``render.safe_text``).

A checkpoint's names, metric values and error details reach the terminal
only through here: data lines with their own line structure kept
(``out``), diagnostics as one escaped line each (``error``, ``note``,
``warning``), so a hostile file can neither move the cursor, clear the
screen, reorder a line (U+202E) nor forge a second ``treetools: note:`` line.

A reader that goes away (``treetools diff ... | head -1``) never changes a
command's exit code: ``readers_may_leave`` makes a write to a closed stdout
or stderr a no-op, so the command finishes and returns what it found (diff:
1 when different), with no traceback and no "Exception ignored" at exit. A
write that fails otherwise (a full disk) stops the command with one line,
``OutputError``.

Standard library and ``treetools.shared.render`` only: parsers are built before any heavy import.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator, TextIO

from treetools.shared.render import one_line, safe_text

PROG = "treetools"


def out(text: Any) -> None:
    """Data on stdout: ``text`` with its own newlines kept and every other control character escaped."""
    print(safe_text(text, lines=True))


def error(message: Any, *, prog: str = PROG) -> None:
    """``<prog>: error: <message>`` on stderr, one escaped line."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)


def note(message: Any) -> None:
    """``treetools: note: <message>`` on stderr, one escaped line."""
    print(f"{PROG}: note: {one_line(message)}", file=sys.stderr)


def warning(message: Any) -> None:
    """``treetools: <message>`` on stderr, one escaped line (a summary such as the non-finite leaves)."""
    print(f"{PROG}: {one_line(message)}", file=sys.stderr)


class OutputError(Exception):
    """stdout cannot be written (a full disk, an I/O error): the command stops with this one line."""


class _LeavingReader:
    """A text stream whose reader may close it: the first write that finds it closed (``BrokenPipeError``) turns
    this and every later write into a no-op, and the stream's descriptor into ``/dev/null`` (what the stream still
    buffers, and Python's flush at exit, go nowhere instead of raising). Any other failed write (``> /dev/full``)
    does the same, and on stdout raises ``OutputError``: the command stops there, with one line (on stderr,
    diagnostics are dropped and the command's output and exit code kept). Everything else is the stream's own."""

    def __init__(self, stream: TextIO, name: str):
        self._stream, self._name = stream, name
        self.closed_by_reader = False

    def write(self, text: str) -> int:
        self._unless_left(self._stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._unless_left(self._stream.flush)

    def _unless_left(self, op: Callable[..., Any], *args: Any) -> None:
        """``op(*args)`` on the stream while its reader is there; a write that fails makes the reader gone."""
        if self.closed_by_reader:
            return
        try:
            op(*args)
        except BrokenPipeError:
            self._reader_left()
        except OSError as e:
            self._reader_left()
            if self._name == "stdout":
                raise OutputError(f"cannot write to stdout ({e.strerror or e}).") from None

    def _reader_left(self) -> None:
        self.closed_by_reader = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor of its own (a test's capture)
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def readers_may_leave() -> Iterator[None]:
    """Around a command: writes to stdout and stderr after their reader closed them (``| head``) are dropped.

    The command runs to its end and its exit code is the one it returns, whoever stopped reading; everything
    written is flushed before leaving, under the same rule.
    """
    saved = sys.stdout, sys.stderr
    # None: the descriptor was closed when the process started (`>&-`); print() then writes nowhere, as after a
    # reader left.
    sys.stdout, sys.stderr = (None if s is None else _LeavingReader(s, name)  # type: ignore[assignment]
                              for s, name in zip(saved, ("stdout", "stderr")))
    try:
        yield
    finally:
        try:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
        finally:
            sys.stdout, sys.stderr = saved
