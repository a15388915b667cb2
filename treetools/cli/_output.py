"""What the command line prints, on stdout and stderr alike, through one escaping function (``render.safe_text``).

A checkpoint's names, metric values and error details reach the terminal
only through here: data lines with their own line structure kept
(``out``), diagnostics as one escaped line each (``error``, ``note``,
``warning``), so a hostile file can neither move the cursor, clear the
screen, reorder a line (U+202E) nor forge a second ``treetools: note:`` line.

A reader that goes away (``treetools diff ... | head -1``) never changes a
command's exit code: a write that finds stdout or stderr closed by its reader
(``BrokenPipeError``) is dropped, and so is every later write to that stream
in the same command, which finishes and returns what it found (diff: 1 when
different), with no traceback. A write to stdout that fails otherwise (a full
disk) stops the command with one line, ``OutputError``. The streams
themselves are never replaced or redirected here: ``Session`` only records
what happened to them during one ``treetools.cli.main()`` call, and the
``treetools`` program (``treetools.cli.run``), which owns the process, lets go
of a stream whose reader left just before it exits (``let_go``).

Standard library and ``treetools.shared.render`` only: parsers are built before any heavy import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any, Iterator, Sequence

from treetools.shared.errors import OutputError  # defined with the others; raised here
from treetools.shared.render import one_line, safe_text

PROG = "treetools"


@dataclasses.dataclass
class Session:
    """What happened to stdout and stderr during one command: the names of the streams whose reader left (or
    whose writes failed otherwise), from then on written no more; ``failed``: a stdout write failed other than by
    its reader leaving (reported once, as ``OutputError``)."""

    left: set[str] = dataclasses.field(default_factory=set)
    failed: bool = False


current = Session()
"""The session of the latest ``session()`` (the last command run in this process)."""


@contextlib.contextmanager
def session() -> Iterator[Session]:
    """Around one command: a fresh ``Session``; at the end, stdout and stderr flushed under the same rule.

    Raises:
      OutputError: the final flush of stdout failed other than by its reader leaving.
    """
    global current
    current = Session()
    try:
        yield current
    finally:
        for name in ("stdout", "stderr"):
            _guarded(name, "flush")


def _guarded(name: str, op: str, *args: Any) -> None:
    """``getattr(sys.<name>, op)(*args)`` unless that stream's reader left; a failure makes it left."""
    stream = getattr(sys, name)
    if stream is None or name in current.left:  # None: closed when the process started (`>&-`)
        return
    try:
        getattr(stream, op)(*args)
    except BrokenPipeError:
        current.left.add(name)
    except OSError as e:
        current.left.add(name)
        if name == "stdout":  # on stderr, diagnostics are dropped and the command's output and exit code kept
            current.failed = True
            raise OutputError(f"cannot write to stdout ({e.strerror or e}).") from None


def message(text: str, *, stream: str) -> None:
    """argparse's own text (help, usage) on ``stream`` (``stdout`` or ``stderr``) as it wrote it, under the same
    rule as ``out``: argparse swallows a failing write, so a help over the stream's buffer (8 KiB) to a full disk
    would end with exit 0."""
    _guarded(stream, "write", text)


def out(text: Any, *, flush: bool = False) -> None:
    """Data on stdout: ``text`` with its own newlines kept and every other control character escaped."""
    _guarded("stdout", "write", safe_text(text, lines=True) + "\n")
    if flush:
        _guarded("stdout", "flush")


def _diagnostic(line: str) -> None:
    _guarded("stderr", "write", line + "\n")


MOST_PROBLEMS = 20
"""An error with more problems than this shows the first ones and a count of the rest."""


def error(message: Any, *, prog: str = PROG, problems: Sequence[Any] = (), hint: Any = None) -> None:
    """``<prog>: error: <message>`` on stderr, one escaped line; then, for an error with several problems (a
    ``RulesError``, a ``CheckpointMismatchError``), one indented line per problem, the first ``MOST_PROBLEMS`` and
    a count of the rest, and the fix common to them all.

    Every line is escaped on its own and the ones after the first are indented, so a name read from a checkpoint
    can neither break a line nor start one that reads as treetools' own.
    """
    _diagnostic(f"{prog}: error: {one_line(message)}")
    for problem in problems[:MOST_PROBLEMS]:
        _diagnostic(f"  {one_line(problem)}")
    if len(problems) > MOST_PROBLEMS:
        _diagnostic(f"  ... and {len(problems) - MOST_PROBLEMS:,} more ({len(problems):,} problems in all)")
    if problems and hint is not None:
        _diagnostic(f"  {one_line(hint)}")


def note(message: Any) -> None:
    """``treetools: note: <message>`` on stderr, one escaped line."""
    _diagnostic(f"{PROG}: note: {one_line(message)}")


def warning(message: Any) -> None:
    """``treetools: <message>`` on stderr, one escaped line (a summary such as the non-finite leaves)."""
    _diagnostic(f"{PROG}: {one_line(message)}")


def let_go(name: str) -> None:
    """At the end of the program only: point the stream's descriptor at ``/dev/null``, so what Python still holds
    for a reader that left goes nowhere at exit (Python's own advice for SIGPIPE), instead of a second error and
    exit code 120. Never called by ``main()``: a Python caller's streams stay as they are."""
    stream = getattr(sys, name)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no descriptor of its own
        pass
