"""``inspect_path``: a checkpoint's rows per step and item, filtered, summed, with stats.

The report is data; ``treetools.render.render_report`` turns it into the
terminal table, markdown, an indented tree, or the versioned JSON object
(``Report.to_json``, schema 2, documented in ``docs/json-schema.md``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

from treetools.errors import CheckpointError, StepDeletedError
from treetools.inspect.arrays import DEFAULT_CHUNK_BYTES, MemoryBudgetError, block_extent, is_numeric, memory_budget
from treetools.inspect.source import NO_VALUE, Item, Leaf, Snapshot, jsonable, open_source
from treetools.inspect.stats import Progress, StatsAccumulator, compute_stats
from treetools.paths import compile_patterns, match_patterns  # string helpers: no jax
from treetools.render import json_safe, render_report
from treetools.steps import parse_step
from treetools.rows import Row, Totals, aggregate_rows, common_prefix, human, sort_rows, totals

__all__ = ["ItemReport", "Report", "SCHEMA", "StepReport", "inspect_path", "json_safe", "order_items", "render_report"]

SCHEMA = 2
"""Version of the ``--format json`` object; bumped on any incompatible change."""

_ITEM_ORDER = ("params", "params_ema", "ema_params", "target", "opt_state", "state")


def order_items(names: Sequence[str]) -> list[str]:
    """Params first, then EMA params, then optimizer state, then the rest in stored order.

    >>> order_items(["data_iter", "opt_state", "params_ema", "params"])
    ['params', 'params_ema', 'opt_state', 'data_iter']
    """
    first = [n for n in _ITEM_ORDER if n in names]
    return first + [n for n in names if n not in first]


@dataclasses.dataclass
class ItemReport:
    """One item of one step: the rows shown and the totals of the leaves behind them.

    ``values`` holds the values of non-array leaves that the checkpoint stores
    in its metadata (JSON items, msgpack scalars), by path; ``meshes`` the
    distinct meshes (axis name -> size) of the sharded leaves; ``value`` the
    whole value of a JSON item.
    """

    rows: list[Row]
    total: Totals
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    meshes: list[dict[str, int]] = dataclasses.field(default_factory=list)
    kind: str = "pytree"
    value: Any = NO_VALUE

    @classmethod
    def of(cls, item: Item, leaves: Sequence[Leaf], rows: list[Row]) -> "ItemReport":
        """The report of ``leaves`` (filtered, before aggregation) of ``item``, shown as ``rows``."""
        leaf_rows = [leaf.row for leaf in leaves]
        meshes = [dict(m) for m in {tuple(r.sharding.mesh.items()): 0 for r in leaf_rows
                                    if r.sharding is not None and r.sharding.mesh}]
        values = {leaf.name: leaf.value for leaf in leaves if leaf.row.shape is None and leaf.value is not NO_VALUE}
        value = item.handle if item.kind == "json" else NO_VALUE
        return cls(rows, totals(leaf_rows), values, meshes, item.kind, value)

    def to_json(self) -> dict[str, Any]:
        out = {**self.total.to_json(), "leaves": [r.to_json() for r in self.rows]}
        if self.kind == "json":
            out["value"] = jsonable(self.value)
        return out


@dataclasses.dataclass
class StepReport:
    """One step (or the one checkpoint): its saved metadata and items."""

    step: int | None
    items: dict[str, ItemReport]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> Totals:
        out = Totals(0, 0, {})
        for item in self.items.values():
            out = out + item.total
        return out

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "metadata": jsonable(self.metadata),
                "items": {name: item.to_json() for name, item in self.items.items()}}


@dataclasses.dataclass
class Report:
    """What ``treetools inspect`` prints, as data.

    ``steps`` is None for a single checkpoint; ``step`` is the step shown
    (None for a single checkpoint, and with ``all_steps``); ``by_step`` holds
    one ``StepReport`` per step shown; ``nonfinite`` lists ``item/path`` of
    leaves with NaN or Inf (filled by ``stats=True``).
    """

    path: str
    format: str
    steps: list[int] | None
    incomplete: list[str]
    step: int | None
    by_step: list[StepReport]
    all_steps: bool = False
    stats: bool = False
    nonfinite: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    depth: int | None = None
    leaves: bool = False
    grouped_at: int | None = None
    """The depth the summary view chose to fit ``rows_per_item`` (None: every leaf, or ``depth`` was given)."""

    def to_json(self) -> dict[str, Any]:
        """The versioned object of ``docs/json-schema.md``; non-finite floats become ``null``."""
        return json_safe({
            "schema": SCHEMA,
            "path": self.path,
            "format": self.format,
            "steps": self.steps,
            "incomplete": self.incomplete,
            "checkpoints": [s.to_json() for s in self.by_step],
        })


def _filter(snaps: Sequence[Snapshot], include: Sequence[str], exclude: Sequence[str]) -> list[dict[str, list[Leaf]]]:
    """Keep leaves that match an ``include`` pattern and no ``exclude`` pattern.

    Patterns are checked against every leaf of every shown item and step: one
    that matches nothing anywhere is an error naming it. Items left without a
    leaf are dropped (``--include`` asks to see the matches, not every item).
    """
    if not include and not exclude:
        return [{name: item.leaves for name, item in s.items.items()} for s in snaps]
    inc = compile_patterns(list(include), name="include")
    exc = compile_patterns(list(exclude), name="exclude")
    # Match each distinct path once: items and steps repeat the same paths.
    paths = list(dict.fromkeys(leaf.name for s in snaps for item in s.items.values() for leaf in item.leaves))
    keep = dict(zip(paths, match_patterns(paths, inc, name="include") if inc else [True] * len(paths)))
    if exc:
        for path, dropped in zip(paths, match_patterns(paths, exc, name="exclude")):
            keep[path] = keep[path] and not dropped
    out: list[dict[str, list[Leaf]]] = []
    for s in snaps:
        kept = {name: [leaf for leaf in item.leaves if keep[leaf.name]] for name, item in s.items.items()}
        out.append({name: leaves for name, leaves in kept.items() if leaves})
    return out


def _with_stats(rows: list[Row], accs: dict[tuple[str, ...], StatsAccumulator]) -> list[Row]:
    """Attach statistics; a group row gets its members' streams merged."""
    groups: dict[tuple[str, ...], StatsAccumulator] = {}
    for r in rows:
        members = [acc for path, acc in accs.items() if path[:len(r.path)] == r.path]
        if members:
            acc = members[0]
            for other in members[1:]:
                acc = acc.merge(other)
            groups[r.path] = acc
    return [dataclasses.replace(r, stats=groups[r.path].result()) if r.path in groups else r for r in rows]


