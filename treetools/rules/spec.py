"""The rules spec: ``Rules``, its one field table, and the forms it is written in (Python, JSON/TOML, CLI flags).

Every field of ``Rules`` is one row of the field table (its ``dataclasses``
field's metadata, a ``RuleField``): its kind (how a value is checked, merged,
written as JSON and read from its command-line flag), what it means and the
paths its patterns see (docs/rules.md's table is ``fields_markdown()``), and
its flag's metavar and help (``treetools.cli.options.add_rules`` builds the
rules flags from ``FIELDS``). A new rule is a row here (its value's kind,
and for a structured value its spec in ``treetools.rules.ops``), its stage in
the planner (``treetools.rules.plan``, ``treetools.rules.stages``), and, when
it changes data, its step in ``treetools.rules.blocks``, which the block
reader (``treetools.checkpoint_io.mapping.RuledReader``) reads through.

Standard library only at import: the CLI builds its flags from this table
before numpy loads. A dtype name is resolved (numpy, ml_dtypes) when a
``Rules`` naming one is made, and ``plan`` loads the planner.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Mapping, Sequence

from treetools.rules.ops import (
    check_concat,
    check_pad,
    check_permute,
    check_reshape,
    check_scale,
    check_slice,
    check_split,
    check_tie,
    parse_concat,
    parse_pad,
    parse_permute,
    parse_reshape,
    parse_scale,
    parse_slice,
    parse_split,
    parse_tie,
)
from treetools.shared.patterns import compile_patterns

if TYPE_CHECKING:  # annotations only: the planner imports numpy
    from treetools.rules.plan import RuleRow, RulesPlan

# ---------------------------------------------------------------------------------------------- values


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


def _pairs(value: Any, field: str) -> list[tuple[str, Any]]:
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


def _dtype_name(dtype: Any, name: str, *, floating: bool = False) -> str:
    """A dtype's numpy (or ml_dtypes) name; with ``floating``, only a floating one (``dtype=``)."""
    # Here, not at the top: numpy. `treetools COMMAND --help` builds the rules flags from this module's table.
    from treetools.rules.dtypes import kind, resolve_dtype

    out = resolve_dtype(dtype, name=name)
    if floating and kind(out) != "floating":
        raise ValueError(
            f"`dtype` {out.name!r} is not a floating dtype: `dtype` casts the floating leaves only; "
            f"use cast={{pattern: {out.name!r}}} for the leaves you mean."
        )
    return out.name


def _replacement(pattern: str, repl: Any) -> str:
    if not isinstance(repl, str):
        raise TypeError(f"`rename` replacement for {pattern!r} must be a string, got {repl!r}.")
    return repl


def _cast_dtype(pattern: str, dtype: Any) -> str:
    return _dtype_name(dtype, f"cast[{pattern!r}]")


def _axes(pattern: str, value: Any) -> tuple[int, ...]:
    # numbers.Integral: Python and numpy integers (numpy registers its own), never bool
    if isinstance(value, str) or not all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in value):
        raise TypeError(f"`transpose` axes must be a sequence of integers such as (1, 0), got {value!r}.")
    return tuple(int(a) for a in value)


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


# ---------------------------------------------------------------------------------------------- field kinds


class Patterns:
    """A list of regexes (``[pattern, ...]``, or one pattern); ``merge`` puts the later ones after them."""

    flag = "repeat"
    changes = True

    def python(self, name: str) -> str:
        return f"{name}=[pattern, ...]"

    def normalize(self, value: Any, name: str) -> tuple[str, ...]:
        return _patterns(value, name)

    def patterns(self, value: tuple[str, ...]) -> list[str]:
        return list(value)

    def merge(self, first: tuple[str, ...], later: tuple[str, ...]) -> tuple[str, ...]:
        return first + later

    def to_json(self, value: tuple[str, ...]) -> list[str]:
        return list(value)

    def from_flags(self, given: Iterable[str]) -> tuple[str, ...]:
        return tuple(given)


