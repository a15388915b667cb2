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
import difflib
import re
from typing import Any, Callable, Iterable, Sequence

from treetools.shared.patterns import compile_regex

FLOAT_STEP = re.compile(r"^\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")
"""A step that need not be an int (flax's ``save_checkpoint(..., step=0.625)``); ``ckpt.steps.parse_step`` reads
the same text."""


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
        compile_regex(text)
    except re.error as e:
        shown = repr(text) if len(text) <= 200 else repr(text[:200]) + "..."
        raise argparse.ArgumentTypeError(f"{shown} is not a valid regex ({e})") from None
    return text


def step(text: str) -> int | float | str:
    """A step number, ``latest`` (or -1, the same) or ``all``; any other negative number is a usage error.

    >>> step("100"), step("latest"), step("-1")
    (100, 'latest', 'latest')
    >>> step("-2")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected a step number >= 0, -1 or `latest` (the latest committed step) or `all`;
    got '-2'
    """
    if text in ("latest", "all"):
        return text
    try:
        number: int | float | None = int(text)
    except ValueError:
        number = float(text) if FLOAT_STEP.match(text) else None  # flax's float steps: `best_acc_0.625`
    if number == -1:
        return "latest"
    if number is None or number < 0:
        raise argparse.ArgumentTypeError(
            f"expected a step number >= 0, -1 or `latest` (the latest committed step) or `all`; got {text!r}")
    return number


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` closest to ``word`` (difflib), or None when none is close.

    >>> closest("--itme", ["--item", "--include", "--step"]), closest("--frobnicate", ["--item"])
    ('--item', None)
    """
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The usage error for words ``parser`` does not know, each unknown option with the option it is close to.

    What argparse says ("unrecognized arguments: --itme params"), with the subcommand's own options as the
    suggestions, so the error comes from the subcommand (its usage line) and names the fix.

    >>> p = argparse.ArgumentParser(prog="treetools inspect")
    >>> _ = p.add_argument("--item"), p.add_argument("--stats")
    >>> unrecognized(p, ["--itme", "params"])
    'unrecognized arguments: --itme params; did you mean --item?'
    >>> unrecognized(p, ["--itme=params", "--stast"])
    'unrecognized arguments: --itme=params --stast; did you mean --item (for --itme), --stats (for --stast)?'
    """
    options = [s for action in parser._actions for s in action.option_strings]  # argparse has no public list
    close = {}
    for word in extras:
        name = word.split("=", 1)[0]
        match = closest(name, options) if name.startswith("-") else None
        if match is not None:
            close[name] = match
    text = f"unrecognized arguments: {' '.join(extras)}"
    if len(close) == 1:
        return f"{text}; did you mean {next(iter(close.values()))}?"
    if close:
        return f"{text}; did you mean {', '.join(f'{m} (for {w})' for w, m in close.items())}?"
    return text
