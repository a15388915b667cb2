"""Rows: the data every table, report and diff is made of.

A ``Row`` is one leaf (or, after ``aggregate_rows``, one group of leaves).
Its path is kept as a tuple of parts and joined only when it is shown or
matched: ``Row.name`` is the one path string (``"/"``-joined for trees; a
flat-key format such as safetensors keeps its stored name, split on ``"."``
for grouping and joined back with ``"."``). ``treetools.shared.render`` turns rows
into the terminal table, markdown, an indented tree or JSON.

Standard library only (``dtype_name`` imports numpy when it runs): the
checkpoint readers and the jax-free commands build rows from metadata,
``treetools.pytree.table.rows_from_tree`` from a live tree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from typing import Any, Callable, Iterable, Mapping, Sequence, cast

MIXED = "mixed"

STATS = ("mean", "std", "min", "max", "l2", "abs_max", "zeros", "nan", "posinf", "neginf")
"""The statistics a ``Row`` carries (``--stats``), in the order every table and JSON object lists them:
floats over the finite elements (``std`` is the population one), then counts of elements."""
STAT_COUNTS = ("zeros", "nan", "posinf", "neginf")
"""The statistics that count elements."""
NONFINITE_COUNTS = ("nan", "posinf", "neginf")
"""The counts whose sum is a leaf's non-finite elements (``nonfinite_count``)."""


def nonfinite_count(stats: Mapping[str, Any]) -> int:
    """The NaN and infinite elements a leaf's statistics count (a missing or null count is 0): the one sum of them.

    >>> nonfinite_count({"nan": 1, "posinf": 2, "neginf": None, "zeros": 5})
    3
    """
    return sum(int(stats.get(k) or 0) for k in NONFINITE_COUNTS)


@dataclasses.dataclass(frozen=True)
class LeafSharding:
    """How one leaf is laid out: a PartitionSpec over named mesh axes.

    ``spec`` holds one entry per array dimension (a mesh axis name, a tuple
    of them, or None); a ``jax.sharding.PartitionSpec`` is such a tuple.
    ``mesh`` maps axis name to size and is None when the leaf does not say.
    ``device`` names the one device that holds the whole array (a live array
    placed on one device, e.g. initialized without ``out_shardings``), else None.
    Two shardings are the same when they split the same dimensions over the
    same axes (``P()`` and ``P(None,)`` are both replicated): compare with
    ``same_layout``.

    >>> s = LeafSharding(("fsdp", None), {"fsdp": 4})
    >>> str(s), s.to_json(), str(LeafSharding((None,), {"fsdp": 4})), str(LeafSharding((), device="cpu:0"))
    ("P('fsdp')", {'mesh': {'fsdp': 4}, 'spec': ['fsdp', None]}, 'replicated', 'whole on cpu:0')
    """

    spec: Any
    mesh: Mapping[str, int] | None = None
    device: str | None = None

    @property
    def entries(self) -> tuple:
        """The spec's entries with trailing Nones dropped and one-axis tuples unwrapped."""
        out = [e[0] if isinstance(e, (tuple, list)) and len(e) == 1 else
               (tuple(e) if isinstance(e, (tuple, list)) else e) for e in tuple(self.spec)]
        out = [None if e == () else e for e in out]
        while out and out[-1] is None:
            out.pop()
        return tuple(out)

    @property
    def replicated(self) -> bool:
        return not self.entries

    def same_layout(self, other: "LeafSharding | None") -> bool:
        """Whether ``other`` splits the same dimensions over the same mesh axes (None counts as replicated)."""
        if other is None:
            return self.replicated
        return self.entries == other.entries and (self.mesh is None or other.mesh is None
                                                  or dict(self.mesh) == dict(other.mesh))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mesh": dict(self.mesh) if self.mesh is not None else None,
            "spec": [list(e) if isinstance(e, (tuple, list)) else e for e in tuple(self.spec)],
        }
        if self.device is not None:
            out["device"] = self.device
        return out

    def __str__(self) -> str:
        if self.device is not None:
            return f"whole on {self.device}"
        if self.replicated:
            return "replicated"
        return "P(" + ", ".join(repr(e) for e in self.entries) + ")"