class LayerPatterns(Patterns):
    """``unstack``'s patterns: each a regex (the layer axis is 0) or ``(pattern, axis)`` for another layer axis
    (MaxText keeps its scanned layers on axis 1); ``'RE=>axis=A'`` on the command line."""

    def python(self, name: str) -> str:
        return f"{name}=[pattern or (pattern, axis), ...]"

    def normalize(self, value: Any, name: str) -> tuple[Any, ...]:
        if value is None:
            return ()
        if isinstance(value, (str, re.Pattern)):
            value = [value]
        out: list[Any] = []
        for v in value:
            if isinstance(v, (list, tuple)):
                if len(v) != 2 or isinstance(v[1], bool) or not isinstance(v[1], numbers.Integral) or v[1] < 0:
                    raise TypeError(f"`{name}` takes patterns or (pattern, axis) pairs with an axis >= 0, got {v!r}.")
                out.append(_pattern(v[0], name) if v[1] == 0 else (_pattern(v[0], name), int(v[1])))
            else:
                out.append(_pattern(v, name))
        return tuple(out)

    def patterns(self, value: tuple[Any, ...]) -> list[str]:
        return [v[0] if isinstance(v, tuple) else v for v in value]

    def to_json(self, value: tuple[Any, ...]) -> list[Any]:
        return [list(v) if isinstance(v, tuple) else v for v in value]

    def from_flags(self, given: Iterable[str]) -> tuple[Any, ...]:
        out: list[str | tuple[str, int]] = []
        for text in given:
            pattern, arrow, rest = text.partition("=>")
            if not arrow:
                out.append(text)
                continue
            key, _, axis = rest.strip().partition("=")
            if key != "axis" or not axis.isdecimal() or "=>" in rest:
                raise ValueError(f"`--unstack` {text!r}: write RE, or RE=>axis=A for a layer axis other than 0.")
            out.append((pattern, int(axis)))
        return self.normalize(out, "unstack")


@dataclasses.dataclass(frozen=True)
class Pairs:
    """``[(pattern, value), ...]`` or ``{pattern: value}``, in order (the first matching rule wins).

    ``check(pattern, value)`` gives one value as stored (or raises naming it);
    ``parse(text)`` reads one flag string into a pair. In ``merge``, a later
    rule with the very pattern of an earlier one replaces its value in place
    (a flag overrides one rule of a file). ``mapping``: the JSON form is a
    ``{pattern: value}`` object rather than a list of pairs.
    """

    value: str
    check: Callable[[str, Any], Any]
    parse: Callable[[str], tuple[str, Any]]
    mapping: bool = False
    flag = "repeat"
    changes = True

    def python(self, name: str) -> str:
        return f"{name}={{pattern: {self.value}}}" if self.mapping else f"{name}=[(pattern, {self.value}), ...]"

    def normalize(self, value: Any, name: str) -> tuple[tuple[str, Any], ...]:
        return tuple((p, self.check(p, v)) for p, v in _pairs(value, name))

    def patterns(self, value: tuple[tuple[str, Any], ...]) -> list[str]:
        return [p for p, _ in value]

    def merge(self, first: tuple, later: tuple) -> tuple:
        table = dict(first)
        table.update(later)
        return tuple(table.items())

    def to_json(self, value: tuple[tuple[str, Any], ...]) -> Any:
        if self.mapping:
            return dict(value)
        return [[p, v.to_json() if hasattr(v, "to_json") else list(v) if isinstance(v, tuple) else v]
                for p, v in value]

    def from_flags(self, given: Iterable[str]) -> list[tuple[str, Any]]:
        return [self.parse(text) for text in given]


class FloatingDtype:
    """One floating dtype (stored as its name), or None; a later one replaces an earlier one in ``merge``."""

    flag = "one"
    changes = True

    def python(self, name: str) -> str:
        return f"{name}=DTYPE"

    def normalize(self, value: Any, name: str) -> str | None:
        return None if value is None else _dtype_name(value, name, floating=True)

    def patterns(self, value: Any) -> list[str]:
        return []

    def merge(self, first: str | None, later: str | None) -> str | None:
        return later if later is not None else first

    def to_json(self, value: str) -> str:
        return value

    def from_flags(self, given: str | None) -> str | None:
        return given


class Switch:
    """A yes/no setting that changes no leaf (``allow_unmatched``); either side's yes in ``merge``."""

    flag = "switch"
    changes = False

    def python(self, name: str) -> str:
        return f"{name}=True"

    def normalize(self, value: Any, name: str) -> bool:
        return bool(value)

    def patterns(self, value: Any) -> list[str]:
        return []

    def merge(self, first: bool, later: bool) -> bool:
        return first or later

    def to_json(self, value: bool) -> bool:
        return value

    def from_flags(self, given: Any) -> bool:
        return bool(given)


