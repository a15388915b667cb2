"""Rules: map a checkpoint's leaves onto the leaves a user wants.

A ``Rules`` is data (a frozen dataclass, JSON or TOML in a file, or CLI
flags): rename, drop/keep, cast, transpose, unstack and stack, each written
as Python regexes matched with ``re.search`` on the one path string
(``params/layers/3/attn/q``; a flat-key name such as
``model.layers.0.self_attn.q_proj.weight`` is matched as the string it is).
Restore, load, convert, diff and ``inspect --unstack`` all apply rules
through this one engine, in two steps:

1. ``Rules.plan(leaves)`` reads metadata only, ``(path, shape, dtype)`` per
   source leaf, and returns a ``RulesPlan``: one ``TargetLeaf`` per leaf the
   user gets (its path, shape, dtype and how it is made from the sources),
   or raises one ``RulesError`` listing every problem before any data is read.
2. ``TargetReader(target_leaf, read_source)`` reads any block of a target
   leaf by reading only the matching block of its source(s).

Order of operations (each rule's patterns see the paths of its own stage)::

    keep / drop  ->  unstack  ->  rename  ->  stack  ->  transpose  ->  cast
    `-------- source paths ---------'  `- per-layer -'   `---- target paths ----'

* ``keep`` / ``drop``: matched against the checkpoint's own paths. A leaf is
  used when it matches some ``keep`` pattern (or there are none) and no
  ``drop`` pattern. Dropped leaves are listed in ``RulesPlan.dropped``.
* ``unstack``: matched against the checkpoint's paths (a stacked, scanned
  leaf only exists there). A leaf of shape ``(L, ...)`` becomes ``L`` leaves
  of shape ``(...)``; the layer index is a new path component inserted right
  after the component in which the pattern's (first) match ends:

  ==========================  ==================  ===========================
  path                        pattern             layer 3
  ==========================  ==================  ===========================
  ``params/layers/attn/q``    ``layers``          ``params/layers/3/attn/q``
  ``params/layers/attn/q``    ``params/lay``      ``params/layers/3/attn/q``  (match ends mid-component)
  ``params/layers/attn/q``    ``layers/``         ``params/layers/3/attn/q``  (a trailing ``/`` belongs to ``layers``)
  ``params/layers/attn/q``    ``^params/.*/q$``   ``params/layers/attn/q/3``  (the whole path: the index goes last)
  ``params/layers/attn/q``    ``(?=attn)``        ``params/layers/3/attn/q``  (an empty match ends after ``layers/``)
  ``model.layers.q.weight``   ``model\\.layers``   ``model.layers.3.q.weight`` (a flat name: components split on ``.``)
  ==========================  ==================  ===========================

  A path with a ``/`` splits on ``/``; a path without one splits on ``.``.
* ``rename``: ``re.sub(pattern, replacement, path)`` on the paths after
  unstack, so per-layer names are renamed one layer at a time
  (``(r"^params/layers/(\\d+)/attn/q$", r"model.layers.\\1.self_attn.q_proj.weight")``).
  For each path the first rule whose pattern matches wins (T5X's
  ``assignment_map``); every match of that pattern in the path is replaced,
  as ``re.sub`` does. Two leaves renamed onto one path is an error naming both.
* ``stack``: the inverse of unstack, matched against the paths after rename.
  The component right after the match must be a layer index; it is removed,
  and the leaves that then share a path are stacked along a new axis 0 in
  index order: ``layers/0/q``, ``layers/1/q`` -> ``layers/q`` of shape
  ``(2, ...)``. The indices must be ``0 .. L-1`` and the layers must agree
  in shape and dtype.
* ``transpose``: ``(pattern, axes)`` matched against the target paths (after
  rename and stack); the first matching rule wins. ``axes`` are
  ``numpy.transpose``'s: target axis ``j`` is axis ``axes[j]`` of the leaf as
  unstacked/stacked (a Flax ``kernel`` ``(in, out)`` -> a PyTorch ``weight``
  ``(out, in)`` is ``(1, 0)``; a stacked ``(L, in, out)`` is ``(0, 2, 1)``).
* ``cast`` / ``dtype``: ``{pattern: dtype}`` matched against the target paths,
  first match wins; ``dtype=`` applies to every other floating leaf (integer,
  bool and complex leaves keep their dtype). Names are numpy's plus
  ml_dtypes' (``bfloat16``, ``float8_e4m3fn``). A ``cast`` rule may change a
  leaf's kind (bool, integer, floating, complex: ``step`` int32 -> float32)
  only when every leaf that rule applies to has that kind: a rule written
  for those leaves. ``{".*": "bfloat16"}`` over float and integer leaves is
  refused for the integer ones; ``dtype="bfloat16"`` is what casts all
  floating leaves.

Every pattern must match at least one path at its stage, unless
``allow_unmatched=True``; the error names the pattern and nearby paths of
that stage. Non-array leaves (``shape`` None) pass through keep/drop and
rename; cast and ``dtype=`` leave them alone; unstack, stack and transpose
of one is an error.

Command-line strings (``Rules.from_cli``): ``--rename 'PATTERN=>REPLACEMENT'``
(exactly one ``=>``), ``--cast 'PATTERN=DTYPE'`` and
``--transpose 'PATTERN=AXES'`` with ``AXES`` comma-separated
(``'weight$=1,0'``; split at the last ``=``, so a pattern may hold ``=``),
``--drop``/``--keep``/``--unstack``/``--stack PATTERN``, ``--dtype DTYPE``.
With ``--rules FILE`` the flags come after the file's rules (``Rules.merge``).

>>> rules = Rules(unstack=["layers"], rename=[(r"^layers/(\\d+)/w$", r"h.\\1.weight")],
...               transpose=[(r"weight$", (1, 0))], dtype="bfloat16")
>>> plan = rules.plan([("layers/w", (2, 4, 8), "float32"), ("step", (), "int32")])
>>> [(t.path, t.shape, t.dtype.name) for t in plan]
[('h.0.weight', (8, 4), 'bfloat16'), ('h.1.weight', (8, 4), 'bfloat16'), ('step', (), 'int32')]
>>> print(plan)
source       -> target      shape                dtype
layers/w[0]  -> h.0.weight  (2, 4, 8) -> (8, 4)  float32 -> bfloat16
layers/w[1]  -> h.1.weight  (2, 4, 8) -> (8, 4)  float32 -> bfloat16
step         -> step        ()                   int32
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

import numpy as np

from treetools.shared.errors import RulesError
from treetools.shared.patterns import compile_patterns, nearby

__all__ = [
    "Piece",
    "RuleRow",
    "Rules",
    "RulesPlan",
    "TargetLeaf",
    "TargetReader",
    "format_rows",
    "insert_index",
    "parse_cast",
    "parse_rename",
    "parse_transpose",
    "resolve_dtype",
    "take_index",
]

Index = tuple[slice, ...]
Shape = tuple[int, ...]
ReadSource = Callable[[str, Index], Any]
"""``read_source(source_path, index) -> array``: one block (a tuple of slices) of one source leaf."""

_FIELDS = ("rename", "drop", "keep", "cast", "dtype", "transpose", "unstack", "stack", "allow_unmatched")
_KINDS = {"b": "bool", "i": "integer", "u": "integer", "f": "floating", "c": "complex"}


# ---------------------------------------------------------------------------------------------- dtypes


def resolve_dtype(dtype: Any, *, name: str = "dtype") -> np.dtype:
    """A numeric numpy dtype from a name or dtype-like; ml_dtypes names (``bfloat16``) work too.

    Args:
      dtype: ``"bfloat16"``, ``"float32"``, ``np.float16``, ``jnp.bfloat16``, a ``np.dtype``...
      name: the rule field to name in the error.

    Raises:
      ValueError: not a bool, integer, floating or complex dtype.

    >>> resolve_dtype("bfloat16").name, resolve_dtype(np.float16).name
    ('bfloat16', 'float16')
    """
    import ml_dtypes  # noqa: F401  (registers bfloat16, float8_* ... as numpy dtype names; here, not at import: 4 ms)

    try:
        out = np.dtype(dtype)
    except TypeError:
        out = None
    if out is None or _kind(out) is None:
        raise ValueError(
            f"`{name}` {dtype!r} is not a numeric dtype; use a numpy or ml_dtypes name "
            "such as float32, bfloat16, float16, float8_e4m3fn, int32."
        )
    return out


def _kind(dtype: np.dtype) -> str | None:
    """``bool``, ``integer``, ``floating``, ``complex``, or None (strings, objects, records)."""
    if dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes"):
        return "integer" if dtype.name.startswith(("int", "uint")) else "floating"
    return _KINDS.get(dtype.kind)


def _source_dtype(dtype: Any) -> np.dtype | Any:
    """A source leaf's dtype as numpy's, or as given when numpy has no such dtype (a PRNG key type)."""
    if dtype is None:
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


# ---------------------------------------------------------------------------------------------- Rules


def _pattern(value: Any, field: str) -> str:
    if isinstance(value, re.Pattern):
        if value.flags & ~re.UNICODE:
            raise ValueError(f"`{field}` pattern {value.pattern!r} has flags; write them inline, e.g. '(?i)...'.")
        value = value.pattern
    if not isinstance(value, str):
        raise TypeError(f"`{field}` patterns must be strings, got {value!r}.")
    return value


def _patterns(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, re.Pattern)):
        value = [value]
    return tuple(_pattern(v, field) for v in value)


def _pairs(value: Any, field: str) -> list[tuple[Any, Any]]:
    """``{pattern: x}`` or ``[(pattern, x), ...]`` as a list of pairs, in order."""
    if value is None:
        return []
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise TypeError(f"`{field}` takes (pattern, value) pairs or a {{pattern: value}} mapping; got {item!r}.")
        out.append((_pattern(item[0], field), item[1]))
    return out


def _axes(value: Any, field: str = "transpose") -> tuple[int, ...]:
    if isinstance(value, str) or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in value):
        raise TypeError(f"`{field}` axes must be a sequence of integers such as (1, 0), got {value!r}.")
    return tuple(int(a) for a in value)


def read_rules_file(path: str | os.PathLike, *, what: str = "rules file") -> Any:
    """The data of a ``.json`` or ``.toml`` file of rules (``Rules.from_file``; ``treetools plan``'s layout rules).

    Raises:
      ValueError: an unknown suffix, or a file that does not parse (the message names ``what`` and the file).
      OSError: the file cannot be read.
    """
    path = os.path.expanduser(os.fspath(path))
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".json", ".toml"):
        raise ValueError(f"{what} {path}: unknown suffix {suffix!r}; write the rules as .json or .toml.")
    with open(path, "rb") as f:
        raw = f.read()
    import tomllib  # here, not at import: only a .toml rules file needs it

    try:
        return json.loads(raw) if suffix == ".json" else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path} does not parse as {suffix[1:].upper()}: {e}") from None


@dataclasses.dataclass(frozen=True, repr=False, kw_only=True)
class Rules:
    """How a checkpoint's leaves become the leaves a user wants (see the module docstring).

    Every field is optional and keyword-only. Sequences are stored as tuples
    and dtypes as their names, so two ``Rules`` written differently (a dict
    or a list of pairs, ``np.float16`` or ``"float16"``) compare equal, hash,
    and round-trip through ``to_dict``/``from_dict`` and files.

    Attributes:
      rename: ``[(pattern, replacement), ...]``, ``re.sub`` on the paths after unstack; first match wins.
      drop: patterns of source leaves to leave out.
      keep: patterns of source leaves to keep (all others are left out).
      cast: ``{pattern: dtype}`` on target paths; first match wins.
      dtype: a floating dtype for every floating leaf no ``cast`` rule names.
      transpose: ``[(pattern, axes), ...]`` on target paths; first match wins.
      unstack: patterns of stacked (scanned) source leaves to split along axis 0.
      stack: patterns of per-layer paths (after rename) to stack along a new axis 0.
      allow_unmatched: a pattern that matches nothing is ignored instead of an error.

    Raises:
      PatternError: a pattern is not a valid regex (the message names the field).
      ValueError: a dtype name is unknown, or ``dtype`` is not a floating dtype.

    >>> Rules(drop="opt_state", cast={"kernel$": np.float16})
    Rules(drop=('opt_state',), cast=(('kernel$', 'float16'),))
    >>> Rules.from_dict({"drop": ["opt_state"], "cast": [["kernel$", "float16"]]}) == _
    True
    """

    rename: Sequence[tuple[str, str]] | Mapping[str, str] = ()
    drop: Sequence[str] = ()
    keep: Sequence[str] = ()
    cast: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()
    dtype: Any = None
    transpose: Sequence[tuple[str, Sequence[int]]] | Mapping[str, Sequence[int]] = ()
    unstack: Sequence[str] = ()
    stack: Sequence[str] = ()
    allow_unmatched: bool = False
    _compiled: dict[str, list[re.Pattern]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        put = functools.partial(object.__setattr__, self)
        rename = []
        for pattern, repl in _pairs(self.rename, "rename"):
            if not isinstance(repl, str):
                raise TypeError(f"`rename` replacement for {pattern!r} must be a string, got {repl!r}.")
            rename.append((pattern, repl))
        put("rename", tuple(rename))
        put("cast", tuple((p, resolve_dtype(d, name=f"cast[{p!r}]").name) for p, d in _pairs(self.cast, "cast")))
        put("transpose", tuple((p, _axes(a)) for p, a in _pairs(self.transpose, "transpose")))
        for field in ("drop", "keep", "unstack", "stack"):
            put(field, _patterns(getattr(self, field), field))
        if self.dtype is not None:
            dtype = resolve_dtype(self.dtype, name="dtype")
            if _kind(dtype) != "floating":
                raise ValueError(
                    f"`dtype` {dtype.name!r} is not a floating dtype: `dtype` casts the floating leaves only; "
                    f"use cast={{pattern: {dtype.name!r}}} for the leaves you mean."
                )
            put("dtype", dtype.name)
        put("allow_unmatched", bool(self.allow_unmatched))
        for field in ("rename", "cast", "transpose"):
            self._compiled[field] = compile_patterns([p for p, _ in getattr(self, field)], name=field)
        for field in ("drop", "keep", "unstack", "stack"):
            self._compiled[field] = compile_patterns(getattr(self, field), name=field)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in _FIELDS if getattr(self, k))
        return f"Rules({fields})"

    @property
    def empty(self) -> bool:
        """True when the rules change nothing (every leaf maps onto itself).

        >>> Rules().empty, Rules(dtype="bfloat16").empty
        (True, False)
        """
        return not any(getattr(self, k) for k in _FIELDS if k != "allow_unmatched")

    # -------------------------------------------------------------------------------------- as data

    def to_dict(self) -> dict[str, Any]:
        """The non-empty fields as JSON-ready values (lists, a ``cast`` mapping); ``from_dict`` reads it back.

        >>> Rules(rename=[("^a/", "b/")], transpose={"w$": (1, 0)}).to_dict()
        {'rename': [['^a/', 'b/']], 'transpose': [['w$', [1, 0]]]}
        """
        out: dict[str, Any] = {}
        for field in _FIELDS:
            value = getattr(self, field)
            if not value:
                continue
            if field == "cast":
                out[field] = dict(value)
            elif field in ("rename", "transpose"):
                out[field] = [[p, list(v) if field == "transpose" else v] for p, v in value]
            elif isinstance(value, tuple):
                out[field] = list(value)
            else:
                out[field] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Rules:
        """Rules from a mapping with the field names as keys (what a JSON or TOML file holds).

        ``rename``, ``cast`` and ``transpose`` may be ``[[pattern, value], ...]``
        lists or ``{pattern: value}`` tables; the others lists of patterns.

        Raises:
          ValueError: a key is not a field name (a typo must not be ignored).

        >>> Rules.from_dict({"rename": {"^old/": "new/"}, "dtype": "bfloat16"})
        Rules(rename=(('^old/', 'new/'),), dtype='bfloat16')
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"rules must be a mapping of field names to values, got {type(data).__name__}.")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown rules field(s) {unknown}; the fields are {list(_FIELDS)}.")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Rules:
        """Rules from a ``.json`` or ``.toml`` file holding the same fields as ``from_dict``.

        In TOML, literal strings keep regexes readable
        (``rename = [['^params/(.*)$', 'model.\\1']]`` or a ``[rename]`` table).

        Raises:
          ValueError: an unknown suffix, a file that does not parse (the message
            names the file), or the errors of ``from_dict``.
        """
        path = os.path.expanduser(os.fspath(path))
        data = read_rules_file(path)
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise type(e)(f"rules file {path}: {e}") from None

    @classmethod
    def from_cli(
        cls,
        *,
        rules_file: str | os.PathLike | None = None,
        rename: Iterable[str] = (),
        drop: Iterable[str] = (),
        keep: Iterable[str] = (),
        cast: Iterable[str] = (),
        dtype: str | None = None,
        transpose: Iterable[str] = (),
        unstack: Iterable[str] = (),
        stack: Iterable[str] = (),
        allow_unmatched: bool = False,
    ) -> Rules:
        """Rules from command-line strings: ``--rules FILE`` first, then the flags after its rules.

        Args:
          rules_file: ``--rules``, a JSON or TOML file (``from_file``).
          rename: ``--rename 'PATTERN=>REPLACEMENT'`` strings (``parse_rename``).
          drop, keep, unstack, stack: patterns, as given.
          cast: ``--cast 'PATTERN=DTYPE'`` strings (``parse_cast``).
          dtype: ``--dtype``; replaces the file's ``dtype``.
          transpose: ``--transpose 'PATTERN=AXES'`` strings such as ``'weight$=1,0'`` (``parse_transpose``).
          allow_unmatched: ``--allow-unmatched``.

        >>> Rules.from_cli(rename=[r"^params/(.*)=>\\1"], transpose=["kernel$=1,0"], dtype="bfloat16")
        Rules(rename=(('^params/(.*)', '\\\\1'),), dtype='bfloat16', transpose=(('kernel$', (1, 0)),))
        """
        flags = cls(
            rename=[parse_rename(s) for s in rename],
            drop=tuple(drop),
            keep=tuple(keep),
            cast=[parse_cast(s) for s in cast],
            dtype=dtype,
            transpose=[parse_transpose(s) for s in transpose],
            unstack=tuple(unstack),
            stack=tuple(stack),
            allow_unmatched=allow_unmatched,
        )
        return flags if rules_file is None else cls.from_file(rules_file).merge(flags)

    def merge(self, later: Rules) -> Rules:
        """These rules followed by ``later``'s (a file's rules, then command-line flags).

        Lists are concatenated, ``self``'s first (so in the first-match-wins
        fields ``self`` wins). A ``rename``/``cast``/``transpose`` rule of
        ``later`` with the very pattern of one of ``self``'s replaces its value
        in place, so a flag can override one rule of a file. ``later.dtype``
        replaces ``self.dtype`` when set; ``allow_unmatched`` if either says so.

        >>> Rules(cast={"w$": "float16"}, drop=["a"]).merge(Rules(cast={"w$": "bfloat16"}, drop=["b"]))
        Rules(drop=('a', 'b'), cast=(('w$', 'bfloat16'),))
        """
        merged: dict[str, Any] = {}
        for field in ("rename", "cast", "transpose"):
            table = dict(getattr(self, field))
            table.update(getattr(later, field))
            merged[field] = list(table.items())
        for field in ("drop", "keep", "unstack", "stack"):
            merged[field] = getattr(self, field) + getattr(later, field)
        merged["dtype"] = later.dtype if later.dtype is not None else self.dtype
        merged["allow_unmatched"] = self.allow_unmatched or later.allow_unmatched
        return Rules(**merged)

    # -------------------------------------------------------------------------------------- planning

    def plan(
        self,
        leaves: Mapping[str, Any] | Iterable[tuple[str, Sequence[int] | None, Any]],
        *,
        num_layers: int | None = None,
        targets: Collection[str] | None = None,
    ) -> RulesPlan:
        """What every target leaf is and how it is made, from metadata only.

        Args:
          leaves: the source leaves, as ``(path, shape, dtype)`` triples
            (``shape`` None for a non-array value), or a ``{path: leaf}``
            mapping whose array leaves have ``shape`` and ``dtype`` (a
            ``tt.flatten`` of arrays or ``ShapeDtypeStruct``\\ s).
          num_layers: the layer count every unstacked leaf's axis 0 and every
            stack must have (a model config's ``num_layers``).
          targets: the paths the user wants (a restore target's); an unstacked
            leaf whose renamed layers the target names must give exactly the
            layers it names (``layers/0/...`` .. ``layers/11/...``).

        Returns:
          a ``RulesPlan``: the target leaves in source order (an unstacked leaf's
          layers where the leaf was, a stacked leaf where its layer 0 was), and
          the dropped source paths.

        Raises:
          RulesError: every problem of the first stage that has any, one line each.
          ValueError: two source leaves share a path.

        >>> plan = Rules(stack=["layers"]).plan({"layers/0/w": np.zeros((2, 3)), "layers/1/w": np.ones((2, 3))})
        >>> [(t.path, t.shape, [str(p) for p in t.pieces]) for t in plan]
        [('layers/w', (2, 2, 3), ['layers/0/w', 'layers/1/w'])]
        """
        return _Planner(self, num_layers, targets).run(_as_leaves(leaves))

    def describe(
        self,
        leaves: Mapping[str, Any] | Iterable[tuple[str, Sequence[int] | None, Any]],
        *,
        num_layers: int | None = None,
        targets: Collection[str] | None = None,
    ) -> list[RuleRow]:
        """The mapping as rows (source -> target, shape, dtype), before anything is read.

        ``format_rows`` (or ``str(rules.plan(leaves))``) prints them; dropped
        leaves come last, with ``target`` None.

        >>> rows = Rules(drop=["^opt"], dtype="float16").describe([("w", (2,), "float32"), ("opt/mu", (2,), "float32")])
        >>> [(r.source, r.target, r.dtype) for r in rows]
        [('w', 'w', 'float16'), ('opt/mu', None, None)]
        """
        return self.plan(leaves, num_layers=num_layers, targets=targets).rows()