@dataclasses.dataclass(slots=True)
class Row:
    """One leaf (or, after ``aggregate_rows``, one group of leaves).

    ``path`` is a tuple of parts; ``name`` joins them with ``sep``.
    ``sharding`` is a ``LeafSharding`` or None; ``shape`` is None for
    non-array leaves and for aggregated rows; ``weight_decay`` is None where
    it was not asked for or is mixed; ``stats`` holds the statistics of
    ``STATS`` when they were computed; ``leaves`` counts the leaves a group sums;
    ``layers`` is the layer count of a stacked (scanned) leaf, or of a group
    whose leaves all hold that many layers (``tabulate_params``), else None.
    """

    path: tuple[str, ...]
    shape: tuple[int, ...] | None
    dtype: str | None
    params: int
    bytes: int
    sharding: Any = None
    weight_decay: bool | None = None
    stats: dict[str, Any] | None = None
    leaves: int = 1
    sep: str = "/"
    layers: int | None = None
    leaf_shape: tuple[int, ...] | None = None
    """For a group: the shape every one of its leaves has, when they all have one (a table shows ``24 x (8, 8)``)."""

    def __post_init__(self) -> None:
        if isinstance(self.path, str):  # a joined name given: split it once, here
            self.path = tuple(self.path.split(self.sep)) if self.path else ()

    @property
    def name(self) -> str:
        """The one path string of this row."""
        return self.sep.join(self.path)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.name,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
            "params": self.params,
            "bytes": self.bytes,
            "sharding": self.sharding.to_json() if self.sharding is not None else None,
        }
        if self.weight_decay is not None:
            out["weight_decay"] = self.weight_decay
        if self.stats is not None:
            out["stats"] = self.stats
        if self.leaves != 1:
            out["num_leaves"] = self.leaves  # an aggregated (--depth) row: how many leaves it sums
        if self.layers is not None:
            out["layers"] = self.layers
        return out


@dataclasses.dataclass
class Totals:
    """Params and bytes of a set of leaves, with a per-dtype breakdown."""

    params: int
    bytes: int
    by_dtype: dict[str, dict[str, int]]
    leaves: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"total_params": self.params, "total_bytes": self.bytes, "by_dtype": self.by_dtype}

    def __add__(self, other: "Totals") -> "Totals":
        by_dtype = {k: dict(v) for k, v in self.by_dtype.items()}
        for dtype, d in other.by_dtype.items():
            mine = by_dtype.setdefault(dtype, {"params": 0, "bytes": 0})
            mine["params"] += d["params"]
            mine["bytes"] += d["bytes"]
        return Totals(self.params + other.params, self.bytes + other.bytes, dict(sorted(by_dtype.items())),
                      self.leaves + other.leaves)


@functools.cache
def dtype_name(dtype: Any) -> str:
    """``float32``, ``bfloat16``...: the name a user types, not ``<f4`` (once per dtype).

    ``jax.dtypes.float0`` (the gradient dtype of integer inputs under
    ``jax.grad(..., allow_int=True)``) is a numpy structured void dtype with
    itemsize 0, which numpy would print as ``[('float0', 'V')]``; it is
    recognised by its structure, so this never imports jax.

    >>> import numpy as np
    >>> dtype_name(np.float32), dtype_name(np.dtype([("float0", "V")]))
    ('float32', 'float0')
    """
    import numpy as np

    if not isinstance(dtype, np.dtype) and "key<" in str(dtype):  # a typed PRNG key dtype
        return str(dtype)
    dtype = np.dtype(dtype)
    return "float0" if dtype.names == ("float0",) and dtype.itemsize == 0 else str(dtype)


def _merge(values: Iterable[Any]) -> Any:
    vals = set(values)
    return vals.pop() if len(vals) == 1 else None


def common_prefix(rows: Sequence[Row]) -> tuple[str, ...]:
    """The folder parts every one of two or more rows lies below (a row's own last part is never shared).

    >>> common_prefix([Row(("opt", "0", "mu"), None, None, 0, 0), Row(("opt", "0", "nu"), None, None, 0, 0)])
    ('opt', '0')
    """
    if len(rows) < 2:
        return ()
    first = rows[0].path[:-1]
    n = len(first)
    for r in rows[1:]:
        parent = r.path[:-1]
        n = min(n, len(parent))
        for i in range(n):
            if parent[i] != first[i]:
                n = i
                break
        if n == 0:
            break
    return tuple(first[:n])