def auto_depth(rows: Sequence[Row], offset: int, budget: int) -> int | None:
    """The deepest grouping (counted below ``offset``) that shows at most ``budget`` rows; None when all fit.

    >>> rows = [Row(("a", str(i), "w"), (1,), "float32", 1, 4) for i in range(30)]
    >>> auto_depth(rows, 0, 10), auto_depth(rows, 0, 40)
    (1, None)
    """
    if len(rows) <= budget:
        return None
    deepest = max((len(r.path) - offset for r in rows), default=1)
    best = 1
    for depth in range(1, max(deepest, 1) + 1):
        if len({r.path[:offset + depth] for r in rows}) <= budget:
            best = depth
        else:
            break
    return best


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def collapse_numbered(rows: Sequence[Row], offset: int = 0) -> list[Row]:
    """Merge sibling rows that differ only by one numbered path part (``layers_0/attn`` .. ``layers_23/attn``).

    The merged row is named ``layers_0..23/attn`` and sums its members; the
    summary view uses it when grouping alone cannot fit an item on a screen
    (24 layers named ``layers_N`` are 24 rows at any depth). Runs of fewer than
    three are left alone.

    >>> rows = [Row(("layers_" + str(i), "w"), None, "float32", 4, 16, leaves=2) for i in range(3)] + [Row(("head",), (2,), "float32", 2, 8)]
    >>> [(r.name, r.params, r.leaves) for r in collapse_numbered(rows)]
    [('layers_0..2/w', 12, 6), ('head', 2, 1)]
    """

    def key(r: Row) -> tuple | None:
        for k, part in enumerate(r.path[offset:], offset):
            m = _NUMBERED.match(part)
            if m:
                return (k, r.path[:k], m.group(1), r.path[k + 1:])
        return None

    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        k = key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    out: list[Row] = []
    done: set[tuple] = set()
    for r in rows:
        k = key(r)
        if k is None or len(groups[k]) < 3:
            out.append(r)
            continue
        if k in done:
            continue
        done.add(k)
        pos, head, stem, tail = k
        numbers = sorted(int(_NUMBERED.match(x.path[pos]).group(2)) for x in groups[k])
        path = head + (f"{stem}{numbers[0]}..{numbers[-1]}",) + tail
        merged = aggregate_rows([dataclasses.replace(x, path=path) for x in groups[k]], len(path))
        out.extend(dataclasses.replace(x, shape=None, sharding=None) for x in merged)
    return out


