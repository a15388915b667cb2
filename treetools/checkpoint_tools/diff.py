"""``diff_paths``: what changed between two checkpoints, from metadata and optionally values.

Leaves are joined by path string. Metadata alone gives the leaves added (only
in B), removed (only in A) and changed in shape, dtype or sharding (sharding
only when both formats record it, compared by meaning: ``P()`` and
``P(None,)`` are both replicated). With ``values=True`` every leaf present in
both with the same shape is streamed block by block from both sides at once:

* ``bit_identical``: the stored values are the same bits (NaN payloads included);
* ``mismatched``: elements outside ``|a - b| <= atol + rtol * |b|`` (numpy's
  rule; by default ``atol = 0`` and ``rtol = 1e-5``, so a tensor of tiny values, such
  as Adam's ``nu`` around 1e-9, is compared relative to its own size), where NaN equals NaN and an infinity
  equals the same infinity, but a value that becomes NaN or Inf is always outside; integers (steps, counters,
  PRNG key words) are compared exactly, with no tolerance: any changed integer is outside it; integers and complex
  numbers are compared exactly (no float64 rounding of int64 beyond 2**53, no
  dropped imaginary part);
* ``max_abs_diff`` over elements finite on both sides (``inf`` when a finite
  value became non-finite or back), ``rel_l2 = ||a - b|| / ||a||`` (``inf``
  too in that case, so such a leaf sorts as the most changed), and the
  non-finite counts of each side.

The verdict counts leaves as bit-identical, within tolerance, outside
tolerance, added, removed and changed metadata; ``identical`` is what the
CLI's exit code follows (GNU diff: 0 same, 1 different). Without values it
says only that the leaves and their metadata match, and the verdict and
``values_compared`` say that the values were not compared. ``to_json`` is the
versioned object of ``docs/json-schema.md`` (schema ``SCHEMA``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any, Sequence

import numpy as np

from treetools.checkpoint_io.mapping import map_items
from treetools.checkpoint_io.context import DEFAULT_BLOCK_BYTES
from treetools.checkpoint_io.items import counts_params, order_items, params_within, train_state_parts
from treetools.checkpoint_io.leaves import NO_VALUE, Leaf, Snapshot, Unreadable
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_io.readers import bit_identical, is_numeric
from treetools.checkpoint_io.source import Source
from treetools.checkpoint_io.stream import completed, reduce_blocks
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, UsageError
from treetools.checkpoint_tools.options import DEFAULT_ATOL, DEFAULT_RTOL, DiffOptions, resolve
from treetools.checkpoint_tools.progress import Progress
from treetools.shared.patterns import select_any
from treetools.shared.render import json_object, jsonable
from treetools.shared.rows import VALUE_SORTS, Row, aggregate_rows, sort_rows
from treetools.rules.spec import Rules

SCHEMA = 1
"""Version of ``DiffReport.to_json`` (``docs/json-schema.md``)."""


@dataclasses.dataclass(frozen=True)
class LeafChange:
    """A leaf in both checkpoints whose metadata differs; ``fields`` names what changed."""

    path: str
    a: Row
    b: Row
    fields: list[str]
    value_a: Any = NO_VALUE
    value_b: Any = NO_VALUE

    def to_json(self) -> dict[str, Any]:
        def side(r: Row, value: Any) -> dict[str, Any]:
            j = r.to_json()
            out = {k: j[k] for k in ("shape", "dtype", "sharding")}
            if "value" in self.fields:
                out["value"] = jsonable(value)
            return out

        return {"path": self.path, "fields": self.fields, "a": side(self.a, self.value_a),
                "b": side(self.b, self.value_b)}


@dataclasses.dataclass(frozen=True)
class ValueDiff:
    """Value comparison of one leaf (or, with ``depth``, one group of leaves) present in both checkpoints."""

    path: str
    max_abs_diff: float
    rel_l2: float
    allclose: bool
    mismatched: int
    size: int
    bit_identical: bool = False
    nonfinite_a: int = 0
    nonfinite_b: int = 0
    diff_sq: float = 0.0
    ref_sq: float = 0.0
    leaves: int = 1
    same_leaves: int = -1
    """Of ``leaves``, how many are bit-identical (a group's verdict counts leaves, not groups); -1: from
    ``bit_identical`` (one leaf)."""
    outside_leaves: int = -1
    """Of ``leaves``, how many have elements outside the tolerance; -1: from ``allclose`` (one leaf)."""

    def __post_init__(self) -> None:  # the -1 defaults filled in once, as the object is built (frozen after)
        if self.same_leaves < 0:
            object.__setattr__(self, "same_leaves", self.leaves if self.bit_identical else 0)
        if self.outside_leaves < 0:
            object.__setattr__(self, "outside_leaves", 0 if self.allclose else self.leaves)

    @property
    def outside_fraction(self) -> float:
        """The share of the ``size`` elements outside the tolerance (0 for an empty leaf)."""
        return self.mismatched / self.size if self.size else 0.0

    def to_json(self) -> dict[str, Any]:
        hidden = ("diff_sq", "ref_sq", "leaves", "same_leaves", "outside_leaves")
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in hidden}
        out["outside_fraction"] = self.outside_fraction
        if self.leaves != 1:
            out["num_leaves"] = self.leaves
            out["bit_identical_leaves"], out["outside_leaves"] = self.same_leaves, self.outside_leaves
        return out

    def merge(self, other: "ValueDiff", path: str) -> "ValueDiff":
        diff_sq, ref_sq = self.diff_sq + other.diff_sq, self.ref_sq + other.ref_sq
        max_abs = max(self.max_abs_diff, other.max_abs_diff)
        return ValueDiff(path, max_abs, _rel(diff_sq, ref_sq, max_abs),
                         self.allclose and other.allclose, self.mismatched + other.mismatched, self.size + other.size,
                         self.bit_identical and other.bit_identical, self.nonfinite_a + other.nonfinite_a,
                         self.nonfinite_b + other.nonfinite_b, diff_sq, ref_sq, self.leaves + other.leaves,
                         self.same_leaves + other.same_leaves, self.outside_leaves + other.outside_leaves)


def _rel(diff_sq: float, ref_sq: float, max_abs: float) -> float:
    """``||a - b|| / ||a||`` over the elements finite on both sides; infinite where ``max_abs`` is (a finite value
    that became NaN or Inf, or back: the most changed a leaf can be, whatever its finite part did)."""
    if math.isinf(max_abs):
        return math.inf
    diff_l2, ref_l2 = math.sqrt(diff_sq), math.sqrt(ref_sq)
    return diff_l2 / ref_l2 if ref_l2 > 0 else (0.0 if diff_l2 == 0 else math.inf)


@dataclasses.dataclass(frozen=True)
class DiffReport:
    """What ``treetools diff`` prints, as data."""

    a: dict[str, Any]
    b: dict[str, Any]
    added: list[Row]
    removed: list[Row]
    changed: list[LeafChange]
    unchanged: int
    values: list[ValueDiff] | None = None
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL
    notes: list[str] = dataclasses.field(default_factory=list)
    """Diagnostics for stderr (e.g. a hint to pass ``item``); not part of the JSON object."""
    depth: int | None = None
    """With ``depth``, ``added``, ``removed`` and ``values`` hold groups of leaves (each says how many)."""
    unread_a: list[Unreadable] = dataclasses.field(default_factory=list)
    """Items of A that could not be read (name, handler, reason): listed, and nothing is the same without them."""
    unread_b: list[Unreadable] = dataclasses.field(default_factory=list)
    allow_unread: bool = False
    """``DiffOptions.allow_unread``: an item not read on either side does not make the sides differ."""

    @property
    def identical(self) -> bool:
        """No leaf added, removed or changed, and (with values) every compared leaf within tolerance; and every
        item of both sides read (unless ``allow_unread``: then the items read are compared).

        Without values (``values_compared`` False) it says only that the leaves and their metadata match.
        """
        same_values = self.values is None or all(v.allclose for v in self.values)
        read = self.allow_unread or not any(not u.empty for u in [*self.unread_a, *self.unread_b])
        return not (self.added or self.removed or self.changed) and same_values and read

    @property
    def values_compared(self) -> bool:
        """Whether the values were compared (``values=True``); without, ``identical`` speaks of metadata only."""
        return self.values is not None

    def counts(self) -> dict[str, int]:
        """Leaves per verdict; the value counts appear only when values were compared."""
        out = {"added": sum(r.leaves for r in self.added), "removed": sum(r.leaves for r in self.removed),
               "changed_metadata": len(self.changed), "same_metadata": self.unchanged}
        if self.values is not None:
            same, outside = sum(v.same_leaves for v in self.values), sum(v.outside_leaves for v in self.values)
            out["bit_identical"] = same
            out["within_tolerance"] = sum(v.leaves for v in self.values) - same - outside
            out["outside_tolerance"] = outside
        return out

    def verdict(self) -> str:
        """Two lines: same/different with the leaf counts, then the value counts, or that values were not compared
        (then "same" is "same metadata": nothing was said of the values); every count named."""
        c = self.counts()
        word = "different" if not self.identical else "same" if self.values_compared else "same metadata"
        unread = len(self.unread_a) + len(self.unread_b)
        if not self.identical and self.identical_read:  # exit 1 all the same: not everything was read
            word = f"{'same' if self.values_compared else 'same metadata'} where read"
        leaves = (f"{word} (leaves): {c['added']} added, {c['removed']} removed, {c['changed_metadata']} with changed "
                  f"metadata, {c['same_metadata']} with the same metadata,")
        if not self.values_compared:
            why = "; exit 0 says only the leaves and metadata match" if self.identical else ""
            out = f"{leaves}\n  values: not compared (--values compares them{why})"
        else:
            out = (f"{leaves}\n  values: {c['bit_identical']} bit-identical, {c['within_tolerance']} within "
                   f"tolerance, {c['outside_tolerance']} outside tolerance")
        if unread:
            allowed = " (--allow-unread: compared what was read)" if self.allow_unread else ""
            out += (f"\n  not read: {len(self.unread_a)} item(s) of A, {len(self.unread_b)} item(s) of B, listed "
                    f"above{allowed}")
        return out

    @property
    def identical_read(self) -> bool:
        """What ``identical`` says of the items that were read alone."""
        same_values = self.values is None or all(v.allclose for v in self.values)
        return not (self.added or self.removed or self.changed) and same_values

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "counts": self.counts(),
            "added": [r.to_json() for r in self.added],
            "removed": [r.to_json() for r in self.removed],
            "changed": [c.to_json() for c in self.changed],
            "unchanged": self.unchanged,
            "values_compared": self.values_compared,
            "unreadable": {"a": [u.to_json() for u in self.unread_a], "b": [u.to_json() for u in self.unread_b]},
        }
        if self.values is not None:
            out["atol"], out["rtol"] = self.atol, self.rtol
            out["values"] = [v.to_json() for v in self.values]
        return json_object(SCHEMA, out)


def _kind(dtype: np.dtype) -> str:
    if dtype.kind in "biu":
        return "int"
    if dtype.kind == "c":
        return "complex"
    return "float"


def _as_compared(x: np.ndarray, kind: str) -> np.ndarray:
    x = np.ravel(x)
    if kind == "complex":
        return x.astype(np.complex128)
    if kind == "int":
        return x
    return x.astype(np.float64)  # exact for every float dtype up to float64


def _block_compare(xa: np.ndarray, xb: np.ndarray, kind: str, atol: float, rtol: float
                   ) -> tuple[int, float, float, float, int, int]:
    """``(mismatched, max_abs, diff_sq, ref_sq, nonfinite_a, nonfinite_b)`` of one pair of blocks, exactly.

    The reference rule, in float64 (complex128, exact integers); the float fast
    path (``_fold_float``) falls back to it for pieces holding non-finite or
    extreme values.
    """
    if kind == "int":
        fa, fb = xa, xb
        diff = fa != fb
        if not diff.any():
            ref = fa.astype(np.float64)
            return 0, 0.0, 0.0, float(np.dot(ref, ref)), 0, 0
        da, db = fa[diff].astype(np.float64), fb[diff].astype(np.float64)
        # float64 may round two different int64s together: a differing pair is at least 1 apart.
        d = np.maximum(np.abs(da - db), 1.0)
        # Integers are counters, indices and PRNG key words (a step, Levanter's `training_key`): a tolerance relative
        # to their size would call step 100,000 and 100,001, or two keys whose words are ~2**31, the same. Any
        # changed integer is outside tolerance.
        mismatched = int(d.size)
        ref = fa.astype(np.float64)
        return mismatched, float(d.max()), float(np.dot(d, d)), float(np.dot(ref, ref)), 0, 0
    fin_a, fin_b = np.isfinite(fa := xa), np.isfinite(fb := xb)
    nf_a, nf_b = int(fin_a.size - np.count_nonzero(fin_a)), int(fin_b.size - np.count_nonzero(fin_b))
    both = fin_a & fin_b
    close = np.isclose(fa, fb, rtol=rtol, atol=atol, equal_nan=True)
    if kind == "complex":  # equal_nan on complex: NaN in either part on both sides
        nan_a, nan_b = np.isnan(fa), np.isnan(fb)
        close = np.where(nan_a | nan_b, nan_a & nan_b, close)
    mismatched = int(close.size - np.count_nonzero(close))
    d = np.abs(fa[both] - fb[both]) if not both.all() else np.abs(fa - fb)
    max_abs = float(d.max()) if d.size else 0.0
    one_sided = fin_a != fin_b
    if one_sided.any():
        max_abs = math.inf
    ref = np.abs(fa[fin_a]) if kind == "complex" else fa[fin_a]
    return (mismatched, max_abs, float(np.vdot(d, d).real), float(np.vdot(ref, ref).real), nf_a, nf_b)


# ---------------------------------------------------------------------------- the fast path of float leaves

_PIECE_ELEMS = 1 << 16
"""Elements per piece of a block (256 KiB of float32): each piece's dozen passes stay in the core's L2 cache
(measured on 2 cores: 1 << 16 compares at 6 GB/s per core, 1 << 18 at 2.5, the whole 8 MiB block at 0.2)."""
_ROW = 4096  # sums of squares in rows of this many float32 (accurate to ~1e-8), rows summed in float64
_MARGIN = 1e-6  # float32 tolerance tests this far from the line are decided; nearer ones are redone in float64

_F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32

_local = threading.local()


def _scratch(dtype: np.dtype) -> Any:
    """This thread's buffers for one piece of ``dtype`` (no allocation, and no fresh pages, per piece)."""
    key = "diff" + np.dtype(dtype).char
    bufs = getattr(_local, key, None)
    if bufs is None:
        bufs = type("Scratch", (), {})()
        bufs.a, bufs.b, bufs.d = (np.empty(_PIECE_ELEMS, dtype) for _ in range(3))
        bufs.t, bufs.u = np.empty(_PIECE_ELEMS, dtype), np.empty(_PIECE_ELEMS, dtype)
        bufs.hi, bufs.lo, bufs.small = (np.empty(_PIECE_ELEMS, bool) for _ in range(3))
        setattr(_local, key, bufs)
    return bufs


def _sumsq(x: np.ndarray) -> float:
    """``sum(x * x)`` in one pass: float32 dot products over rows of ``_ROW``, summed in float64."""
    rows = x.size // _ROW
    total = 0.0
    if rows:
        head = x[:rows * _ROW].reshape(rows, _ROW)
        total = float(np.einsum("ij,ij->i", head, head).sum(dtype=np.float64))
    tail = x[rows * _ROW:]
    if tail.size:
        total += float(np.dot(tail, tail))
    return total


@dataclasses.dataclass
class _Compared:
    """The running comparison of one leaf's blocks (a task's share, merged in block order)."""

    mismatched: int = 0
    max_abs: float = 0.0
    diff_sq: float = 0.0
    ref_sq: float = 0.0
    nonfinite_a: int = 0
    nonfinite_b: int = 0
    same_bits: bool = True
    rule: "_Rule | None" = dataclasses.field(default=None, repr=False)

    def add(self, m: int, mx: float, dsq: float, rsq: float, na: int, nb: int) -> None:
        self.mismatched += m
        self.max_abs = max(self.max_abs, mx)
        self.diff_sq += dsq
        self.ref_sq += rsq
        self.nonfinite_a += na
        self.nonfinite_b += nb

    def merge(self, other: "_Compared") -> "_Compared":
        out = dataclasses.replace(self, same_bits=self.same_bits and other.same_bits)
        out.add(other.mismatched, other.max_abs, other.diff_sq, other.ref_sq, other.nonfinite_a, other.nonfinite_b)
        return out


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How one pair of leaves is compared: the kind, the dtype pieces are reduced in, the tolerance."""

    kind: str
    work: np.dtype | None  # float32 or float64 for the fast float path; None: the exact reference code per piece
    atol: float
    rtol: float

    @staticmethod
    def of(da: np.dtype, db: np.dtype, atol: float, rtol: float) -> "_Rule":
        kinds = {_kind(da), _kind(db)}
        kind = "complex" if "complex" in kinds else ("int" if kinds == {"int"} else "float")
        if kind == "int" and da != db:
            kind = "float" if max(da.itemsize, db.itemsize) < 8 else "int"
        work = None
        if kind == "float":
            narrow = all(d.kind in "fV" and d.itemsize <= 4 for d in (da, db))  # float32, float16, bfloat16, float8
            # The float32 margins assume a normal, finite tolerance (atol 0 too: tolerances that fall among
            # float32's subnormals are then decided in float64, see `_mismatched`); otherwise float64 decides.
            plain = (1e-30 <= atol <= 1e30 or (atol == 0 and rtol >= 1e-30)) and rtol <= 1e30
            work = np.dtype(np.float32) if narrow and plain else np.dtype(np.float64)
        return _Rule(kind, work, float(atol), float(rtol))


def _fold(acc: _Compared, xa: np.ndarray, xb: np.ndarray) -> None:
    """Compare one pair of blocks, a cache-sized piece at a time."""
    rule = acc.rule
    assert rule is not None  # each task's partial starts with its pair's rule (value_diffs)
    fa, fb = np.ravel(xa), np.ravel(xb)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow and NaN are detected from the sums, not warned
        for s in range(0, fa.size, _PIECE_ELEMS):
            _fold_piece(acc, fa[s:s + _PIECE_ELEMS], fb[s:s + _PIECE_ELEMS], rule)


def _fold_piece(acc: _Compared, pa: np.ndarray, pb: np.ndarray, rule: _Rule) -> None:
    identical = False
    if acc.same_bits:  # until one piece differs; then no more bit comparisons for this leaf
        acc.same_bits = identical = bit_identical(pa, pb)  # the one definition, as convert --verify's
    if rule.work is None:
        acc.add(*_block_compare(_as_compared(pa, rule.kind), _as_compared(pb, rule.kind), rule.kind,
                                rule.atol, rule.rtol))
    else:
        _fold_float(acc, pa, pb, rule, identical)


def _fold_float(acc: _Compared, pa: np.ndarray, pb: np.ndarray, rule: _Rule, identical: bool) -> None:
    """One piece of float data in ``rule.work`` (float32 for float32 and narrower): a dozen passes in cache.

    The sums of squares come first: both finite means no NaN or Inf on either
    side and no overflow, so the non-finite bookkeeping is skipped. float32
    tolerance tests are exact: elements within ``_MARGIN`` of the line
    ``|a - b| = atol + rtol * |b|`` are decided again in float64, numpy's rule
    on the float64 values. Anything unusual (non-finite values, sums that
    overflow or underflow float32) takes the exact float64 reference code.
    """
    n = pa.size
    assert rule.work is not None  # _fold_piece comes here only with a work dtype
    bufs = _scratch(rule.work)
    a = pa if pa.dtype == rule.work else _cast(pa, bufs.a[:n])
    if identical:  # same bits: no difference; only |a|^2 and the non-finite counts
        rsq = _sumsq(a)
        if math.isfinite(rsq) and not (rule.work == np.float32 and 0 < rsq < n * 1e-28):
            acc.add(0, 0.0, 0.0, rsq, 0, 0)
            return
        acc.add(*_block_compare(_as_compared(pa, "float"), _as_compared(pb, "float"), "float", rule.atol, rule.rtol))
        return
    b = pb if pb.dtype == rule.work else _cast(pb, bufs.b[:n])
    d = bufs.d[:n]
    np.subtract(a, b, out=d)
    dsq, rsq = _sumsq(d), _sumsq(a)
    if not (math.isfinite(dsq) and math.isfinite(rsq)):  # NaN/Inf on a side, or squares beyond float32
        acc.add(*_block_compare(_as_compared(pa, "float"), _as_compared(pb, "float"), "float", rule.atol, rule.rtol))
        return
    np.abs(d, out=d)
    mx = float(np.maximum.reduce(d))
    if rule.work == np.float32 and (0 < mx < 1e-15 or 0 < rsq < n * 1e-28):  # squares lost in float32 subnormals
        acc.add(*_block_compare(_as_compared(pa, "float"), _as_compared(pb, "float"), "float", rule.atol, rule.rtol))
        return
    acc.add(_mismatched(a, b, d, mx, rule, bufs), mx, dsq, rsq, 0, 0)


def _cast(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    np.copyto(out, x, casting="unsafe")
    return out


def _mismatched(a: np.ndarray, b: np.ndarray, d: np.ndarray, mx: float, rule: _Rule, bufs: Any) -> int:
    """How many of the finite elements lie outside ``|a - b| <= atol + rtol * |b|`` (``d`` holds ``|a - b|``)."""
    n = d.size
    u, t, hi = bufs.u[:n], bufs.t[:n], bufs.hi[:n]
    if rule.work == np.float64:  # numpy's own float64 expression, operation for operation: exact
        if mx <= rule.atol:
            return 0
        np.abs(b, out=u)
        np.multiply(u, rule.rtol, out=t)
        np.add(t, rule.atol, out=t)
        np.greater(d, t, out=hi)
        return int(np.count_nonzero(hi))
    f32 = np.float32
    if mx <= f32(rule.atol * (1 - _MARGIN)):
        return 0
    np.abs(b, out=u)
    np.multiply(u, f32(rule.rtol * (1 + _MARGIN)), out=t)
    np.add(t, f32(rule.atol * (1 + _MARGIN)), out=t)
    np.greater(d, t, out=hi)
    surely = int(np.count_nonzero(hi))  # outside even a slightly wider tolerance
    if surely == n:
        return n
    lo = bufs.lo[:n]
    low = f32(rule.rtol * (1 - _MARGIN))
    np.multiply(u, low, out=t)
    np.add(t, f32(rule.atol * (1 - _MARGIN)), out=t)
    np.greater(d, t, out=lo)
    maybe = int(np.count_nonzero(lo))  # outside a slightly narrower one
    # With atol 0, a tolerance rtol * |b| among float32's subnormals has too few bits for the margin: an element
    # of 0 < |b| < tiny / rtol that differs and is not surely outside is decided in float64 too (|b| = 0 is exact).
    tiny = False
    if rule.atol * (1 - _MARGIN) < _F32_TINY and float(np.minimum.reduce(u)) < _F32_TINY / low:
        # |b|'s bits less one, as unsigned integers (ordered as the floats, with 0 wrapping to the top): their
        # minimum is the smallest nonzero |b|, so the exact zeros of a sparse piece are told apart in two passes.
        below = np.uint32(np.float32(_F32_TINY / low).view(np.uint32) - 1)
        w = t.view(np.uint32)  # t is free now
        np.subtract(u.view(np.uint32), np.uint32(1), out=w)
        if np.minimum.reduce(w) < below:
            small = bufs.small[:n]
            np.less(w, below, out=small)  # 0 < |b| < tiny / rtol
            tiny = True
    if maybe == surely and not tiny:
        return surely
    doubt = lo & ~hi  # within the margin of the line: numpy's rule on the float64 values
    if tiny:
        doubt |= small & (d > 0) & ~hi
    near = np.flatnonzero(doubt)
    xa, xb = a[near].astype(np.float64), b[near].astype(np.float64)
    return surely + int(np.count_nonzero(np.abs(xa - xb) > rule.atol + rule.rtol * np.abs(xb)))


def _result(acc: _Compared, path: str, size: int) -> ValueDiff:
    return ValueDiff(path, acc.max_abs, _rel(acc.diff_sq, acc.ref_sq, acc.max_abs), acc.mismatched == 0,
                     acc.mismatched, size, acc.same_bits, acc.nonfinite_a, acc.nonfinite_b, acc.diff_sq, acc.ref_sq)


def value_diffs(pairs: Sequence[tuple[Leaf, Leaf, str]], *, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
                block_bytes: int = DEFAULT_BLOCK_BYTES, workers: int | None = None,
                progress: Progress | None = None) -> list[ValueDiff]:
    """Compare many pairs of stored arrays of one shape each, on all cores: one ``ValueDiff`` per pair.

    Through the block engine (``treetools.checkpoint_io.stream.reduce_blocks``): each
    pair is one job, both sides read with one block plan (aligned to A's
    storage chunks unless a side streams front to back), each block of each
    side read once and the two sides' reads in flight together; pieces of a
    block are compared in cache (float32 math for float32 and narrower floats,
    with exact tolerance tests). Results merge in block order, so they do not
    depend on timing or on ``workers``.

    Raises:
      ValueError: a pair whose arrays differ in shape.
    """
    rules = []
    jobs = []
    for a, b, _ in pairs:
        ra, rb = a.reader, b.reader
        if ra is None or rb is None or tuple(ra.shape) != tuple(rb.shape):
            raise ValueError(f"`value_diff` needs two array leaves of one shape; got {a.row.shape} and {b.row.shape}.")
        rules.append(_Rule.of(ra.dtype, rb.dtype, atol, rtol))
        jobs.append((ra, rb))
    parts = reduce_blocks(jobs, lambda j: _Compared(rule=rules[j]),
                          lambda acc, index, blocks: _fold(acc, blocks[0], blocks[1]),
                          block_bytes=block_bytes, workers=workers, progress=progress,
                          labels=[p for _, _, p in pairs])
    return [_result(functools.reduce(_Compared.merge, completed(p), _Compared()), path, math.prod(ra.shape))
            for (_, _, path), (ra, _), p in zip(pairs, jobs, parts)]


def value_diff(a: Leaf, b: Leaf, *, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
               block_bytes: int = DEFAULT_BLOCK_BYTES, path: str | None = None) -> ValueDiff:
    """Compare two stored arrays of one shape, streaming both in the same blocks (``value_diffs`` of one pair).

    >>> import numpy as np
    >>> from treetools.checkpoint_io.readers import InMemoryReader
    >>> row = Row(path=("w",), shape=(2,), dtype="float32", params=2, bytes=8)
    >>> a = Leaf(row, InMemoryReader(np.array([1.0, 2.0], np.float32)))
    >>> b = Leaf(row, InMemoryReader(np.array([1.0, np.nan], np.float32)))
    >>> d = value_diff(a, b); (d.allclose, d.mismatched, d.nonfinite_b, d.max_abs_diff)
    (False, 1, 1, inf)
    """
    return value_diffs([(a, b, path or a.name)], atol=atol, rtol=rtol, block_bytes=block_bytes, workers=1)[0]


def _describe(source: Source, step: int | None, item: str | None) -> dict[str, Any]:
    return {"path": source.path, "format": source.format, "step": step, "item": item}


def _snapshot(source: Source, step: Any, item: str | None) -> Snapshot:
    """The snapshot of one side; ``item`` reads only that item.

    A side with a single item that lacks ``item`` (an .npz of params) uses its own.
    """
    if item is None:
        return source.snapshot(step)
    try:
        return source.snapshot(step, [item])
    except FileNotFoundError:
        resolved = source.resolve(step)
        names = source.item_names(resolved)
        if len(names) != 1:
            raise
        return source.snapshot(step, names)


def _items(snap: Snapshot, rules: Rules | None = None) -> dict[str, list[Leaf]]:
    """The leaves of a side per item (through ``rules``: new items, the snapshot is left as read), params first."""
    items = map_items(snap.items, rules) if rules is not None and not rules.empty else snap.items
    return {name: items[name].leaves for name in order_items(list(items))}


def _params_only(snap: Snapshot) -> bool:
    """One item that counts parameters and holds no whole train state (an export: .safetensors, an .npz)."""
    if len(snap.items) != 1:
        return False
    (name, item), = snap.items.items()
    return counts_params(name) and train_state_parts(name, item, [name]) is None


def _holds_more(snap: Snapshot) -> bool:
    """Several items (params, opt_state...), or one holding a whole train state."""
    if len(snap.items) != 1:
        return len(snap.items) > 1
    (name, item), = snap.items.items()
    return train_state_parts(name, item, [name]) is not None


def _pair_params(src_a: Source, snap_a: Snapshot, src_b: Source,
                 snap_b: Snapshot) -> tuple[Snapshot, Snapshot, list[str]]:
    """Without ``item``: where one side holds only params and the other more, the other is narrowed to its params
    as ``convert`` and ``load_parameters`` pick them (``Source.params_item``, ``params_within``): the two sides
    (the narrowed one a new snapshot) and the note saying so (none where no params item is known)."""
    for source, snap, other, (side, only) in ((src_a, snap_a, snap_b, "AB"), (src_b, snap_b, snap_a, "BA")):
        if not (_holds_more(snap) and _params_only(other)):
            continue
        try:
            name = source.params_item(snap.step)
        except CheckpointNotFoundError:
            return snap_a, snap_b, []
        if name not in snap.items:
            return snap_a, snap_b, []
        held = ", ".join(snap.items)
        narrowed = dataclasses.replace(snap, items={name: params_within(snap.items[name])})
        pair = (narrowed, snap_b) if side == "A" else (snap_a, narrowed)
        return (*pair, [f"{only} holds only params and {side} more ({held}): comparing {side}'s params (item "
                        f"{name}); pass --item NAME to compare another item."])
    return snap_a, snap_b, []


def _flat(items: dict[str, list[Leaf]], prefix_items: bool) -> dict[str, tuple[str, Leaf]]:
    """``{pairing key: (name shown, leaf)}``: leaves pair by their path parts joined with ``/``, so a dotted
    stored name (``model.layers.0.weight``, safetensors) pairs with the same path written with ``/`` (msgpack);
    each is shown as stored."""
    out = {}
    for name, leaves in items.items():
        head = f"{name}/" if prefix_items else ""
        for leaf in leaves:
            out[head + "/".join(leaf.path)] = (head + leaf.name, leaf)
    return out


def _same_value(a: Any, b: Any) -> bool:
    try:
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return bool(a == b) and type(a) is type(b)
    except Exception:  # e.g. comparing arrays of different shapes
        return False


def _renamed(row: Row, path: str) -> Row:
    return row if row.name == path else dataclasses.replace(row, path=tuple(path.split("/")), sep="/")


def _keep(names: dict[str, tuple[str, ...]], include: Sequence[str], exclude: Sequence[str]) -> set[str]:
    """The pairing keys to keep: a pattern matches a leaf by any of its names (as stored on either side, the
    ``/`` form, with and without its item)."""
    keys = list(names)
    return {k for k, kept in zip(keys, select_any([names[k] for k in keys], include, exclude)) if kept}


def _group_values(values: list[ValueDiff], rows: dict[str, Row], depth: int) -> list[ValueDiff]:
    """One ``ValueDiff`` per path prefix of ``depth`` parts, the parts ``aggregate_rows`` groups by (a dotted
    stored name splits on ``.``), so value groups are named as the added and removed groups are."""
    groups: dict[str, ValueDiff] = {}
    for v in values:
        row = rows[v.path]
        key = row.sep.join(row.path[:depth])
        groups[key] = groups[key].merge(v, key) if key in groups else dataclasses.replace(v, path=key)
    return list(groups.values())


def sort_values(values: list[ValueDiff], by: str | None) -> list[ValueDiff]:
    """``values`` in ``by`` order: ``path``; ``params``/``bytes`` (the largest first); ``max_abs_diff``,
    ``rel_l2`` or ``outside`` (elements outside the tolerance): the most changed first, ties by path (a leaf where
    a finite value became NaN or Inf has both ``max_abs_diff`` and ``rel_l2`` infinite: it comes first).

    >>> v = [ValueDiff("a", 0.1, 0.5, False, 3, 10), ValueDiff("b", 0.2, 0.1, False, 1, 10)]
    >>> [x.path for x in sort_values(v, "rel_l2")], [x.path for x in sort_values(v, "max_abs_diff")]
    (['a', 'b'], ['b', 'a'])
    """
    keys = {"path": lambda v: v.path, "params": lambda v: (-v.size, v.path), "bytes": lambda v: (-v.size, v.path),
            "max_abs_diff": lambda v: (-v.max_abs_diff, v.path), "rel_l2": lambda v: (-v.rel_l2, v.path),
            "outside": lambda v: (-v.mismatched, -v.outside_fraction, v.path)}
    if by is None:
        return list(values)
    if by not in keys:
        raise ValueError(f"`sort` must be one of {', '.join(keys)}; got {by!r}.")
    return sorted(values, key=keys[by])


def check_arguments(opts: DiffOptions) -> None:
    """Refuse options that cannot work together, before anything is read.

    Raises:
      UsageError: a step of ``all`` (diff compares one step with another), or a value sort without ``values``.

    >>> check_arguments(DiffOptions(sort="rel_l2"))
    Traceback (most recent call last):
    ...
    treetools.shared.errors.UsageError: --sort rel_l2 (`sort='rel_l2'`) orders the value comparisons; add --values
    (`values=True`).
    """
    if "all" in (opts.step, opts.step_a, opts.step_b):
        raise UsageError("--step all is for `inspect`; diff compares one step with another")
    if opts.sort in VALUE_SORTS and not opts.values:
        raise UsageError(f"--sort {opts.sort} (`sort={opts.sort!r}`) orders the value comparisons; add --values "
                         "(`values=True`).")


def diff_paths(a: str, b: str, options: DiffOptions | None = None, /, **fields: Any) -> DiffReport:
    """Compare two checkpoints of any formats, or two steps of one run.

    Items are paired by name; when each side has exactly one item (or
    ``item`` picks one) they are paired whatever their names, so an Orbax
    ``params`` item compares with an ``.npz`` of the same tree. Without
    ``item``, where one side holds only params (an export) and the other
    more (a run's step: params, opt_state...), the other side's params are
    compared, picked as ``convert`` picks them, and a note says so. With
    several items, paths are shown as ``item/path``. ``rules`` map A's leaves first
    (a checkpoint compared with the renamed, transposed export made from it).

    Args:
      a, b: checkpoint paths (B may equal A, with different steps).
      options: a ``DiffOptions`` (step, step_a, step_b, item, values, atol,
        rtol, include, exclude, depth, sort, block_bytes, memory_budget).
      **fields: the same fields as keywords (``diff_paths(a, b, values=True)``), over ``options``.

    Returns:
      A ``DiffReport``; ``DiffReport.identical`` says whether nothing differs.

    Raises:
      UsageError: options that cannot work together (``check_arguments``).

    >>> import numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp(); fa, fb = os.path.join(d, "a.npz"), os.path.join(d, "b.npz")
    >>> np.savez(fa, w=np.ones(3, np.float32)); np.savez(fb, w=np.ones(4, np.float32), v=np.ones(1))
    >>> r = diff_paths(fa, fb)
    >>> [x.name for x in r.added], [c.fields for c in r.changed], r.identical
    (['v'], [['shape']], False)
    """
    opts = resolve(DiffOptions, options, fields)
    check_arguments(opts)
    row_sort = None if opts.sort in VALUE_SORTS else opts.sort  # added/removed leaves have no values
    step, step_a, step_b, item = opts.step, opts.step_a, opts.step_b, opts.item
    include, exclude = opts.include, opts.exclude
    context = opts.read_context()
    src_a, src_b = open_source(a, context), open_source(b, context)
    if step is not None and step != "latest" and src_a.steps is None and src_b.steps is None:
        raise CheckpointError(f"step {step}: neither {src_a.path} nor {src_b.path} is a checkpoint root with steps.")
    snap_a = _snapshot(src_a, step_a if step_a is not None else (step if src_a.steps is not None else None), item)
    snap_b = _snapshot(src_b, step_b if step_b is not None else (step if src_b.steps is not None else None), item)
    snap_a, snap_b, notes = _pair_params(src_a, snap_a, src_b, snap_b) if item is None else (snap_a, snap_b, [])
    items_a, items_b = _items(snap_a, opts.rules), _items(snap_b)
    single = len(items_a) == 1 and len(items_b) == 1
    if not single and 1 in (len(items_a), len(items_b)):
        notes.append(f"A has items {', '.join(items_a)} and B {', '.join(items_b)}: paths are joined as item/path; "
                     "pass --item NAME to compare one item with the other side's tree.")
    named_a, named_b = _flat(items_a, not single), _flat(items_b, not single)
    if include or exclude:
        names: dict[str, tuple[str, ...]] = {}
        for side in (named_a, named_b):
            for key, (label, leaf) in side.items():
                names[key] = tuple(dict.fromkeys([*names.get(key, ()), label, key, leaf.name]))
        keep = _keep(names, include, exclude)
        named_a = {k: v for k, v in named_a.items() if k in keep}
        named_b = {k: v for k, v in named_b.items() if k in keep}
    shown = {k: name for k, (name, _) in named_b.items()} | {k: name for k, (name, _) in named_a.items()}
    flat_a = {shown[k]: leaf for k, (_, leaf) in named_a.items()}
    flat_b = {shown[k]: leaf for k, (_, leaf) in named_b.items()}
    compare_sharding = snap_a.record_sharding and snap_b.record_sharding
    added = [_renamed(flat_b[p].row, p) for p in flat_b if p not in flat_a]
    removed = [_renamed(flat_a[p].row, p) for p in flat_a if p not in flat_b]
    changed: list[LeafChange] = []
    same_shape: list[str] = []
    for p in (p for p in flat_a if p in flat_b):
        la, lb = flat_a[p], flat_b[p]
        ra, rb = la.row, lb.row
        differ = [f for f in ("shape", "dtype") if getattr(ra, f) != getattr(rb, f)]
        if compare_sharding and not _same_sharding(ra.sharding, rb.sharding):
            differ.append("sharding")
        va, vb = la.value, lb.value
        if va is not NO_VALUE and vb is not NO_VALUE and not _same_value(va, vb):
            differ.append("value")
        if differ:
            changed.append(LeafChange(p, ra, rb, differ, va, vb))
        if (la.reader is not None and lb.reader is not None and tuple(la.reader.shape) == tuple(lb.reader.shape)
                and is_numeric(la.reader.dtype) and is_numeric(lb.reader.dtype)):
            same_shape.append(p)
    report = DiffReport(
        a=_describe(src_a, snap_a.step, next(iter(items_a)) if len(items_a) == 1 else item),
        b=_describe(src_b, snap_b.step, next(iter(items_b)) if len(items_b) == 1 else item),
        added=sort_rows(aggregate_rows(added, opts.depth), row_sort),
        removed=sort_rows(aggregate_rows(removed, opts.depth), row_sort),
        changed=changed,
        unchanged=sum(1 for p in flat_a if p in flat_b) - len(changed),
        atol=opts.atol,
        rtol=opts.rtol,
        notes=notes,
        depth=opts.depth,
        unread_a=list(snap_a.unreadable),
        unread_b=list(snap_b.unreadable),
        allow_unread=opts.allow_unread,
    )
    if opts.values:
        pairs = [(flat_a[p], flat_b[p], p) for p in same_shape]
        bar = Progress(sum(leaf.row.bytes for a_leaf, b_leaf, _ in pairs for leaf in (a_leaf, b_leaf)),
                       enabled=opts.progress)
        try:
            diffs = value_diffs(pairs, atol=opts.atol, rtol=opts.rtol, block_bytes=context.block_bytes, progress=bar)
        finally:
            bar.close()
        if opts.depth is not None:
            diffs = _group_values(diffs, {p: _renamed(flat_a[p].row, p) for p in same_shape}, opts.depth)
        report = dataclasses.replace(report, values=sort_values(diffs, opts.sort))
    return report


def _same_sharding(a: Any, b: Any) -> bool:
    if a is None and b is None:
        return True
    if a is None:
        return a is b or b.same_layout(None)
    return a.same_layout(b)