def aggregate_rows(rows: Sequence[Row], depth: int | None, *, offset: int = 0, whole: bool = False) -> list[Row]:
    """Sum rows per path prefix of ``offset + depth`` parts, in first-seen order.

    ``offset`` is how many leading parts every row shares (a section header
    shows them once): depth counts from there. A group of one leaf keeps that
    leaf's row whole (shape, sharding, stats).

    >>> rows = [Row(("enc", "w"), (4,), "float64", 4, 32), Row(("enc", "b"), (2,), "float64", 2, 16),
    ...         Row(("head",), (3,), "float64", 3, 24)]
    >>> [(r.name, r.params, r.leaves) for r in aggregate_rows(rows, 1)]
    [('enc', 6, 2), ('head', 3, 1)]
    """
    if whole:  # one row for all of them
        depth, offset = 0, 0
    elif depth is None:
        return list(rows)
    elif depth < 1:
        raise ValueError(f"`depth` must be a positive integer, got {depth}.")
    cut = offset + depth
    groups: dict[tuple[str, ...], list[Row]] = {}
    for row in rows:
        groups.setdefault(row.path[:cut], []).append(row)
    out = []
    for prefix, members in groups.items():
        if len(members) == 1 and (members[0].path == prefix or members[0].leaves == 1):
            out.append(members[0] if members[0].path == prefix else dataclasses.replace(members[0], path=prefix))
            continue
        dtypes = {m.dtype for m in members if m.dtype is not None}
        shapes = {m.shape if m.leaves == 1 else m.leaf_shape for m in members}
        out.append(
            Row(
                path=prefix,
                shape=None,
                dtype=dtypes.pop() if len(dtypes) == 1 else (MIXED if dtypes else None),
                params=sum(m.params for m in members),
                bytes=sum(m.bytes for m in members),
                sharding=None,
                weight_decay=_merge(m.weight_decay for m in members),
                leaves=sum(m.leaves for m in members),
                sep=members[0].sep,
                layers=_merge(m.layers for m in members),
                leaf_shape=shapes.pop() if len(shapes) == 1 else None,
            )
        )
    return out


def totals(rows: Iterable[Row]) -> Totals:
    """Global params and bytes with a per-dtype breakdown (leaf rows only).

    >>> totals([Row(("a",), (2,), "float32", 2, 8), Row(("b",), (3,), "int8", 3, 3)]).to_json()
    {'total_params': 5, 'total_bytes': 11, 'by_dtype': {'float32': {'params': 2, 'bytes': 8},
    'int8': {'params': 3, 'bytes': 3}}}
    """
    params = nbytes = leaves = 0
    by_dtype: dict[str, dict[str, int]] = {}
    for row in rows:
        params += row.params
        nbytes += row.bytes
        leaves += row.leaves
        if row.dtype is not None and row.dtype != MIXED:
            d = by_dtype.setdefault(row.dtype, {"params": 0, "bytes": 0})
            d["params"] += row.params
            d["bytes"] += row.bytes
    return Totals(params, nbytes, dict(sorted(by_dtype.items())), leaves)


_SORT_KEYS: dict[str, Callable[[Row], Any]] = {
    "path": lambda r: r.name,
    "params": lambda r: (-r.params, r.name),
    "bytes": lambda r: (-r.bytes, r.name),
}


VALUE_SORTS = ("max_abs_diff", "rel_l2", "outside")
"""The sort keys of value comparisons (``diff --values --sort``), most changed first; ``outside``: elements
outside the tolerance."""