def summary_rows(rows: Sequence[Row], offset: int, budget: int, *, collapse: bool = True) -> tuple[list[Row], int]:
    """The rows of the one-screen view and their depth: the deepest grouping (below ``offset``) that
    fits ``budget`` rows, numbered siblings (``layers_0..23``) merged when ``collapse``; depth 1 if none fits."""
    deepest = max((len(r.path) - offset for r in rows), default=1)
    for depth in range(max(deepest - 1, 1), 0, -1):
        grouped = aggregate_rows(rows, depth, offset=offset)
        if collapse and len(grouped) > budget:
            grouped = collapse_numbered(grouped, offset)
        if len(grouped) <= budget or depth == 1:
            return grouped, depth
    return aggregate_rows(rows, 1, offset=offset), 1


def inspect_path(
    path: str,
    *,
    step: int | str | None = None,
    item: str | None = None,
    depth: int | None = None,
    leaves: bool = False,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    sort: str | None = None,
    stats: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool | None = None,
    rows_per_item: int | None = None,
) -> Report:
    """Inspect a checkpoint from its metadata (and, with ``stats``, its data in bounded blocks).

    Args:
      path: any checkpoint a registered format reads (an Orbax root, step or
        item folder, a Flax msgpack file, a ``.safetensors``, an ``.npz``...).
      step: a step number, ``"latest"`` (default) or ``"all"``; roots only.
      item: show only this item (e.g. ``params``); only its metadata is read.
      depth: one row per path prefix of ``depth`` parts below the item's
        shared prefix, summed.
      leaves: one row per leaf (no grouping).
      include: regexes (``re.search`` on path strings); keep leaves matching any.
      exclude: regexes; drop leaves matching any. A pattern that matches no leaf is an error.
      sort: ``path``, ``params`` or ``bytes``; default stored order.
      stats: stream every array and attach mean, std, min, max, l2, abs_max,
        zeros, nan, posinf, neginf.
      chunk_bytes: the block budget for ``stats``.
      progress: draw a progress bar on stderr (default: when stderr is a terminal).
      rows_per_item: without ``depth`` or ``leaves``, group an item's rows at
        the deepest level that keeps it to this many rows (the CLI's one-screen
        summary); None shows every leaf.

    Returns:
      A ``Report``; ``Report.to_json()`` is the ``--format json`` object.

    Raises:
      CheckpointNotFoundError: missing path, unknown step or item.
      CheckpointError: not a checkpoint, corrupt or unreadable.
      PatternError: a bad or unmatched include/exclude pattern.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, **{"a/x/w": np.ones((2, 3), np.float32), "a/x/b": np.zeros(3, np.float32), "a/y": np.ones(2)})
    >>> [(r["path"], r["params"]) for r in inspect_path(f, depth=1).to_json()["checkpoints"][0]["items"]["default"]["leaves"]]
    [('a/x', 9), ('a/y', 2)]
    """
    if depth is not None and depth < 1:
        raise ValueError(f"`depth` must be a positive integer, got {depth}.")
    args = dict(step=step, item=item, depth=depth, leaves=leaves, include=include, exclude=exclude, sort=sort,
                stats=stats, chunk_bytes=chunk_bytes, progress=progress, rows_per_item=rows_per_item)
    try:
        return _inspect(path, **args)
    except StepDeletedError as e:
        if parse_step(step, allow_all=True) not in (None, -1):
            raise
        # The latest step went while it was read (a manager saved a newer one and pruned it): once more.
        report = _inspect(path, **args)
        report.notes.insert(0, f"{e} Read again: showing step {report.step}.")
        return report


