"""The values of the layout rules (split, concat, reshape, permute, pad, slice, tie, scale): checked and written.

Each structured rule's value is a small frozen spec (``Split``, ``Concat``,
``Permute``, ``Pad``, ``Slice``, ``Tie``) made from a mapping (Python, JSON,
TOML) or from its command-line string, ``'PATTERN=>key=value key=value'``:
exactly one ``=>``, then space-separated ``key=value`` items, a list value
comma-separated (``names=q.weight,k.weight,v.weight``). ``reshape`` takes a
shape, written as ``transpose``'s axes are (``'PATTERN=0,-1,64'``). ``scale``
takes a factor (``Scale``: a number, ``sqrt(N)`` or ``1/sqrt(N)``, parsed, never
evaluated), ``'PATTERN=FACTOR'`` on the command line.

Standard library only: the CLI builds the rules flags from the field table
(``treetools.rules.spec``) before numpy loads.

>>> parse_split(r"c_attn\\.weight$=>names=q.weight,k.weight,v.weight axis=1")
('c_attn\\\\.weight$', Split(names=('q.weight', 'k.weight', 'v.weight'), axis=1, sizes=None))
>>> Split.make({"names": ["a", "b"], "axis": 0, "sizes": [3, -1]}).to_json()
{'names': ['a', 'b'], 'axis': 0, 'sizes': [3, -1]}
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any, Callable, Mapping

PERMUTE_LAYOUTS = ("half", "interleaved")
"""Rotary layouts: ``half`` pairs element ``i`` of a head with ``i + rotary_dim/2`` (Hugging Face's
``rotate_half``); ``interleaved`` pairs ``2i`` with ``2i + 1`` (Meta's original Llama checkpoints, GPT-J)."""
INITIALIZERS = ("zeros", "normal", "uniform")
"""How ``pad`` fills new entries: zeros, or ``numpy.random.default_rng(seed).normal(mean, stddev, shape)`` /
``.uniform(low, high, shape)`` over the whole new region (docs/rules.md)."""


def _int(value: Any, what: str, *, low: int | None = None) -> int:
    # numbers.Integral: Python and numpy integers (numpy registers its own), never bool
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer, got {value!r}.")
    if low is not None and value < low:
        raise ValueError(f"{what} must be at least {low}, got {value}.")
    return int(value)


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{what} must be a finite number, got {value!r}.")
    return float(value)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{what} must be a list of integers such as [1, 0], got {value!r}.")
    return tuple(_int(v, f"{what} entry") for v in value)


def _names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not hasattr(value, "__iter__") or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{what} must be a list of strings, got {value!r}.")
    return tuple(value)


def _keys(field: str, value: Any, required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"`{field}` takes a {{key: value}} table ({', '.join(required + optional)}), got {value!r}.")
    unknown = sorted(set(value) - set(required) - set(optional))
    missing = [k for k in required if k not in value]
    if unknown or missing:
        what = "; ".join([f"unknown key(s) {unknown}"] * bool(unknown) + [f"missing {missing}"] * bool(missing))
        raise ValueError(f"`{field}` {dict(value)!r}: {what}; the keys are {list(required + optional)} "
                         f"({', '.join(required)} required).")
    return dict(value)


class _Spec:
    """A spec's JSON form: its fields, without those at their default."""

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclasses.dataclass(frozen=True)
class Split(_Spec):
    """``split``: one leaf becomes ``len(names)`` leaves, consecutive pieces along ``axis``.

    ``names``: each piece's path as ``re.sub(pattern, name, path)`` (groups as in ``rename``). ``sizes``: the
    pieces' lengths (one may be -1: the rest), or None for equal pieces.
    """

    names: tuple[str, ...]
    axis: int
    sizes: tuple[int, ...] | None = None

    @classmethod
    def make(cls, value: Any, field: str = "split") -> Split:
        v = _keys(field, value, ("names", "axis"), ("sizes",))
        names = _names(v["names"], f"`{field}` names")
        sizes = None if v.get("sizes") is None else _ints(v["sizes"], f"`{field}` sizes")
        if len(names) < 1:
            raise ValueError(f"`{field}` needs at least one name, got {list(names)}.")
        if sizes is not None and (len(sizes) != len(names) or sizes.count(-1) > 1
                                  or any(s < 0 and s != -1 for s in sizes)):
            raise ValueError(f"`{field}` sizes {list(sizes)} for names {list(names)}: one size (>= 0) per name, "
                             "at most one -1 (the rest of the axis).")
        return cls(names, _int(v["axis"], f"`{field}` axis"), sizes)


@dataclasses.dataclass(frozen=True)
class Concat(_Spec):
    """``concat``: the leaves a pattern matches, grouped by their new path ``re.sub(pattern, name, path)``, become
    one leaf, joined along ``axis`` in the order of ``parts`` (the values of the pattern's group ``part``)."""

    name: str
    axis: int
    parts: tuple[str, ...]

    @classmethod
    def make(cls, value: Any, field: str = "concat") -> Concat:
        v = _keys(field, value, ("name", "axis", "parts"), ())
        if not isinstance(v["name"], str):
            raise TypeError(f"`{field}` name must be a string, got {v['name']!r}.")
        parts = _names(v["parts"], f"`{field}` parts")
        if len(parts) < 1 or len(set(parts)) != len(parts):
            raise ValueError(f"`{field}` parts {list(parts)}: name each part once, in the order they are joined.")
        return cls(v["name"], _int(v["axis"], f"`{field}` axis"), parts)


@dataclasses.dataclass(frozen=True)
class Permute(_Spec):
    """``permute``: the rotary layout of each head along ``axis`` (heads of ``head_dim`` entries, the first
    ``rotary_dim`` of each rotated), rewritten ``to`` ``half`` or ``interleaved`` from the other."""

    axis: int
    head_dim: int
    to: str
    rotary_dim: int | None = None

    @classmethod
    def make(cls, value: Any, field: str = "permute") -> Permute:
        v = _keys(field, value, ("axis", "head_dim", "to"), ("rotary_dim",))
        head_dim = _int(v["head_dim"], f"`{field}` head_dim", low=2)
        rotary = None if v.get("rotary_dim") is None else _int(v["rotary_dim"], f"`{field}` rotary_dim", low=2)
        if v["to"] not in PERMUTE_LAYOUTS:
            raise ValueError(f"`{field}` to {v['to']!r}: one of {', '.join(PERMUTE_LAYOUTS)}.")
        if (rotary or head_dim) % 2 or (rotary or 0) > head_dim:
            raise ValueError(f"`{field}` head_dim {head_dim}, rotary_dim {rotary}: the rotated entries of a head "
                             "come in pairs (an even number, at most head_dim).")
        return cls(_int(v["axis"], f"`{field}` axis"), head_dim, v["to"], rotary)

    @property
    def rotated(self) -> int:
        """How many entries of each head are rotated (``rotary_dim``, else the whole head)."""
        return self.rotary_dim or self.head_dim


@dataclasses.dataclass(frozen=True)
class Pad(_Spec):
    """``pad``: ``axis`` grown to ``size`` entries, the new ones (at the end) from ``init`` (zeros, or
    ``numpy.random.default_rng(seed)``'s ``normal(mean, stddev)`` / ``uniform(low, high)`` over the new region)."""

    axis: int
    size: int
    init: str = "zeros"
    stddev: float | None = None
    mean: float = 0.0
    low: float | None = None
    high: float | None = None
    seed: int = 0

    @classmethod
    def make(cls, value: Any, field: str = "pad") -> Pad:
        v = _keys(field, value, ("axis", "size"), ("init", "stddev", "mean", "low", "high", "seed"))
        init = v.get("init", "zeros")
        if init not in INITIALIZERS:
            raise ValueError(f"`{field}` init {init!r}: one of {', '.join(INITIALIZERS)}.")
        wants = {"zeros": (), "normal": ("stddev",), "uniform": ("low", "high")}[init]
        allowed = set(wants) | ({"mean"} if init == "normal" else set()) | ({"seed"} if init != "zeros" else set())
        extra = sorted(k for k in ("stddev", "mean", "low", "high", "seed") if k in v and k not in allowed)
        if extra or any(k not in v for k in wants):
            raise ValueError(f"`{field}` init {init!r} takes {sorted(allowed) or 'no other keys'}"
                             + (f", not {extra}" if extra else f"; give {list(wants)}") + ".")
        num = {k: _float(v[k], f"`{field}` {k}") for k in ("stddev", "mean", "low", "high") if k in v}
        if num.get("stddev", 0) < 0 or num.get("low", 0) > num.get("high", num.get("low", 0)):
            raise ValueError(f"`{field}` {dict(v)!r}: stddev must be >= 0 and low <= high.")
        return cls(_int(v["axis"], f"`{field}` axis"), _int(v["size"], f"`{field}` size", low=0), init,
                   seed=_int(v.get("seed", 0), f"`{field}` seed", low=0), **num)


@dataclasses.dataclass(frozen=True)
class Slice(_Spec):
    """``slice``: entries ``start`` .. ``stop - 1`` along ``axis`` kept (a vocabulary shrunk)."""

    axis: int
    stop: int
    start: int = 0

    @classmethod
    def make(cls, value: Any, field: str = "slice") -> Slice:
        v = _keys(field, value, ("axis", "stop"), ("start",))
        start, stop = _int(v.get("start", 0), f"`{field}` start", low=0), _int(v["stop"], f"`{field}` stop", low=0)
        if stop < start:
            raise ValueError(f"`{field}` start {start}, stop {stop}: stop must be at least start.")
        return cls(_int(v["axis"], f"`{field}` axis"), stop, start)


@dataclasses.dataclass(frozen=True)
class Tie(_Spec):
    """``tie``: one more leaf, at ``re.sub(pattern, name, path)``, holding the matched leaf's values (transposed
    by ``axes`` when given): ``lm_head.weight`` written as the embedding."""

    name: str
    axes: tuple[int, ...] | None = None

    @classmethod
    def make(cls, value: Any, field: str = "tie") -> Tie:
        v = _keys(field, value, ("name",), ("axes",))
        if not isinstance(v["name"], str):
            raise TypeError(f"`{field}` name must be a string, got {v['name']!r}.")
        return cls(v["name"], None if v.get("axes") is None else _ints(v["axes"], f"`{field}` axes"))


_NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_FACTOR = re.compile(rf"\s*(?:(?P<number>{_NUMBER})|(?P<inverse>1\s*/\s*)?sqrt\s*\(\s*(?P<root>{_NUMBER})\s*\))\s*")
FACTOR_FORMS = "a number (0.5, 2e-3), sqrt(N) or 1/sqrt(N) with N > 0"
"""What ``scale`` takes: no other expression is read (nothing is evaluated)."""


def _shown(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 2**53 else repr(x)


@dataclasses.dataclass(frozen=True)
class Scale:
    """``scale``: a constant factor, one of three forms: ``number`` (``x * number``), ``sqrt(root)`` (``x *
    sqrt(root)``) or ``1/sqrt(root)`` (``x / sqrt(root)``), computed in float64 (``numpy.sqrt`` of the float64
    ``root``) and rounded once to the leaf's dtype. Written as a number, or as the text ``'sqrt(N)'`` /
    ``'1/sqrt(N)'``; no other expression is read.

    >>> Scale.make("1/sqrt(128)"), Scale.make(0.5).to_json(), str(Scale.make(" sqrt( 2.5 ) "))
    (Scale(number=None, root=128.0, inverse=True), 0.5, 'sqrt(2.5)')
    """

    number: float | None = None
    root: float | None = None
    inverse: bool = False

    @classmethod
    def make(cls, value: Any, field: str = "scale") -> Scale:
        if isinstance(value, str):
            m = _FACTOR.fullmatch(value)
            if m is None:
                raise ValueError(f"`{field}` factor {value!r}: write {FACTOR_FORMS}.")
            if m.group("number") is not None:
                return cls.make(float(m.group("number")), field)
            root = float(m.group("root"))
            if not (math.isfinite(root) and root > 0):
                raise ValueError(f"`{field}` factor {value!r}: N in sqrt(N) must be a finite number > 0.")
            return cls(root=root, inverse=m.group("inverse") is not None)
        try:
            return cls(number=_float(value, f"`{field}` factor"))
        except TypeError:
            raise TypeError(f"`{field}` factor {value!r}: write {FACTOR_FORMS}.") from None

    def __str__(self) -> str:
        if self.root is None:
            return _shown(float(self.number or 0.0))
        return f"{'1/' if self.inverse else ''}sqrt({_shown(self.root)})"

    def to_json(self) -> Any:
        """A number as a number, ``sqrt(N)`` / ``1/sqrt(N)`` as that text (what ``make`` reads back)."""
        return self.number if self.root is None else str(self)


# ---------------------------------------------------------------------------------------------- checks


def _checker(cls: Any, field: str) -> Callable[[str, Any], Any]:
    def check(pattern: str, value: Any) -> Any:
        if isinstance(value, cls):
            return value
        try:
            return cls.make(value, field)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (rule {pattern!r})") from None
    return check


check_split = _checker(Split, "split")
check_permute = _checker(Permute, "permute")
check_pad = _checker(Pad, "pad")
check_slice = _checker(Slice, "slice")
check_tie = _checker(Tie, "tie")
check_scale = _checker(Scale, "scale")
_check_concat = _checker(Concat, "concat")


def check_concat(pattern: str, value: Any) -> Concat:
    """A ``concat`` value, its pattern holding the group ``(?P<part>...)`` that names each part."""
    try:
        groups = re.compile(pattern).groupindex
    except re.error:
        groups = {"part": 0}  # the bad regex is a PatternError naming the field, raised when the patterns compile
    if "part" not in groups:
        raise ValueError(f"`concat` pattern {pattern!r} has no group named `part`: write the part of each path in "
                         r"(?P<part>...), e.g. '\.(?P<part>q|k|v)_proj\.weight$'.")
    return _check_concat(pattern, value)


@dataclasses.dataclass(frozen=True)
class Reshape(_Spec):
    """``reshape``, one of three forms: ``into`` replaces ``axis`` by several (``{"axis": 0, "into": [-1, 64]}``:
    ``[H*D, d] -> [H, D, d]``); ``merge`` joins the axes ``merge[0] .. merge[1]`` into one (``{"merge": [1, 2]}``:
    ``[d, H, D] -> [d, H*D]``); ``shape`` is the whole new shape (0: the leaf's size at that position, one -1: the
    rest). Written as a list, a value is a ``shape``."""

    shape: tuple[int, ...] | None = None
    axis: int | None = None
    into: tuple[int, ...] | None = None
    merge: tuple[int, int] | None = None

    @classmethod
    def make(cls, value: Any, field: str = "reshape") -> Reshape:
        if not isinstance(value, Mapping):
            value = {"shape": value}
        v = _keys(field, value, (), ("shape", "axis", "into", "merge"))
        form = [k for k in ("shape", "into", "merge") if v.get(k) is not None]
        if len(form) != 1 or ("axis" in v) != (form == ["into"]):
            raise ValueError(f"`{field}` {dict(v)!r}: give one of shape=[...], axis=A with into=[...], or "
                             "merge=[A, B].")
        sizes = _ints(v[form[0]], f"`{field}` {form[0]}")
        if form[0] == "merge":
            if len(sizes) != 2 or sizes[0] >= sizes[1] and sizes[0] * sizes[1] >= 0:
                raise ValueError(f"`{field}` merge {list(sizes)}: two axes, the first before the second.")
            return cls(merge=(sizes[0], sizes[1]))
        if sizes.count(-1) > 1 or any(d < -1 for d in sizes) or (form[0] == "into" and 0 in sizes):
            raise ValueError(f"`{field}` {form[0]} {list(sizes)}: sizes >= 1, at most one -1 (the rest)"
                             + (", 0 for the leaf's own size at that position." if form[0] == "shape" else "."))
        if form[0] == "into":
            return cls(axis=_int(v["axis"], f"`{field}` axis"), into=sizes)
        return cls(shape=sizes)

    def to_json(self) -> Any:
        return list(self.shape) if self.shape is not None else super().to_json()

    def __str__(self) -> str:
        if self.shape is not None:
            return str(list(self.shape))
        if self.into is not None:
            return f"axis {self.axis} into {list(self.into)}"
        return f"merge {list(self.merge or ())}"


check_reshape = _checker(Reshape, "reshape")


# ---------------------------------------------------------------------------------------------- CLI strings


def _value(key: str, text: str, lists: tuple[str, ...], numbers_: tuple[str, ...]) -> Any:
    if key in lists:
        parts = [p for p in text.split(",") if p != ""]
        try:
            return [int(p) for p in parts] if key in ("sizes", "axes", "shape", "into", "merge") else parts
        except ValueError:
            raise ValueError(f"`{key}` {text!r}: comma-separated integers.") from None
    if key in numbers_:
        try:
            return int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
        except ValueError:
            raise ValueError(f"`{key}` {text!r}: a number.") from None
    return text


def _parse(flag: str, example: str, lists: tuple[str, ...], numbers_: tuple[str, ...],
           make: Callable[[str, Any], Any]) -> Callable[[str], tuple[str, Any]]:
    def parse(text: str) -> tuple[str, Any]:
        if text.count("=>") != 1:
            raise ValueError(f"`{flag}` {text!r}: write PATTERN=>key=value ... with exactly one `=>`, e.g. "
                             f"{example!r} (a pattern holding `=>` goes in a --rules file).")
        pattern, _, rest = text.partition("=>")
        items: dict[str, Any] = {}
        for word in rest.split():
            key, eq, val = word.partition("=")
            if not eq or key in items:
                raise ValueError(f"`{flag}` {text!r}: {word!r} is not one key=value item; e.g. {example!r}.")
            items[key] = _value(key, val, lists, numbers_)
        try:
            return pattern, make(pattern, items)
        except (TypeError, ValueError) as e:
            raise ValueError(f"`{flag}` {text!r}: {e}") from None
    return parse


_NUMS = ("axis", "head_dim", "rotary_dim", "size", "stddev", "mean", "low", "high", "seed", "start", "stop")
parse_split = _parse("--split", r"c_attn\.weight$=>names=q.weight,k.weight,v.weight axis=1",
                     ("names", "sizes"), _NUMS, check_split)
parse_concat = _parse("--concat", r"\.(?P<part>gate|up)_proj\.weight$=>name=.gate_up_proj.weight axis=0 parts=gate,up",
                      ("parts",), _NUMS, check_concat)
parse_permute = _parse("--permute", r"q_proj\.weight$=>axis=0 head_dim=128 to=interleaved", (), _NUMS, check_permute)
parse_pad = _parse("--pad", r"embed_tokens\.weight$=>axis=0 size=32128 init=normal stddev=0.02 seed=0", (), _NUMS,
                   check_pad)
parse_slice = _parse("--slice", r"embed_tokens\.weight$=>axis=0 stop=32000", (), _NUMS, check_slice)
parse_tie = _parse("--tie", r"^embed/embedding$=>name=lm_head/kernel axes=1,0", ("axes",), _NUMS, check_tie)


def parse_reshape(text: str) -> tuple[str, Reshape]:
    """``'PATTERN=SHAPE'`` (sizes comma-separated, split at the last ``=``) or ``'PATTERN=>axis=A into=S1,S2'`` /
    ``'PATTERN=>merge=A,B'`` (``--reshape``).

    >>> parse_reshape(r"w$=0,-1")
    ('w$', Reshape(shape=(0, -1), axis=None, into=None, merge=None))
    >>> parse_reshape(r"q_proj\\.weight$=>axis=0 into=-1,64")[1].to_json()
    {'axis': 0, 'into': [-1, 64]}
    """
    if "=>" in text:
        return _parse_reshape(text)
    pattern, eq, value = text.rpartition("=")
    try:
        if not eq or not value.strip():
            raise ValueError
        return pattern, check_reshape(pattern, [int(a) for a in value.split(",")])
    except ValueError as e:
        raise ValueError(f"`--reshape` {text!r}: write PATTERN=SIZES, comma-separated integers (0: the leaf's own "
                         "size on that axis, -1: the rest), or PATTERN=>axis=A into=S1,S2 or PATTERN=>merge=A,B. "
                         f"{e}".rstrip()) from None


_parse_reshape = _parse("--reshape", r"q_proj\.weight$=>axis=0 into=-1,64", ("shape", "into", "merge"), _NUMS,
                        check_reshape)


def parse_scale(text: str) -> tuple[str, Scale]:
    """``'PATTERN=FACTOR'`` (``--scale``), split at the last ``=``: a number, ``sqrt(N)`` or ``1/sqrt(N)``.

    >>> parse_scale(r"query/kernel$=1/sqrt(128)")
    ('query/kernel$', Scale(number=None, root=128.0, inverse=True))
    """
    pattern, eq, value = text.rpartition("=")
    if not eq or not value.strip():
        raise ValueError(f"`--scale` {text!r}: write PATTERN=FACTOR, the factor {FACTOR_FORMS}, e.g. "
                         "'query/kernel$=1/sqrt(128)'.")
    try:
        return pattern, check_scale(pattern, value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"`--scale` {text!r}: {e}") from None
