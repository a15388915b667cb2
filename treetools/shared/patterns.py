"""Path patterns: Python regexes matched with ``re.search`` against the one path string.

Standard library only: the jax-free commands (``treetools inspect``, ``diff``)
filter checkpoint leaves with the same rule as ``get_param_mask_fn`` filters a
live tree. A pattern that matches no path is an error naming the pattern and a
few nearby paths, never a silent no-op: a typo must not decay (or freeze,
or drop) everything.

>>> match_patterns(["a/bias", "a/kernel"], compile_patterns(["bias$"], name="exclude"), name="exclude")
[True, False]
"""

from __future__ import annotations

import difflib
import re
from typing import Iterable, Sequence

from treetools.shared.errors import PatternError


def compile_regex(pattern: str | re.Pattern) -> re.Pattern:
    """``re.compile``, with a pattern Python's parser cannot take (5,000 nested groups: it parses by recursion) one
    more ``re.error`` instead of a ``RecursionError``.

    >>> compile_regex("(" * 5000 + "w" + ")" * 5000)
    Traceback (most recent call last):
    re.error: nested too deeply for Python's regex parser
    """
    try:
        return re.compile(pattern)
    except RecursionError:
        raise re.error("nested too deeply for Python's regex parser") from None
    except OverflowError as e:  # "regular expression code size limit exceeded"
        raise re.error(str(e)) from None


def compile_patterns(patterns: str | Iterable[str] | None, *, name: str) -> list[re.Pattern]:
    """Compile regexes, naming the argument in the error for a bad one.

    >>> [p.pattern for p in compile_patterns(r"bias$", name="exclude")]
    ['bias$']
    """
    if patterns is None:
        return []
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    out = []
    for pat in patterns:
        try:
            out.append(compile_regex(pat))
        except re.error as e:
            shown = repr(pat) if len(str(pat)) <= 200 else repr(str(pat)[:200]) + "..."
            raise PatternError(f"`{name}` pattern {shown} is not a valid regex ({e}); fix or escape it.") from None
    return out


def nearby(text: str, paths: Sequence[str], n: int = 5) -> list[str]:
    """The paths closest to ``text`` (the first few when none is close), each once.

    >>> nearby("Dense_0/kernal", ["Dense_0/kernel", "Dense_0/bias", "head/w"], n=1)
    ['Dense_0/kernel']
    """
    unique = list(dict.fromkeys(paths))
    return difflib.get_close_matches(text, unique, n=n, cutoff=0.0) or unique[:n]


def match_patterns(paths: Sequence[str], patterns: Sequence[re.Pattern], *, name: str,
                   shown: Sequence[str] | None = None) -> list[bool]:
    """For each path, whether any pattern ``re.search``-matches it.

    ``shown``: the paths an error offers as nearby (default ``paths``): one form of each leaf where ``paths``
    holds several.

    Raises:
      PatternError: a pattern matches no path; the message names the pattern and
        a few nearby paths.

    >>> match_patterns(["a/bias"], compile_patterns(["kernel"], name="include"), name="include")
    Traceback (most recent call last):
    ...
    treetools.shared.errors.PatternError: `include` pattern 'kernel' matches no leaf; nearby paths: ['a/bias']. Fix
    the pattern or drop it.
    """
    hits = [False] * len(paths)
    for pat in patterns:
        matched = False
        for i, p in enumerate(paths):
            if pat.search(p):
                hits[i] = matched = True
        if not matched:
            raise PatternError(
                f"`{name}` pattern {pat.pattern!r} matches no leaf; nearby paths: "
                f"{nearby(pat.pattern, paths if shown is None else shown)}. Fix the pattern or drop it."
            )
    return hits


def select(paths: Sequence[str], include: Sequence[str] = (), exclude: Sequence[str] = ()) -> list[bool]:
    """Which paths to keep: those matching an ``include`` pattern (all when none) and no ``exclude`` pattern.

    Each distinct path is matched once. A pattern that matches no path is a ``PatternError``.

    >>> select(["a/w", "a/b", "c/w"], include=["^a/"], exclude=["b$"])
    [True, False, False]
    """
    distinct = list(dict.fromkeys(paths))
    inc = compile_patterns(list(include), name="include")
    exc = compile_patterns(list(exclude), name="exclude")
    keep = dict(zip(distinct, match_patterns(distinct, inc, name="include") if inc else [True] * len(distinct)))
    if exc:
        for path, dropped in zip(distinct, match_patterns(distinct, exc, name="exclude")):
            keep[path] = keep[path] and not dropped
    return [keep[p] for p in paths]


def select_any(names: Sequence[Sequence[str]], include: Sequence[str] = (), exclude: Sequence[str] = ()) -> list[bool]:
    """``select`` for leaves known by several names (``item/path`` and ``path``, a dotted name and its ``/`` form):
    a pattern matches a leaf when it matches any of its names.

    A pattern that matches no name of any leaf is a ``PatternError``; the nearby paths it offers are each leaf's
    first name (the form the caller shows), never a mix of forms.

    >>> select_any([("params/w", "w"), ("opt/w", "w")], include=["^params/"])
    [True, False]
    >>> select_any([("params/w", "w"), ("opt/w", "w")], include=["^x"])
    Traceback (most recent call last):
    ...
    treetools.shared.errors.PatternError: `include` pattern '^x' matches no leaf; nearby paths: ['params/w', 'opt/w'].
    Fix the pattern or drop it.
    """
    flat = list(dict.fromkeys(n for group in names for n in group))
    shown = list(dict.fromkeys(group[0] for group in names if group))
    inc = compile_patterns(list(include), name="include")
    exc = compile_patterns(list(exclude), name="exclude")
    hit_inc = dict(zip(flat, match_patterns(flat, inc, name="include", shown=shown))) if inc else None
    hit_exc = dict(zip(flat, match_patterns(flat, exc, name="exclude", shown=shown))) if exc else None
    out = []
    for group in names:
        keep = hit_inc is None or any(hit_inc[n] for n in group)
        if keep and hit_exc is not None:
            keep = not any(hit_exc[n] for n in group)
        out.append(keep)
    return out
