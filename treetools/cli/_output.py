"""What the command line prints, on stdout and stderr alike, through one escaping function (``render.safe_text``).

A checkpoint's names, metric values and error details reach the terminal
only through here: data lines with their own line structure kept
(``out``), diagnostics as one escaped line each (``error``, ``note``,
``warning``), so a hostile file can neither move the cursor, clear the
screen, reorder a line (U+202E) nor forge a second ``treetools: note:`` line.

Standard library and ``treetools.render`` only: parsers are built before any heavy import.
"""

from __future__ import annotations

import sys
from typing import Any

from treetools.render import one_line, safe_text

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