# ---------------------------------------------------------------------------------------------- CLI strings


def parse_rename(text: str) -> tuple[str, str]:
    """``'PATTERN=>REPLACEMENT'`` (``--rename``) as ``(pattern, replacement)``.

    Raises:
      ValueError: the string has no ``=>`` or more than one (a pattern holding
        ``=>`` goes in a rules file).

    >>> parse_rename(r"^layers/(\\d+)/=>h.\\1.")
    ('^layers/(\\\\d+)/', 'h.\\\\1.')
    """
    if text.count("=>") != 1:
        raise ValueError(
            f"`--rename` {text!r}: write PATTERN=>REPLACEMENT with exactly one `=>` "
            "(a pattern or replacement holding `=>` goes in a --rules file)."
        )
    pattern, _, repl = text.partition("=>")
    return pattern, repl


def _split_last_eq(text: str, flag: str, what: str, example: str) -> tuple[str, str]:
    pattern, eq, value = text.rpartition("=")
    if not eq or not value.strip():
        raise ValueError(f"`{flag}` {text!r}: write PATTERN={what}, e.g. {example!r}.")
    return pattern, value.strip()


def parse_cast(text: str) -> tuple[str, str]:
    """``'PATTERN=DTYPE'`` (``--cast``) as ``(pattern, dtype)``, split at the last ``=``.

    >>> parse_cast("(?=kernel)=bfloat16")
    ('(?=kernel)', 'bfloat16')
    """
    return _split_last_eq(text, "--cast", "DTYPE", "kernel$=bfloat16")