def _inspect(
    path: str,
    *,
    step: int | str | None,
    item: str | None,
    depth: int | None,
    leaves: bool,
    include: Sequence[str],
    exclude: Sequence[str],
    sort: str | None,
    stats: bool,
    chunk_bytes: int,
    progress: bool | None,
    rows_per_item: int | None,
) -> Report:
    source = open_source(path)
    all_steps = step == "all"
    wanted = [item] if item is not None else None
    if all_steps:
        if source.steps is None:
            raise CheckpointError(f"{source.path}: a single checkpoint, not a checkpoint root; `all` steps needs a root.")
        snaps = [source.snapshot(s, wanted) for s in source.steps]
    else:
        snaps = [source.snapshot(step, wanted)]
    for s in snaps:
        s.items = {name: s.items[name] for name in order_items(list(s.items))}
    notes = list(dict.fromkeys(n for s in snaps for n in s.notes))
    kept = _filter(snaps, include, exclude)
    accs: list[dict[str, dict[tuple[str, ...], StatsAccumulator]]] = [{} for _ in snaps]
    nonfinite: list[str] = []
    if stats:
        try:
            accs, nonfinite = _compute_stats(kept, snaps, chunk_bytes, progress)
        except (CheckpointError, OSError):
            for s in snaps:  # a step deleted while its arrays were read: say so, not "cannot read chunk"
                gone = source.step_deleted(s.step)
                if gone is not None:
                    raise gone from None
            raise
    by_step = []
    grouped_at = None
    for i, s in enumerate(snaps):
        items = {}
        for name, item_leaves in kept[i].items():
            leaf_rows = [leaf.row for leaf in item_leaves]
            offset = len(common_prefix(leaf_rows))
            group = None if leaves else depth
            if group is None and not leaves and rows_per_item is not None and len(leaf_rows) > rows_per_item:
                rows, group = summary_rows(leaf_rows, offset, rows_per_item, collapse=not stats)
                grouped_at = max(grouped_at or 0, group)
            else:
                rows = aggregate_rows(leaf_rows, group, offset=offset)
            if stats:
                rows = _with_stats(rows, accs[i].get(name, {}))
            items[name] = ItemReport.of(s.items[name], item_leaves, sort_rows(rows, sort))
        by_step.append(StepReport(s.step, items, s.metadata))
    return Report(
        path=source.path,
        format=source.format,
        steps=source.steps,
        incomplete=source.incomplete,
        step=None if all_steps else snaps[0].step,
        by_step=by_step,
        all_steps=all_steps,
        stats=stats,
        nonfinite=nonfinite,
        notes=notes,
        depth=depth,
        leaves=leaves,
        grouped_at=grouped_at,
    )


def _compute_stats(kept, snaps, chunk_bytes, progress):
    todo = [(i, name, leaf) for i, items in enumerate(kept) for name, leaves in items.items()
            for leaf in leaves if leaf.reader is not None and is_numeric(leaf.reader.dtype)]
    bar = Progress(sum(leaf.reader.dtype.itemsize * _size(leaf.reader.shape) for _, _, leaf in todo), enabled=progress)
    accs: list[dict[str, dict[tuple[str, ...], StatsAccumulator]]] = [{} for _ in snaps]
    nonfinite = []
    try:
        # All cores, a few blocks per task, peak memory bounded per thread (stats.compute_stats).
        computed = compute_stats([leaf.reader for _, _, leaf in todo], chunk_bytes=chunk_bytes, progress=bar,
                                 labels=[f"{name}/{leaf.name}" for _, name, leaf in todo])
        for (i, name, leaf), acc in zip(todo, computed):
            accs[i].setdefault(name, {})[leaf.path] = acc
            if acc.nonfinite:
                where = f"{name}/{leaf.name}"
                nonfinite.append(where if snaps[i].step is None or len(snaps) == 1 else f"{snaps[i].step}:{where}")
    finally:
        bar.close()
    # Non-array leaves whose value the metadata carries (a Python float in a msgpack, a JSON item) count too.
    for i, items in enumerate(kept):
        for name, leaves in items.items():
            for leaf in leaves:
                if leaf.reader is None and isinstance(leaf.value, float) and not math.isfinite(leaf.value):
                    where = f"{name}/{leaf.name}"
                    nonfinite.append(where if snaps[i].step is None or len(snaps) == 1 else f"{snaps[i].step}:{where}")
    return accs, nonfinite