@dataclasses.dataclass(frozen=True)
class RuleField:
    """One row of the field table: a ``Rules`` field's kind, its documentation and its command-line flag.

    Attributes:
      kind: ``Patterns()``, ``Pairs(...)``, ``FloatingDtype()`` or ``Switch()``: how values are read and merged.
      meaning: what the field does (docs/rules.md, markdown).
      matched: the paths its patterns are matched against (docs/rules.md; "" for none).
      help: the flag's ``--help`` line.
      metavar: the flag's value as ``--help`` shows it (``RE``, ``'RE=>REPL'``); None for a switch.
      syntax: how the flag's value is read, where there is more to say than the metavar (docs/rules.md).
    """

    kind: Patterns | LayerPatterns | Pairs | FloatingDtype | Switch
    meaning: str
    matched: str
    help: str
    metavar: str | None = None
    syntax: str = ""

    def flag(self, name: str) -> str:
        """The command-line flag of field ``name``: ``--allow-unmatched`` for ``allow_unmatched``."""
        return "--" + name.replace("_", "-")


def _rule(kind: Any, *, default: Any = (), **text: Any) -> Any:
    return dataclasses.field(default=default, metadata={"rule": RuleField(kind, **text)})


_PATTERNS = Patterns()

# ---------------------------------------------------------------------------------------------- Rules


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
    except RecursionError:  # both parsers recurse once a level
        raise ValueError(f"{what} {path} is nested too deeply to parse as {suffix[1:].upper()}; no rules file nests "
                         "more than a few levels.") from None