def parse_transpose(text: str) -> tuple[str, tuple[int, ...]]:
    """``'PATTERN=AXES'`` (``--transpose``), axes comma-separated, split at the last ``=``.

    >>> parse_transpose(r"attn\\.c_attn\\.weight$=1,0")
    ('attn\\\\.c_attn\\\\.weight$', (1, 0))
    """
    pattern, axes = _split_last_eq(text, "--transpose", "AXES", "weight$=1,0")
    try:
        return pattern, tuple(int(a) for a in axes.split(","))
    except ValueError:
        raise ValueError(
            f"`--transpose` {text!r}: AXES must be comma-separated integers, e.g. 'weight$=1,0'."
        ) from None


# ---------------------------------------------------------------------------------------------- plan data


@dataclasses.dataclass(frozen=True)
class Piece:
    """One source leaf, or one layer of it, that a target leaf is made of.

    ``layer`` is the index into the source's axis 0 (an unstacked layer), or
    None for the whole leaf.

    >>> str(Piece("layers/attn/q", 3)), str(Piece("w"))
    ('layers/attn/q[3]', 'w')
    """

    path: str
    layer: int | None = None

    def __str__(self) -> str:
        return self.path if self.layer is None else f"{self.path}[{self.layer}]"


@dataclasses.dataclass(frozen=True)
class TargetLeaf:
    """One leaf the rules produce, and how to make it.

    Made by, in this order: take ``pieces`` (one, or the stacked layers in
    index order, each a whole source leaf or one layer of one); stack them
    along a new axis 0 when ``stacked``; ``numpy.transpose`` by ``axes``;
    ``astype(cast)``. ``shape``/``dtype`` are the result's (None for a
    non-array value, passed through as it is); ``source_shape``/``source_dtype``
    are those of the source leaf of ``pieces[0]`` as stored.
    """

    path: str
    shape: Shape | None
    dtype: Any
    pieces: tuple[Piece, ...]
    source_shape: Shape | None
    source_dtype: Any
    stacked: bool = False
    axes: tuple[int, ...] | None = None
    cast: np.dtype | None = None

    @property
    def source(self) -> str:
        """The one source path (for a stack, that of layer 0)."""
        return self.pieces[0].path

    @property
    def layer(self) -> int | None:
        """The unstacked layer of the one source (None for a whole leaf or a stack)."""
        return None if self.stacked else self.pieces[0].layer

    @property
    def is_array(self) -> bool:
        return self.shape is not None

    @property
    def identity(self) -> bool:
        """True when the leaf is a source leaf as stored (at most renamed)."""
        return not self.stacked and self.pieces[0].layer is None and self.axes is None and self.cast is None

    def row(self) -> RuleRow:
        """This leaf as a ``describe`` row."""
        ops = [f"stack {len(self.pieces)}"] if self.stacked else []
        if not self.stacked and self.pieces[0].layer is not None:
            ops.append(f"unstack [{self.pieces[0].layer}]")
        if self.axes is not None:
            ops.append(f"transpose {self.axes}")
        if self.cast is not None:
            ops.append(f"cast {self.cast.name}")
        return RuleRow(_pieces_text(self.pieces, self.stacked), self.path, self.source_shape, self.shape,
                       _dtype_text(self.source_dtype), _dtype_text(self.dtype), tuple(ops))