def sort_rows(rows: Sequence[Row], by: str | None) -> list[Row]:
    """Rows sorted by ``path`` (ascending) or ``params``/``bytes`` (largest first).

    >>> [r.name for r in sort_rows([Row(("a",), (1,), "float32", 1, 4), Row(("b",), (5,), "float32", 5, 20)], "params")]
    ['b', 'a']
    """
    if by is None:
        return list(rows)
    if by not in _SORT_KEYS:
        raise ValueError(f"`sort` must be one of {sorted(_SORT_KEYS)}, got {by!r}.")
    return sorted(rows, key=_SORT_KEYS[by])


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (params) or, with unit='B', '1.18 MiB'.

    >>> human(1234567), human(1234567, "B"), human(244)
    ('1.23M', '1.18 MiB', '244')
    """
    if unit == "B":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024 or suffix == "TiB":
                return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.2f} {suffix}"
            n /= 1024
    for suffix in ("", "K", "M", "B", "T"):
        if abs(n) < 1000 or suffix == "T":
            return f"{n:.0f}" if suffix == "" else f"{n:.2f}{suffix}"
        n /= 1000
    return str(n)


def format_shape(shape: Sequence[int] | None) -> str:
    """The one way a shape is printed: ``(64, 128)``, ``(4,)``, ``()``; empty for non-arrays.

    >>> format_shape((64, 128)), format_shape((4,)), format_shape(()), format_shape(None)
    ('(64, 128)', '(4,)', '()', '')
    """
    if shape is None:
        return ""
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def format_count(n: int) -> str:
    """The one way a count is printed: ``1,234`` below a million, ``12,345,678 (12.35M)`` above.

    >>> format_count(244), format_count(12345678)
    ('244', '12,345,678 (12.35M)')
    """
    return f"{n:,}" if abs(n) < 1_000_000 else f"{n:,} ({human(n)})"


_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
               "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
"""Every size flag's units: ``KB``/``MB``/``GB``/``TB`` decimal (as ``huggingface_hub`` reads ``max_shard_size``),
``KiB``/``MiB``/``GiB``/``TiB`` binary, and a bare letter ``K``/``M``/``G``/``T`` binary, as docker, ulimit and
Slurm read ``16G``; any case."""


def parse_size(size: int | float | str, *, what: str = "size", bare: int = 1, unbounded: bool = False) -> int:
    """Bytes from ``5GB`` (decimal), ``80GiB`` or ``16G`` (binary: ``_SIZE_UNITS``) or a bare number of ``bare``
    bytes (1: bytes, every size flag; 2**20 for the older ``--memory-budget-mb``).

    ``what`` names the argument in the error (``shard_size``, ``--device-memory``); ``unbounded`` also takes
    ``inf`` (no limit: returns ``math.inf``).

    Raises:
      ValueError: not a positive size (the message shows the forms accepted).

    >>> parse_size("5GB"), parse_size("1.5MiB"), parse_size(1024), parse_size("16G"), parse_size("16g")
    (5000000000, 1572864, 1024, 17179869184, 17179869184)
    >>> parse_size("0.5", bare=2**20), parse_size("inf", unbounded=True)
    (524288, inf)
    """
    if isinstance(size, numbers.Number) and not isinstance(size, bool):
        value: float = cast(float, size) * bare  # any real number, numpy's too
    else:
        text = str(size).strip()
        if unbounded and text.lower() in ("inf", "infinity"):
            return math.inf  # type: ignore[return-value]
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)", text)
        unit = m.group(2).upper() if m else None
        if m is None or (unit and unit not in _SIZE_UNITS):
            raise ValueError(f"`{what}` {size!r} is not a size; {size_forms(bare, unbounded)}.")
        value = float(m.group(1)) * (_SIZE_UNITS[unit] if unit else bare)
    if value == math.inf and unbounded:
        return math.inf  # type: ignore[return-value]
    if not value >= 1 or value == math.inf:
        raise ValueError(f"`{what}` must be positive, got {size!r}; {size_forms(bare, unbounded)}.")
    return int(value)


def size_forms(bare: int = 1, unbounded: bool = False) -> str:
    """The forms ``parse_size`` takes, as every size error says them.

    >>> size_forms()
    'write a number with a unit such as 16G or 2GiB (binary), 500MB (decimal), or a bare number of bytes'
    """
    unit = "bytes" if bare == 1 else "MiB" if bare == 2**20 else f"{bare}-byte units"
    return (f"write a number with a unit such as 16G or 2GiB (binary), 500MB (decimal), or a bare number of {unit}"
            + (", or inf (no limit)" if unbounded else ""))