@dataclasses.dataclass(frozen=True, repr=False, kw_only=True)
class Rules:
    """How a checkpoint's leaves become the leaves a user wants (``treetools.rules``, docs/rules.md).

    Every field is optional and keyword-only; each is described where it is
    defined below, a row of the one field table. Sequences are stored as
    tuples and dtypes as their names, so two ``Rules`` written differently (a
    dict or a list of pairs, ``np.float16`` or ``"float16"``) compare equal,
    hash, and round-trip through ``to_dict``/``from_dict`` and files.

    Raises:
      PatternError: a pattern is not a valid regex (the message names the field).
      ValueError: a dtype name is unknown, or ``dtype`` is not a floating dtype.
      TypeError: a value of the wrong shape (a pair that is not a pair, axes that are not integers).

    >>> import numpy as np
    >>> Rules(drop="opt_state", cast={"kernel$": np.float16})
    Rules(drop=('opt_state',), cast=(('kernel$', 'float16'),))
    >>> Rules.from_dict({"drop": ["opt_state"], "cast": [["kernel$", "float16"]]}) == _
    True
    """

    rename: Sequence[tuple[str, str]] | Mapping[str, str] = _rule(
        Pairs("replacement", _replacement, parse_rename),
        meaning="`re.sub(pattern, replacement, path)`; the first rule whose pattern matches a path wins (T5X's "
                "`assignment_map`)",
        matched="paths after unstack",
        metavar="'RE=>REPL'", help="re.sub on the paths (after unstack); first match wins",
        syntax="exactly one `=>` (a pattern or replacement holding `=>` goes in a rules file)")
    drop: Sequence[str] = _rule(
        _PATTERNS, meaning="leave out the source leaves a pattern matches", matched="checkpoint paths",
        metavar="RE", help="leave out the leaves RE matches")
    keep: Sequence[str] = _rule(
        _PATTERNS, meaning="use only the source leaves some pattern matches", matched="checkpoint paths",
        metavar="RE", help="keep only the leaves some RE matches")
    cast: Mapping[str, Any] | Sequence[tuple[str, Any]] = _rule(
        Pairs("dtype", _cast_dtype, parse_cast, mapping=True),
        meaning="change the dtype; first match wins", matched="target paths",
        metavar="'RE=DTYPE'", help="cast the leaves RE matches (after rename)",
        syntax="split at the last `=` (a pattern may hold `=`, as in `(?=...)`)")
    dtype: Any = _rule(
        FloatingDtype(), default=None,
        meaning="cast every other **floating** leaf (a floating dtype)", matched="target paths",
        metavar="DTYPE", help="cast every floating leaf (bfloat16, float16, float32...)")
    transpose: Sequence[tuple[str, Sequence[int]]] | Mapping[str, Sequence[int]] = _rule(
        Pairs("axes", _axes, parse_transpose),
        meaning="`numpy.transpose(leaf, axes)`; first match wins", matched="target paths",
        metavar="'RE=AXES'", help="transpose the leaves RE matches, axes comma-separated: 'kernel$=1,0'",
        syntax="axes comma-separated (`'kernel$=0,2,1'`), split at the last `=`")
    unstack: Sequence[str | tuple[str, int]] = _rule(
        LayerPatterns(),
        meaning="split a stacked (scanned) leaf of shape `(L, ...)` into `L` leaves of shape `(...)`; "
                "`(pattern, axis)` when the layers are another axis (`(d, L, ...)` is axis 1)",
        matched="checkpoint paths (after keep/drop)",
        metavar="RE", help="split a stacked (scanned) leaf of shape (L, ...) into L leaves: "
                           "layers/attn/q -> layers/0/attn/q ...; 'RE=>axis=1' for layers on axis 1",
        syntax="`'RE=>axis=A'` for a layer axis other than 0")
    stack: Sequence[str] = _rule(
        _PATTERNS, meaning="the inverse of unstack: per-layer leaves become one leaf with a new axis 0",
        matched="paths after rename", metavar="RE", help="the inverse of --unstack")
    split: Sequence[tuple[str, Any]] | Mapping[str, Any] = _rule(
        Pairs("{names: [name, ...], axis: A, sizes: [n, ...]}", check_split, parse_split),
        meaning="one leaf becomes several: consecutive pieces along `axis`, each named "
                "`re.sub(pattern, name, path)`; `sizes` (one may be -1, the rest) or equal pieces",
        matched="paths after unstack", metavar="'RE=>names=N1,N2,... axis=A [sizes=S1,S2,...]'",
        help="split a fused leaf along an axis into named pieces: 'c_attn\\.weight$=>names=q.weight,k.weight,"
             "v.weight axis=1'",
        syntax="exactly one `=>`, then space-separated `key=value` items, lists comma-separated")
    concat: Sequence[tuple[str, Any]] | Mapping[str, Any] = _rule(
        Pairs("{name: name, axis: A, parts: [part, ...]}", check_concat, parse_concat),
        meaning="the inverse of split: the leaves whose `re.sub(pattern, name, path)` agree become one, joined "
                "along `axis` in the order of `parts`, the values of the pattern's group `(?P<part>...)`",
        matched="paths after stack", metavar="'RE=>name=NAME axis=A parts=P1,P2,...'",
        help="join leaves along an axis, in the order of their (?P<part>...) group: "
             "'\\.(?P<part>gate|up)_proj\\.weight$=>name=.gate_up_proj.weight axis=0 parts=gate,up'",
        syntax="as `--split`")
    reshape: Sequence[tuple[str, Any]] | Mapping[str, Any] = _rule(
        Pairs("{axis: A, into: [n, ...]} | {merge: [A, B]} | shape", check_reshape, parse_reshape),
        meaning="split or merge axes (`numpy.reshape`): `axis` becomes the axes `into` (one -1: the rest), or the "
                "axes `merge[0] .. merge[1]` become one, or the leaf takes `shape` (0: its size at that position, "
                "one -1: the rest)",
        matched="target paths", metavar="'RE=>axis=A into=S1,S2' | 'RE=>merge=A,B' | 'RE=SHAPE'",
        help="split or merge axes: 'q_proj\\.weight$=>axis=0 into=-1,64' ([H*D, d] -> [H, D, d]), "
             "'kernel$=>merge=1,2' ([d, H, D] -> [d, H*D]), or a shape 'w$=0,-1'",
        syntax="as `--split`, or a shape: sizes comma-separated, split at the last `=`")
    permute: Sequence[tuple[str, Any]] | Mapping[str, Any] = _rule(
        Pairs("{axis: A, head_dim: D, to: half|interleaved, rotary_dim: R}", check_permute, parse_permute),
        meaning="rotary layouts: along `axis` (whole heads of `head_dim`), each head's first `rotary_dim` (all) "
                "entries reordered `to` `interleaved` (pairs `2i, 2i+1`) from `half` (pairs `i, i+R/2`, Hugging "
                "Face's), or back",
        matched="target paths", metavar="'RE=>axis=A head_dim=D to=half|interleaved [rotary_dim=R]'",
        help="reorder each head's rotary entries along an axis: 'q_proj\\.weight$=>axis=0 head_dim=128 "
             "to=interleaved'",
        syntax="as `--split`")
    slice: Sequence[tuple[str, Any]] | Mapping[str, Any] = _rule(
        Pairs("{axis: A, stop: N, start: 0}", check_slice, parse_slice),
        meaning="keep entries `start .. stop-1` along `axis` (a vocabulary shrunk)",
        matched="target paths", metavar="'RE=>axis=A stop=N [start=M]'",
        help="keep entries start..stop-1 along an axis: 'embed_tokens\\.weight$=>axis=0 stop=32000'",
        syntax="as `--split`")
    pad: Sequence[tuple[str, Any]] | Mapping[str, Any] = _rule(
        Pairs("{axis: A, size: N, init: zeros|normal|uniform, ...}", check_pad, parse_pad),
        meaning="grow `axis` to `size` entries at its end: zeros, or `numpy.random.default_rng(seed)`'s "
                "`normal(mean, stddev)` / `uniform(low, high)` drawn over the whole new region",
        matched="target paths", metavar="'RE=>axis=A size=N [init=normal stddev=S seed=K]'",
        help="grow an axis at its end (a vocabulary resized): 'embed$=>axis=0 size=32128 init=normal "
             "stddev=0.02 seed=0'; new entries zero by default",
        syntax="as `--split`")
    tie: Sequence[tuple[str, Any]] | Mapping[str, Any] = _rule(
        Pairs("{name: name, axes: [1, 0]}", check_tie, parse_tie),
        meaning="one more leaf, `re.sub(pattern, name, path)`, holding the matched leaf's values, transposed "
                "by `axes` when given (`lm_head` written as the embedding)",
        matched="target paths", metavar="'RE=>name=NAME [axes=1,0]'",
        help="write a leaf again under another name, transposed or not: "
             "'^embed/embedding$=>name=lm_head/kernel axes=1,0'",
        syntax="as `--split`")
    scale: Sequence[tuple[str, Any]] | Mapping[str, Any] = _rule(
        Pairs("factor", check_scale, parse_scale),
        meaning="multiply a **floating** leaf by a constant: a number, `'sqrt(N)'` or `'1/sqrt(N)'` (parsed, never "
                "evaluated), in float64, rounded once to the leaf's dtype (its `cast`'s, when it has one); first "
                "match wins",
        matched="target paths, after tie", metavar="'RE=FACTOR'",
        help="multiply the floating leaves RE matches by a factor: a number, sqrt(N) or 1/sqrt(N), e.g. "
             "'query/kernel$=1/sqrt(128)'",
        syntax="split at the last `=`")
    allow_unmatched: bool = _rule(
        Switch(), default=False, meaning="a pattern that matches nothing is ignored instead of an error",
        matched="", help="a rule that matches no leaf is ignored instead of an error")
    _compiled: dict[str, list[re.Pattern]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name, field in FIELDS.items():
            object.__setattr__(self, name, field.kind.normalize(getattr(self, name), name))
        for name, field in FIELDS.items():
            self._compiled[name] = compile_patterns(field.kind.patterns(getattr(self, name)), name=name)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in FIELDS if getattr(self, k))
        return f"Rules({fields})"

    @property
    def empty(self) -> bool:
        """True when the rules change nothing (every leaf maps onto itself).

        >>> Rules().empty, Rules(dtype="bfloat16").empty
        (True, False)
        """
        return not any(getattr(self, k) for k, field in FIELDS.items() if field.kind.changes)

    def compiled(self, field: str) -> list[re.Pattern]:
        """The compiled patterns of one field, in order (the planner matches with them).

        >>> [p.pattern for p in Rules(rename={"^a/": "b/"}).compiled("rename")]
        ['^a/']
        """
        return self._compiled[field]

    # -------------------------------------------------------------------------------------- as data

    def to_dict(self) -> dict[str, Any]:
        """The non-empty fields as JSON-ready values (lists, a ``cast`` mapping); ``from_dict`` reads it back.

        >>> Rules(rename=[("^a/", "b/")], transpose={"w$": (1, 0)}).to_dict()
        {'rename': [['^a/', 'b/']], 'transpose': [['w$', [1, 0]]]}
        """
        return {k: field.kind.to_json(getattr(self, k)) for k, field in FIELDS.items() if getattr(self, k)}

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
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown rules field(s) {unknown}; the fields are {list(FIELDS)}.")
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
    def from_cli(cls, *, rules_file: str | os.PathLike | None = None, **flags: Any) -> Rules:
        """Rules from command-line strings: ``--rules FILE`` first, then the flags after its rules.

        Args:
          rules_file: ``--rules``, a JSON or TOML file (``from_file``).
          **flags: each field's flag values by field name: ``rename=['PATTERN=>REPLACEMENT', ...]``
            (``parse_rename``), ``cast=['PATTERN=DTYPE', ...]`` (``parse_cast``),
            ``transpose=['PATTERN=AXES', ...]`` such as ``'weight$=1,0'`` (``parse_transpose``);
            ``drop``, ``keep``, ``unstack``, ``stack``: patterns as given; ``dtype``: one name
            (it replaces the file's); ``allow_unmatched``: ``--allow-unmatched``.

        Raises:
          TypeError: a keyword that is not a field name.

        >>> Rules.from_cli(rename=[r"^params/(.*)=>\\1"], transpose=["kernel$=1,0"], dtype="bfloat16")
        Rules(rename=(('^params/(.*)', '\\\\1'),), dtype='bfloat16', transpose=(('kernel$', (1, 0)),))
        """
        unknown = sorted(set(flags) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown rules flag(s) {unknown}; the fields are {list(FIELDS)}.")
        parsed: dict[str, Any] = {k: FIELDS[k].kind.from_flags(v) for k, v in flags.items()}
        given = cls(**parsed)
        return given if rules_file is None else cls.from_file(rules_file).merge(given)

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
        merged: dict[str, Any] = {k: field.kind.merge(getattr(self, k), getattr(later, k))
                                  for k, field in FIELDS.items()}
        return Rules(**merged)

    # -------------------------------------------------------------------------------------- planning

    def plan(
        self,
        leaves: Mapping[str, Any] | Iterable[str | tuple[str, Sequence[int] | None, Any]],
        *,
        num_layers: int | None = None,
        targets: Collection[str] | None = None,
    ) -> RulesPlan:
        """What every target leaf is and how it is made, from metadata only (``treetools.rules.plan``).

        Args:
          leaves: the source leaves: ``(path, shape, dtype)`` triples
            (``shape`` None for a non-array value), or a ``{path: leaf}``
            mapping whose array leaves have ``shape`` and ``dtype`` (a
            ``tt.flatten`` of arrays or ``ShapeDtypeStruct``\\ s), or path
            strings (arrays whose shape and dtype are not known: an unstack
            then needs ``num_layers``).
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

        >>> import numpy as np
        >>> plan = Rules(stack=["layers"]).plan({"layers/0/w": np.zeros((2, 3)), "layers/1/w": np.ones((2, 3))})
        >>> [(t.path, t.shape, [str(p) for p in t.pieces]) for t in plan]
        [('layers/w', (2, 2, 3), ['layers/0/w', 'layers/1/w'])]
        """
        # Here, not at the top: the planner imports numpy, which building the CLI's rules flags does not need.
        from treetools.rules.plan import plan_rules

        return plan_rules(self, leaves, num_layers=num_layers, targets=targets)

    def describe(
        self,
        leaves: Mapping[str, Any] | Iterable[str | tuple[str, Sequence[int] | None, Any]],
        *,
        num_layers: int | None = None,
        targets: Collection[str] | None = None,
    ) -> list[RuleRow]:
        """The mapping as rows (source -> target, shape, dtype), before anything is read.

        ``leaves`` as for ``plan``: path strings alone show the mapping of
        the paths (shapes and dtypes blank where unknown). ``format_rows`` (or
        ``str(rules.plan(leaves))``) prints them; dropped leaves come last,
        with ``target`` None.

        >>> rows = Rules(drop=["^opt"], dtype="float16").describe([("w", (2,), "float32"), ("opt/mu", (2,), "float32")])
        >>> [(r.source, r.target, r.dtype) for r in rows]
        [('w', 'w', 'float16'), ('opt/mu', None, None)]
        """
        return self.plan(leaves, num_layers=num_layers, targets=targets).rows()


FIELDS: dict[str, RuleField] = {f.name: f.metadata["rule"] for f in dataclasses.fields(Rules) if "rule" in f.metadata}
"""The field table: every ``Rules`` field's ``RuleField``, in field order."""


def fields_markdown() -> str:
    """The field table as docs/rules.md shows it (``tests/test_rules.py`` checks the page against it).

    >>> print(fields_markdown().splitlines()[3])
    | `drop=[pattern, ...]` | leave out the source leaves a pattern matches | checkpoint paths | `--drop RE`,
    repeatable |
    """
    lines = ["| field | meaning | matched against | flag |", "|---|---|---|---|"]
    for name, field in FIELDS.items():
        flag = f"`{field.flag(name)}" + (f" {field.metavar}`" if field.metavar else "`")
        flag += ", repeatable" if field.kind.flag == "repeat" else ""
        flag += f": {field.syntax}" if field.syntax else ""
        cells = (f"`{field.kind.python(name)}`", field.meaning, field.matched, flag)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # a `|` in a cell is escaped
    return "\n".join(lines)