def _dtype_text(dtype: Any) -> str | None:
    return None if dtype is None else getattr(dtype, "name", str(dtype))


def _pieces_text(pieces: Sequence[Piece], stacked: bool) -> str:
    if not stacked:
        return str(pieces[0])
    layers = [p.layer for p in pieces]
    if len({p.path for p in pieces}) == 1 and layers == list(range(layers[0] or 0, (layers[0] or 0) + len(pieces))):
        return f"{pieces[0].path}[{layers[0]}..{layers[-1]}]"
    return f"{pieces[0]} .. {pieces[-1]} ({len(pieces)})"


@dataclasses.dataclass(frozen=True)
class RuleRow:
    """One line of ``describe``: a source (``path``, ``path[3]`` for a layer, ``a .. b (N)`` for a stack) and its target.

    ``target`` is None for a dropped leaf; ``ops`` names what happens
    (``unstack [3]``, ``rename``, ``stack 12``, ``transpose (1, 0)``, ``cast bfloat16``).
    """

    source: str
    target: str | None
    source_shape: Shape | None
    shape: Shape | None
    source_dtype: str | None
    dtype: str | None
    ops: tuple[str, ...] = ()


def format_rows(rows: Sequence[RuleRow]) -> str:
    """``describe``'s rows as plain text: ``source -> target  shape  dtype``, a change shown as ``a -> b``.

    Names are printed as they are; a terminal renderer escapes control characters.

    >>> print(format_rows(Rules(dtype="bfloat16").describe([("w", (2,), "float32")])))
    source -> target  shape  dtype
    w      -> w       (2,)   float32 -> bfloat16
    """

    def change(a: Any, b: Any) -> str:
        a, b = ("" if a is None else str(a)), ("" if b is None else str(b))
        return a if a == b or not b else f"{a} -> {b}"

    table = [("source", "-> target", "shape", "dtype")]
    for r in rows:
        target = "-> " + r.target if r.target is not None else "(dropped)"
        shape = "" if r.target is None else change(r.source_shape and tuple(r.source_shape), r.shape)
        dtype = "" if r.target is None else change(r.source_dtype, r.dtype)
        table.append((r.source, target, shape, dtype))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


