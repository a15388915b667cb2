"""``diff_paths``: what changed between two checkpoints, from metadata and optionally values.

Leaves are joined by path string. Metadata alone gives the leaves added (only
in B), removed (only in A) and changed in shape, dtype or sharding (sharding
only when both formats record it, i.e. Orbax on both sides). With
``values=True`` every leaf present in both with the same shape is streamed
block by block from both sides at once: the maximum absolute difference, the
relative L2 difference ``||a - b|| / ||a||`` and an ``allclose`` verdict with
numpy's rule ``|a - b| <= atol + rtol * |b|`` (NaN equals NaN).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from treetools.inspect._base import DEFAULT_CHUNK_BYTES, NO_VALUE, CheckpointError, Leaf, is_numeric, jsonable, plan_blocks
from treetools.inspect.readers import Source, open_checkpoint, select_item
from treetools.inspect.report import json_safe
from treetools.table import Row

__all__ = ["DiffReport", "LeafChange", "ValueDiff", "diff_paths", "render_diff", "value_diff"]


@dataclasses.dataclass
class LeafChange:
    """A leaf in both checkpoints whose metadata differs; ``fields`` names what changed.

    ``value`` is among the fields when a non-array leaf whose value the
    metadata carries (a JSON item entry, a msgpack scalar) differs.
    """

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


@dataclasses.dataclass
class ValueDiff:
    """Value comparison of one leaf present in both checkpoints with the same shape."""

    path: str
    max_abs_diff: float
    rel_l2: float
    allclose: bool
    mismatched: int
    size: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class DiffReport:
    """What ``treetools diff`` prints, as data."""

    a: dict[str, Any]
    b: dict[str, Any]
    added: list[Row]
    removed: list[Row]
    changed: list[LeafChange]
    unchanged: int
    values: list[ValueDiff] | None = None
    atol: float = 1e-8
    rtol: float = 1e-5
    notes: list[str] = dataclasses.field(default_factory=list)
    """Diagnostics for stderr (e.g. a hint to pass ``item``); not part of the JSON object."""

    @property
    def identical(self) -> bool:
        """No leaf added, removed or changed, and (with values) every compared leaf allclose."""
        same_values = self.values is None or all(v.allclose for v in self.values)
        return not (self.added or self.removed or self.changed) and same_values

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "added": [r.to_json() for r in self.added],
            "removed": [r.to_json() for r in self.removed],
            "changed": [c.to_json() for c in self.changed],
            "unchanged": self.unchanged,
        }
        if self.values is not None:
            out["atol"], out["rtol"] = self.atol, self.rtol
            out["values"] = [v.to_json() for v in self.values]
        return json_safe(out)


def _flat(items: dict[str, list[Leaf]], prefix_items: bool) -> dict[str, Leaf]:
    return {(f"{name}/{leaf.row.path}" if prefix_items else leaf.row.path): leaf
            for name, leaves in items.items() for leaf in leaves}


def value_diff(a: Leaf, b: Leaf, *, atol: float = 1e-8, rtol: float = 1e-5,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, path: str | None = None) -> ValueDiff:
    """Compare two stored arrays of one shape, streaming both in the same blocks.

    Both readers follow one block plan (aligned to A's storage chunks unless a
    side can only stream front to back), so the peak memory is two blocks.

    >>> import numpy as np
    >>> from treetools.inspect._base import InMemoryReader
    >>> from treetools.table import Row
    >>> row = Row(path="w", shape=(2,), dtype="float32", params=2, bytes=8)
    >>> a = Leaf(row, InMemoryReader(np.array([1.0, 2.0], np.float32)))
    >>> b = Leaf(row, InMemoryReader(np.array([1.0, 2.5], np.float32)))
    >>> d = value_diff(a, b); (d.max_abs_diff, d.allclose, d.mismatched)
    (0.5, False, 1)
    """
    ra, rb = a.reader, b.reader
    if ra is None or rb is None or a.row.shape != b.row.shape:
        raise ValueError(f"`value_diff` needs two array leaves of one shape; got {a.row.shape} and {b.row.shape}.")
    shape = tuple(a.row.shape or ())
    itemsize = max(ra.dtype.itemsize, rb.dtype.itemsize, 8)
    granule = None if (ra.sequential or rb.sequential) else ra.chunk_shape
    plan = list(plan_blocks(shape, max(1, chunk_bytes // itemsize), granule))
    max_abs = 0.0
    diff_sq = ref_sq = 0.0
    mismatched = 0
    for xa, xb in zip(ra.blocks(plan), rb.blocks(plan)):
        fa = np.ravel(xa).astype(np.float64)
        fb = np.ravel(xb).astype(np.float64)
        close = np.isclose(fa, fb, rtol=rtol, atol=atol, equal_nan=True)
        mismatched += int(close.size - np.count_nonzero(close))
        both = np.isfinite(fa) & np.isfinite(fb)
        d = np.abs(fa[both] - fb[both]) if not both.all() else np.abs(fa - fb)
        if d.size:
            max_abs = max(max_abs, float(d.max()))
            diff_sq += float(np.dot(d, d))
        ref = fa[np.isfinite(fa)]
        ref_sq += float(np.dot(ref, ref))
    diff_l2 = math.sqrt(diff_sq)
    ref_l2 = math.sqrt(ref_sq)
    rel = diff_l2 / ref_l2 if ref_l2 > 0 else (0.0 if diff_l2 == 0 else math.inf)
    return ValueDiff(path or a.row.path, max_abs, rel, mismatched == 0, mismatched, int(np.prod(shape)))


def _describe(source: Source, step: int | None, item: str | None) -> dict[str, Any]:
    return {"path": source.path, "format": source.format, "step": step, "item": item}


def _pick_items(items: dict[str, list[Leaf]], item: str | None, where: str) -> dict[str, list[Leaf]]:
    """``item`` of one side (``select_item``); a single-item side without it (an .npz of params) uses its own."""
    if item is None:
        return items
    try:
        return select_item(items, item, where=where)
    except CheckpointError:
        if len(items) == 1:
            return items
        raise


def diff_paths(
    a: str,
    b: str,
    *,
    step: int | str | None = None,
    step_a: int | str | None = None,
    step_b: int | str | None = None,
    item: str | None = None,
    values: bool = False,
    atol: float = 1e-8,
    rtol: float = 1e-5,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> DiffReport:
    """Compare two checkpoints of any formats, or two steps of one run.

    Items are paired by name; when each side has exactly one item (or
    ``item`` picks one) they are paired whatever their names, so an Orbax
    ``params`` item compares with an ``.npz`` of the same tree. With several
    items, paths are shown as ``item/path``.

    Args:
      a, b: checkpoint paths (B may equal A, with different steps).
      step: the step of each side that is a CheckpointManager root (None: latest).
      step_a, step_b: the step of A / of B, overriding ``step`` (the side must be a root).
      item: compare only this item (a side with a single item uses that one).
      values: also compare values (streamed in blocks of ``chunk_bytes``).
      atol, rtol: the ``allclose`` tolerances.

    Returns:
      A ``DiffReport``; ``DiffReport.identical`` says whether nothing differs.

    >>> import numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp(); fa, fb = os.path.join(d, "a.npz"), os.path.join(d, "b.npz")
    >>> np.savez(fa, w=np.ones(3, np.float32)); np.savez(fb, w=np.ones(4, np.float32), v=np.ones(1))
    >>> r = diff_paths(fa, fb)
    >>> [x.path for x in r.added], [c.fields for c in r.changed]
    (['v'], [['shape']])
    """
    src_a, src_b = open_checkpoint(a), open_checkpoint(b)
    if step is not None and step != "latest" and src_a.steps is None and src_b.steps is None:
        raise CheckpointError(f"--step {step}: neither {src_a.path} nor {src_b.path} is a CheckpointManager root.")
    snap_a = src_a.snapshot(step_a if step_a is not None else (step if src_a.steps is not None else None))
    snap_b = src_b.snapshot(step_b if step_b is not None else (step if src_b.steps is not None else None))
    items_a = _pick_items(snap_a.items, item, src_a.path)
    items_b = _pick_items(snap_b.items, item, src_b.path)
    single = len(items_a) == 1 and len(items_b) == 1
    notes = []
    if not single and 1 in (len(items_a), len(items_b)):
        notes.append(f"A has items {', '.join(items_a)} and B {', '.join(items_b)}: paths are joined as item/path; "
                     "pass --item NAME to compare one item with the other side's tree.")
    if single:
        flat_a, flat_b = _flat(items_a, False), _flat(items_b, False)
    else:
        flat_a, flat_b = _flat(items_a, True), _flat(items_b, True)
    compare_sharding = snap_a.record_sharding and snap_b.record_sharding
    added = [_renamed(flat_b[p].row, p) for p in flat_b if p not in flat_a]
    removed = [_renamed(flat_a[p].row, p) for p in flat_a if p not in flat_b]
    changed: list[LeafChange] = []
    same_shape: list[str] = []
    for p in (p for p in flat_a if p in flat_b):
        ra, rb = flat_a[p].row, flat_b[p].row
        fields = [f for f in ("shape", "dtype") if getattr(ra, f) != getattr(rb, f)]
        sa = ra.sharding.to_json() if ra.sharding is not None else None
        sb = rb.sharding.to_json() if rb.sharding is not None else None
        if compare_sharding and sa != sb:
            fields.append("sharding")
        va, vb = flat_a[p].value, flat_b[p].value
        if va is not NO_VALUE and vb is not NO_VALUE and not _same_value(va, vb):
            fields.append("value")
        if fields:
            changed.append(LeafChange(p, ra, rb, fields, va, vb))
        la, lb = flat_a[p], flat_b[p]
        if (ra.shape is not None and ra.shape == rb.shape and la.reader is not None and lb.reader is not None
                and is_numeric(la.reader.dtype) and is_numeric(lb.reader.dtype)):
            same_shape.append(p)
    report = DiffReport(
        a=_describe(src_a, snap_a.step, next(iter(items_a)) if len(items_a) == 1 else item),
        b=_describe(src_b, snap_b.step, next(iter(items_b)) if len(items_b) == 1 else item),
        added=added,
        removed=removed,
        changed=changed,
        unchanged=sum(1 for p in flat_a if p in flat_b) - len(changed),
        atol=atol,
        rtol=rtol,
        notes=notes,
    )
    if values:
        report.values = [
            value_diff(flat_a[p], flat_b[p], atol=atol, rtol=rtol, chunk_bytes=chunk_bytes, path=p) for p in same_shape
        ]
    return report


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # e.g. comparing arrays of different shapes
        return False


def _renamed(row: Row, path: str) -> Row:
    return row if row.path == path else dataclasses.replace(row, path=path)


def render_diff(report: DiffReport, fmt: str = "table") -> str:
    """Render a ``DiffReport`` as ``table``, ``markdown`` or ``json``; the last line of a table is the verdict.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "a.npz"); np.savez(f, w=np.ones(3))
    >>> render_diff(diff_paths(f, f, values=True)).splitlines()[-1]
    'identical: 0 added, 0 removed, 0 changed, 1 unchanged in metadata; 0 of 1 compared leaves not allclose'
    """
    if fmt == "json":
        return json.dumps(report.to_json(), indent=2, allow_nan=False)
    if fmt not in ("table", "markdown"):
        raise ValueError(f"`fmt` must be one of table, markdown, json; got {fmt!r}.")
    from tabulate import tabulate

    md = fmt == "markdown"

    def side(d: dict[str, Any]) -> str:
        extra = [f"step {d['step']}"] if d["step"] is not None else []
        extra += [f"item {d['item']}"] if d["item"] else []
        return f"{d['path']} ({', '.join([d['format'], *extra])})"

    def shape(r: Row) -> str:
        return "" if r.shape is None else str(list(r.shape))

    def shown(r: Row, field: str, value: Any) -> str:
        if field == "value":
            return json.dumps(jsonable(value))
        return shape(r) if field == "shape" else str(getattr(r, field) if getattr(r, field) is not None else "-")

    def table(data: list[list[str]], headers: list[str]) -> str:
        return tabulate(data, headers=headers, tablefmt="github" if md else "simple", disable_numparse=True)

    sections: list[tuple[str, str | None]] = []
    for title, rows in (("added (only in B)", report.added), ("removed (only in A)", report.removed)):
        if rows:
            sections.append((f"{title}: {len(rows)}", table([[r.path, shape(r), r.dtype or "", f"{r.params:,}"]
                                                               for r in rows], ["path", "shape", "dtype", "params"])))
    if report.changed:
        data = [[c.path, f, shown(c.a, f, c.value_a), shown(c.b, f, c.value_b)] for c in report.changed for f in c.fields]
        sections.append((f"changed: {len(report.changed)}", table(data, ["path", "field", "A", "B"])))
    if report.values is not None:
        diffs = [v for v in report.values if not v.allclose or v.max_abs_diff > 0]
        body = table([[v.path, f"{v.max_abs_diff:.4g}", f"{v.rel_l2:.4g}", str(v.allclose), f"{v.mismatched:,}"]
                      for v in diffs], ["path", "max_abs_diff", "rel_l2", "allclose", "mismatched"]) if diffs else None
        sections.append((f"values: {len(report.values)} leaves compared (atol={report.atol:g}, rtol={report.rtol:g}), "
                         f"{len(diffs)} differ", body))
    verdict = "identical" if report.identical else "different"
    line = (f"{verdict}: {len(report.added)} added, {len(report.removed)} removed, "
            f"{len(report.changed)} changed, {report.unchanged} unchanged")
    if report.values is not None:
        line += (f" in metadata; {sum(not v.allclose for v in report.values)} of {len(report.values)} "
                 "compared leaves not allclose")
    out = [f"- A: {side(report.a)}", f"- B: {side(report.b)}"] if md else [f"A: {side(report.a)}", f"B: {side(report.b)}"]
    for title, body in sections:
        # Markdown needs a blank line between a paragraph and a table.
        out += ["", title, *([""] if md and body else []), *([body] if body else [])]
    out += ["", line]
    return "\n".join(out)
