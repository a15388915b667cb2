"""argparse value types shared by the subcommands: a bad value is a usage error (exit 2) naming the option.

Standard library only: the parsers are built before any heavy import.

>>> positive_int("3"), nonneg_float("1e-5"), positive_float("3e-3"), unit_float("0.99")
(3, 1e-05, 0.003, 0.99)
>>> positive_int("0")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: expected a positive integer, got '0'
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable


def _number(kind: type, check: Callable[[float], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` that passes ``check``, else a usage error saying what was expected."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not check(value):  # `not check` also refuses NaN
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
nonneg_float = _number(float, lambda v: v >= 0, "a non-negative number")
positive_float = _number(float, lambda v: v > 0, "a positive number")
unit_float = _number(float, lambda v: 0 <= v <= 1, "a number between 0 and 1")  # a decay rate


def regex(text: str) -> str:
    """A pattern ``re`` compiles; kept as text (the library compiles it again).

    >>> regex("kernel$")
    'kernel$'
    """
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid regex ({e})") from None
    return text


def step(text: str) -> int | str:
    """A step number, ``latest`` (or -1, the same) or ``all``; any other negative number is a usage error.

    >>> step("100"), step("latest"), step("-1")
    (100, 'latest', 'latest')
    >>> step("-2")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected a step number >= 0, -1 or `latest` (the latest committed step) or `all`; got '-2'
    """
    if text in ("latest", "all"):
        return text
    try:
        number = int(text)
    except ValueError:
        number = None
    if number == -1:
        return "latest"
    if number is None or number < 0:
        raise argparse.ArgumentTypeError(
            f"expected a step number >= 0, -1 or `latest` (the latest committed step) or `all`; got {text!r}")
    return number


def chunk_mb(text: str) -> int:
    """MiB (fractions allowed) -> bytes, at least 1024.

    >>> chunk_mb("0.5")
    524288
    """
    return max(1024, int(positive_float(text) * 2**20))