@dataclasses.dataclass(frozen=True)
class RulesPlan:
    """The result of ``Rules.plan``: the target leaves, in order, and the dropped source paths.

    Iterating gives the ``TargetLeaf``\\ s; ``plan[path]`` looks one up by target path.
    """

    leaves: tuple[TargetLeaf, ...]
    dropped: tuple[str, ...] = ()
    unmatched: tuple[tuple[tuple[str, str], str], ...] = ()
    """``((field, pattern), message)`` of every pattern that matched nothing (with ``allow_unmatched``, which let it)."""

    def __iter__(self) -> Iterator[TargetLeaf]:
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)

    def __getitem__(self, path: str) -> TargetLeaf:
        return self._by_path[path]

    def __contains__(self, path: object) -> bool:
        return path in self._by_path

    @functools.cached_property
    def _by_path(self) -> dict[str, TargetLeaf]:
        return {t.path: t for t in self.leaves}

    @property
    def sources(self) -> set[str]:
        """Every source path some target leaf reads."""
        return {p.path for t in self.leaves for p in t.pieces}

    def rows(self) -> list[RuleRow]:
        """One ``RuleRow`` per target leaf, then one per dropped source leaf."""
        dropped = [RuleRow(p, None, None, None, None, None, ("drop",)) for p in self.dropped]
        return [t.row() for t in self.leaves] + dropped

    def __str__(self) -> str:
        return format_rows(self.rows())