def _size(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def parse_leaf_spec(spec: str) -> tuple[str, tuple[Any, ...] | None]:
    """``"params/w[0:2, 3]"`` -> ``("params/w", (slice(0, 2), 3))``; no brackets -> ``(spec, None)``.

    >>> parse_leaf_spec("opt/0/mu/w[::2, -1]")
    ('opt/0/mu/w', (slice(None, None, 2), -1))
    >>> parse_leaf_spec("layers.0.weight")
    ('layers.0.weight', None)
    """
    text = spec.strip()
    if not text.endswith("]") or "[" not in text:
        return text, None
    name, _, inside = text[:-1].rpartition("[")
    index: list[Any] = []
    for part in inside.split(","):
        part = part.strip()
        try:
            if ":" in part:
                bits = [int(b) if b.strip() else None for b in part.split(":")]
                if len(bits) > 3:
                    raise ValueError
                index.append(slice(*bits))
            else:
                index.append(int(part))
        except ValueError:
            raise ValueError(f"`show` index {part!r} in {spec!r} is not an integer or a start:stop:step slice.") from None
    return name, tuple(index)


def show_leaf(path: str, spec: str, *, step: int | str | None = None, item: str | None = None) -> tuple[str, Any]:
    """The values of one leaf, or of a slice of it, reading only that leaf (only the chunks a slice needs).

    Args:
      path: any checkpoint ``inspect_path`` reads.
      spec: the leaf's path (``params/Dense_0/kernel``, or without the item
        name when ``item`` is given or the path is unique), optionally with a
        numpy-style index of integers and slices: ``params/w[0:4, -1]``.
      step: the step of a checkpoint root (default: latest).
      item: the item holding the leaf.

    Returns:
      ``(item/path, numpy array or value)``.

    Raises:
      CheckpointNotFoundError: no such leaf (the message names close paths).

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz"); np.savez(f, w=np.arange(12).reshape(3, 4))
    >>> show_leaf(f, "w[1, ::2]")
    ('default/w', array([4, 6]))
    """
    name, index = parse_leaf_spec(spec)
    source = open_source(path)
    resolved = source.resolve(step)
    with source.reading(resolved):  # a step pruned while it is read: StepDeletedError naming it
        return _show_leaf(source, resolved, spec, name, index, item)


def _show_leaf(source: Any, resolved: int | None, spec: str, name: str, index: tuple[Any, ...] | None,
               item: str | None) -> tuple[str, Any]:
    import difflib

    import numpy as np

    from treetools.errors import CheckpointNotFoundError

    names = [item] if item is not None else source.item_names(resolved)
    head, _, rest = name.partition("/")
    if item is None and head in names and rest:
        names, name = [head], rest
    found = []
    for item_name in names:
        snap = source.snapshot(resolved, [item_name])
        found += [(item_name, leaf) for leaf in snap.items[item_name].leaves if leaf.name == name]
        if found:
            break
    if not found:
        every = [f"{n}/{leaf.name}" for n in names for leaf in source.snapshot(resolved, [n]).items[n].leaves]
        close = difflib.get_close_matches(name, every, n=5, cutoff=0.3) or every[:5]
        raise CheckpointNotFoundError(f"{source.path}: no leaf `{name}`; close paths: {', '.join(close) or 'none'}.")
    item_name, leaf = found[0]
    if leaf.reader is None:
        if index is not None:
            raise ValueError(f"`{item_name}/{leaf.name}` is a value, not an array; drop the index.")
        return f"{item_name}/{leaf.name}", leaf.value
    shape = tuple(leaf.reader.shape)
    index = index if index is not None else ()
    if len(index) > len(shape):
        raise ValueError(f"`show` index {spec!r} has {len(index)} entries for an array of shape {shape}.")
    full: list[Any] = []
    for k, (ix, n) in enumerate(zip(index + (slice(None),) * (len(shape) - len(index)), shape)):
        if isinstance(ix, int):
            if not -n <= ix < n:
                raise ValueError(f"`show` index {ix} is out of range for dimension {k} of size {n} in {spec!r}.")
            full.append(slice(ix % n, ix % n + 1))
        else:
            full.append(slice(*ix.indices(n)) if ix.step in (None, 1) else slice(None))
    # What is read: the region the slice spans (a strided slice reads its whole span), or the whole
    # leaf where the storage streams front to back (a compressed npz member). Held to the memory budget.
    region = shape if leaf.reader.sequential else block_extent(tuple(full), shape)[1]
    nbytes = _size(region) * leaf.reader.dtype.itemsize
    if nbytes > memory_budget():
        reads = "the whole leaf" if tuple(region) == shape else f"a {list(region)} region"
        raise MemoryBudgetError(
            f"{source.path}: `{item_name}/{leaf.name}`: showing {spec!r} reads {reads}, {human(nbytes, 'B')}, over "
            f"the memory budget of {human(memory_budget(), 'B')}; show a smaller slice (e.g. `{leaf.name}"
            f"[{', '.join(['0'] * max(0, len(shape) - 1) + [':4'])}]`), or raise the budget with --memory-budget-mb."
        )
    if leaf.reader.sequential:
        block = np.asarray(leaf.reader.read_all())[tuple(full)]
    else:
        block = np.asarray(leaf.reader.read(tuple(full)))
    # Apply integer indices (drop their axes) and strided slices on the block that was read.
    post = tuple(0 if isinstance(ix, int) else (slice(None) if ix.step in (None, 1) else ix)
                 for ix in index + (slice(None),) * (len(shape) - len(index)))
    return f"{item_name}/{leaf.name}", block[post]