# ---------------------------------------------------------------------------------------------- planner


def _as_leaves(leaves: Any) -> list[tuple[str, Shape | None, Any]]:
    if isinstance(leaves, Mapping):
        triples = []
        for path, leaf in leaves.items():
            array = hasattr(leaf, "shape") and hasattr(leaf, "dtype")
            triples.append((path, leaf.shape if array else None, leaf.dtype if array else None))
    else:
        triples = [tuple(t) for t in leaves]
    out, seen = [], set()
    for path, shape, dtype in triples:
        if not isinstance(path, str):
            raise TypeError(f"leaf paths must be path strings such as 'params/w', got {path!r}.")
        if path in seen:
            raise ValueError(f"two source leaves share the path {path!r}.")
        seen.add(path)
        out.append((path, None if shape is None else tuple(int(d) for d in shape), _source_dtype(dtype)))
    return out


def _sep(path: str) -> str:
    """The component separator: ``/`` for a tree path, ``.`` for a flat name without ``/``."""
    return "/" if "/" in path or "." not in path else "."


def _component_end(path: str, end: int, sep: str) -> int:
    """Where the component holding the match's last character ends; -1 for an empty match at 0.

    A separator ending the match belongs to the component before it.
    """
    if end == 0:
        return -1
    if path[end - 1] == sep:
        return end - 1
    j = path.find(sep, end)
    return len(path) if j < 0 else j


def insert_index(path: str, match: re.Match, index: int) -> str:
    """``path`` with ``index`` as a new component right after the one in which ``match`` ends.

    >>> insert_index("params/layers/attn/q", re.search("lay", "params/layers/attn/q"), 3)
    'params/layers/3/attn/q'
    """
    sep = _sep(path)
    c = _component_end(path, match.end(), sep)
    return f"{index}{sep}{path}" if c < 0 else f"{path[:c]}{sep}{index}{path[c:]}"


def take_index(path: str, match: re.Match) -> tuple[str, str] | None:
    """``(path without the component after the match, that component)``; None when none follows.

    >>> take_index("params/layers/3/attn/q", re.search("layers", "params/layers/3/attn/q"))
    ('params/layers/attn/q', '3')
    """
    sep = _sep(path)
    c = _component_end(path, match.end(), sep)
    start = c + 1
    if start >= len(path):
        return None
    j = path.find(sep, start)
    stop = len(path) if j < 0 else j
    rest = path[:c] + path[stop:] if c >= 0 else path[stop + 1 :]
    return rest, path[start:stop]


class _Planner:
    def __init__(self, rules: Rules, num_layers: int | None, targets: Collection[str] | None):
        self.rules = rules
        self.num_layers = num_layers
        self.targets = None if targets is None else set(targets)
        self.problems: list[str] = []
        self.unmatched: dict[tuple[str, str], str] = {}  # recorded even when allow_unmatched lets them pass

    def check(self) -> None:
        if self.problems:
            raise RulesError(self.problems)

    def first_match(self, field: str, paths: Sequence[str], where: str) -> list[int | None]:
        """For each path the index of the first ``field`` pattern that matches it; unmatched patterns are problems."""
        patterns = self.rules._compiled[field]
        matched = [False] * len(patterns)
        firsts: list[int | None] = []
        for path in paths:
            first = None
            for k, pat in enumerate(patterns):
                if (first is None or not matched[k]) and pat.search(path):
                    matched[k] = True
                    first = k if first is None else first
            firsts.append(first)
        for pat, ok in zip(patterns, matched):
            if not ok:
                message = (f"`{field}` pattern {pat.pattern!r} matches no leaf ({where}); nearby paths: "
                           f"{nearby(pat.pattern, list(paths))}. Fix the pattern, drop it, or pass allow_unmatched=True.")
                self.unmatched[(field, pat.pattern)] = message
                if not self.rules.allow_unmatched:
                    self.problems.append(message)
        return firsts

    def run(self, leaves: list[tuple[str, Shape | None, Any]]) -> RulesPlan:
        nodes = [TargetLeaf(p, s, d, (Piece(p),), s, d) for p, s, d in leaves]
        nodes, dropped = self.keep_drop(nodes)
        self.check()
        nodes = self.unstack(nodes)
        self.check()
        nodes = self.rename(nodes)
        self.check()
        nodes = self.stack(nodes)
        self.check()
        nodes = self.cast(self.transpose(nodes))
        self.check()
        return RulesPlan(tuple(nodes), tuple(dropped), tuple(self.unmatched.items()))

    def keep_drop(self, nodes: list[TargetLeaf]) -> tuple[list[TargetLeaf], list[str]]:
        paths = [n.path for n in nodes]
        keep = self.first_match("keep", paths, "checkpoint paths") if self.rules.keep else [0] * len(paths)
        drop = self.first_match("drop", paths, "checkpoint paths")
        kept = [n for n, k, d in zip(nodes, keep, drop) if k is not None and d is None]
        return kept, [n.path for n, k, d in zip(nodes, keep, drop) if not (k is not None and d is None)]

    def unstack(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        firsts = self.first_match("unstack", [n.path for n in nodes], "checkpoint paths after keep/drop")
        out = []
        for node, k in zip(nodes, firsts):
            if k is None:
                out.append(node)
                continue
            pat = self.rules._compiled["unstack"][k]
            shape = node.shape
            fix = "narrow the pattern so that it matches only stacked (scanned) leaves"
            if shape is None or not shape or shape[0] == 0:
                what = "is not an array" if shape is None else f"has shape {shape}, no leading layer axis"
                self.problems.append(f"`unstack` pattern {pat.pattern!r} matches `{node.path}`, which {what}; {fix}.")
                continue
            if self.num_layers is not None and shape[0] != self.num_layers:
                self.problems.append(
                    f"`unstack` pattern {pat.pattern!r}: `{node.path}` has shape {shape}, whose leading axis is "
                    f"not the {self.num_layers} layers expected; {fix}, or fix num_layers."
                )
                continue
            match = pat.search(node.path)
            self.check_target_layers(node, match, shape)
            for i in range(shape[0]):
                out.append(dataclasses.replace(
                    node, path=insert_index(node.path, match, i), pieces=(Piece(node.path, i),), shape=shape[1:]
                ))
        return out

    def check_target_layers(self, node: TargetLeaf, match: re.Match, shape: Shape) -> None:
        """With ``targets``: the layers of an unstacked leaf that the target names must be 0 .. L-1."""
        if self.targets is None:
            return
        named = 0
        try:
            while named <= len(self.targets) and self.renamed(insert_index(node.path, match, named)) in self.targets:
                named += 1
        except (re.error, IndexError):
            return  # a bad replacement: the rename stage names it
        if named and named != shape[0]:
            first, last = (self.renamed(insert_index(node.path, match, i)) for i in (0, named - 1))
            self.problems.append(
                f"`unstack`: `{node.path}` has shape {shape}, {shape[0]} layers, but the target has {named} "
                f"(`{first}` .. `{last}`); restore a checkpoint with as many layers or fix the target's layer count."
            )

    def renamed(self, path: str) -> str:
        for pat, (_, repl) in zip(self.rules._compiled["rename"], self.rules.rename):
            if pat.search(path):
                return pat.sub(repl, path)
        return path

    def rename(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        where = "paths after keep/drop and unstack" if self.rules.unstack else "checkpoint paths after keep/drop"
        firsts = self.first_match("rename", [n.path for n in nodes], where)
        failed: set[int] = set()  # a bad replacement is said once, on the first path it fails on
        out = []
        for node, k in zip(nodes, firsts):
            out.append(node)
            if k is None or k in failed:
                continue
            pattern, repl = self.rules.rename[k]
            try:
                out[-1] = dataclasses.replace(node, path=self.rules._compiled["rename"][k].sub(repl, node.path))
            except (re.error, IndexError) as e:
                failed.add(k)
                self.problems.append(
                    f"`rename` rule ({pattern!r}, {repl!r}) fails on `{node.path}`: {e}; fix the replacement "
                    r"(groups are \1 or \g<name>)."
                )
        self.check_collisions(out, "rename")
        return out

    def check_collisions(self, nodes: Sequence[TargetLeaf], stage: str) -> None:
        by_path: dict[str, list[TargetLeaf]] = {}
        for node in nodes:
            by_path.setdefault(node.path, []).append(node)
        for path, group in by_path.items():
            if len(group) > 1:
                names = [f"`{_pieces_text(n.pieces, n.stacked)}`" for n in group]
                both = "both" if len(names) == 2 else "all"
                self.problems.append(
                    f"{', '.join(names[:-1])} and {names[-1]} {both} become `{path}` after {stage}; fix the "
                    f"`{stage}` rules so that each leaf gets its own path, or drop all but one of them."
                )

    def stack(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        firsts = self.first_match("stack", [n.path for n in nodes], "paths after rename")
        groups: dict[str, list[tuple[int, TargetLeaf]]] = {}
        slots: list[TargetLeaf | str] = []  # leaves no stack takes, and each stack's path where its first layer was
        for node, k in zip(nodes, firsts):
            if k is None:
                slots.append(node)
                continue
            pat = self.rules._compiled["stack"][k]
            taken = take_index(node.path, pat.search(node.path))
            if taken is None or not (taken[1].isascii() and taken[1].isdecimal()) or not taken[0]:
                after = "nothing" if taken is None else f"`{taken[1]}`"
                self.problems.append(
                    f"`stack` pattern {pat.pattern!r} matches `{node.path}`, but {after} follows the match "
                    "where a layer index belongs; end the pattern just before the layer index (e.g. 'layers/')."
                )
                continue
            if node.shape is None:
                self.problems.append(f"`stack` pattern {pat.pattern!r} matches `{node.path}`, which is not an array.")
                continue
            if taken[0] not in groups:
                groups[taken[0]] = []
                slots.append(taken[0])
            groups[taken[0]].append((int(taken[1]), node))
        out = []
        for slot in slots:
            out.append(self.stack_group(slot, groups[slot]) if isinstance(slot, str) else slot)
        self.check_collisions(out, "stack")
        return out

    def stack_group(self, path: str, members: list[tuple[int, TargetLeaf]]) -> TargetLeaf:
        members.sort(key=lambda m: m[0])
        indices = [i for i, _ in members]
        first = members[0][1]
        names = ", ".join(f"`{n.path}`" for _, n in members[:3]) + (" ..." if len(members) > 3 else "")
        if indices != list(range(len(indices))):
            missing = sorted(set(range(max(indices) + 1)) - set(indices))
            twice = sorted({i for i in indices if indices.count(i) > 1})
            what = "; ".join([f"missing {missing}"] * bool(missing) + [f"given twice {twice}"] * bool(twice))
            self.problems.append(
                f"`stack` into `{path}`: layers {indices} from {names} are not 0 .. {len(indices) - 1} ({what}); "
                "every layer from 0 up must be present once."
            )
        odd = [n for _, n in members if (n.shape, str(n.dtype)) != (first.shape, str(first.dtype))]
        if odd:
            each = "; ".join(f"`{n.path}` {n.shape} {_dtype_text(n.dtype)}" for n in [first, *odd])
            self.problems.append(
                f"`stack` into `{path}`: the layers differ in shape or dtype ({each}); only like layers stack."
            )
        if self.num_layers is not None and len(members) != self.num_layers:
            self.problems.append(
                f"`stack` into `{path}`: {len(members)} layers ({names}), not the {self.num_layers} expected."
            )
        return TargetLeaf(path, (len(members), *first.shape), first.dtype, tuple(n.pieces[0] for _, n in members),
                          first.source_shape, first.source_dtype, stacked=True)

    def transpose(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        firsts = self.first_match("transpose", [n.path for n in nodes], "target paths, after rename and stack")
        out = []
        for node, k in zip(nodes, firsts):
            out.append(node)
            if k is None:
                continue
            pattern, axes = self.rules.transpose[k]
            rank = None if node.shape is None else len(node.shape)
            if rank is None or not (
                len(axes) == rank and all(-rank <= a < rank for a in axes) and len({a % rank for a in axes}) == rank
            ):
                what = "not an array" if rank is None else f"shape {node.shape}, rank {rank}"
                self.problems.append(
                    f"`transpose` rule ({pattern!r}, {axes}) does not fit `{node.path}` ({what}); give a "
                    "permutation of 0 .. rank-1, or narrow the pattern."
                )
                continue
            axes = tuple(a % rank for a in axes)
            if axes != tuple(range(rank)):
                out[-1] = dataclasses.replace(node, axes=axes, shape=tuple(node.shape[a] for a in axes))
        return out

    def cast(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        firsts = self.first_match("cast", [n.path for n in nodes], "target paths, after rename and stack")
        # The kinds each cast rule applies to: a kind change is only for a rule written for that kind.
        kinds_of: dict[int, dict[str | None, str]] = {}
        for node, k in zip(nodes, firsts):
            if k is not None and node.shape is not None:
                kinds_of.setdefault(k, {}).setdefault(_node_kind(node), node.path)
        out = []
        for node, k in zip(nodes, firsts):
            target = None if node.shape is None else self.cast_to(node, k, kinds_of.get(k, {}))
            out.append(node if target is None or target == node.dtype else
                       dataclasses.replace(node, dtype=target, cast=target))
        return out

    def cast_to(self, node: TargetLeaf, k: int | None, kinds: dict[str | None, str]) -> np.dtype | None:
        """The dtype cast rule ``k`` (or ``dtype=``, for None) gives an array leaf; None for none."""
        kind = _node_kind(node)
        if k is None:
            return resolve_dtype(self.rules.dtype) if self.rules.dtype and kind == "floating" else None
        pattern, target = self.rules.cast[k][0], resolve_dtype(self.rules.cast[k][1])
        if kind is None:
            self.problems.append(
                f"`cast` rule {pattern!r} -> {target.name} matches `{node.path}` of dtype "
                f"{_dtype_text(node.dtype)}, which does not cast; narrow the pattern."
            )
            return None
        others = [(kd, p) for kd, p in kinds.items() if kd != kind]
        if _kind(target) != kind and others:
            self.problems.append(
                f"`cast` rule {pattern!r} -> {target.name} would turn {kind} `{node.path}` "
                f"({_dtype_text(node.dtype)}) into {_kind(target)}, but the rule also applies to {others[0][0]} "
                f"`{others[0][1]}`; a kind change needs a rule for leaves of that kind only: narrow the pattern or "
                "put a rule for this leaf first (`dtype=` casts floating leaves only)."
            )
            return None
        return target


def _node_kind(node: TargetLeaf) -> str | None:
    return _kind(node.dtype) if isinstance(node.dtype, np.dtype) else None


# ---------------------------------------------------------------------------------------------- blocks


def _full_index(index: Any, shape: Shape) -> Index:
    if index is None:
        index = ()
    elif not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        raise TypeError(f"a block index is a tuple of at most {len(shape)} slices, got {index!r}.")
    return tuple(index) + (slice(None),) * (len(shape) - len(index))


class TargetReader:
    """Reads blocks of one target leaf from blocks of its source(s); numpy only.

    ``shape``, ``dtype`` and ``read(index)`` make it an array reader other
    layers can wrap. ``read`` reads exactly the source blocks the target
    block needs: an unstacked layer ``i`` reads ``(slice(i, i + 1), *index)``
    of its source; a transpose reads the permuted index and transposes; a
    stack reads the same block of each layer the leading slice covers. The
    cast is ``astype`` (bit-exact for a widening cast, numpy's (ml_dtypes')
    round-to-nearest-even for a narrowing one; a complex -> real cast keeps
    the real part).

    Args:
      leaf: a ``TargetLeaf`` of an array.
      read_source: ``read_source(source_path, index) -> array`` for a tuple of slices.

    >>> src = {"layers/w": np.arange(24.0).reshape(2, 3, 4)}
    >>> plan = Rules(unstack=["layers"], transpose=[("w$", (1, 0))]).plan(src)
    >>> reader = TargetReader(plan["layers/1/w"], lambda path, index: src[path][index])
    >>> reader.shape, np.array_equal(reader.read((slice(1, 3),)), src["layers/w"][1].T[1:3])
    ((4, 3), True)
    """

    def __init__(self, leaf: TargetLeaf, read_source: ReadSource):
        if leaf.shape is None:
            raise TypeError(f"`{leaf.path}` is not an array (from `{leaf.source}`); its value passes through as is.")
        self.leaf = leaf
        self.shape: Shape = leaf.shape
        self.dtype: np.dtype = leaf.dtype
        self._read_source = read_source
        inverse = None if leaf.axes is None else tuple(np.argsort(leaf.axes))
        # The leaf before the transpose: target axis j is its axis axes[j].
        self._pre_shape = leaf.shape if inverse is None else tuple(leaf.shape[i] for i in inverse)

    def read(self, index: Index | None = None) -> np.ndarray:
        """The block ``index`` (a tuple of slices; missing trailing axes are whole) of the target leaf."""
        leaf = self.leaf
        index = _full_index(index, self.shape)
        pre = index
        if leaf.axes is not None:
            listed: list[slice] = [slice(None)] * len(index)
            for j, a in enumerate(leaf.axes):
                listed[a] = index[j]
            pre = tuple(listed)
        if leaf.stacked:
            layers = range(len(leaf.pieces))[pre[0]]
            blocks = [self._piece(leaf.pieces[i], pre[1:]) for i in layers]
            if blocks:
                block = np.stack(blocks)
            else:
                inner = tuple(len(range(n)[s]) for n, s in zip(self._pre_shape[1:], pre[1:]))
                block = np.empty((0, *inner), leaf.source_dtype)
        else:
            block = self._piece(leaf.pieces[0], pre)
        if leaf.axes is not None:
            block = block.transpose(leaf.axes)
        if leaf.cast is not None:
            if block.dtype.kind == "c" and leaf.cast.kind != "c":
                block = block.real
            block = block.astype(leaf.cast)
        return block

    def _piece(self, piece: Piece, index: Index) -> np.ndarray:
        if piece.layer is None:
            return np.asarray(self._read_source(piece.path, index))
        return np.asarray(self._read_source(piece.path, (slice(piece.layer, piece.layer + 1), *index)))[0]

    def __repr__(self) -> str:
        return f"TargetReader({self.leaf.path!r}, shape={self.shape}, dtype={self.dtype})"
