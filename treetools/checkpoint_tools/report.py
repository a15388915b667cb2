"""``inspect_path``: a checkpoint's rows per step and item, filtered, summed, with stats.

The report is data; ``treetools.checkpoint_tools.text.render_report`` turns it into the
terminal table, markdown, an indented tree, or the versioned JSON object
(``Report.to_json``, schema 2, documented in ``docs/json-schema.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from treetools.checkpoint_io.readers import is_numeric
from treetools.checkpoint_io.items import counts_params, item_argument, non_param_leaves, order_items, train_state_parts
from treetools.checkpoint_io.leaves import Item, Leaf, NO_VALUE, Snapshot, Unreadable
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_io.steps import parse_step
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError
from treetools.checkpoint_tools.options import InspectOptions, resolve
from treetools.shared.patterns import nearby, select_any
from treetools.shared.render import json_object, jsonable
from treetools.shared.rows import Row, Totals, aggregate_rows, common_prefix, sort_rows, totals

if TYPE_CHECKING:
    from treetools.checkpoint_io.source import Source
    from treetools.checkpoint_tools.stats import StatsAccumulator

SCHEMA = 2
"""Version of the ``--format json`` object; bumped on any incompatible change."""


@dataclasses.dataclass(frozen=True)
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
    label: str = "elements"
    """What the counts count: ``params`` for an item known to hold parameters, else ``elements``."""
    parts: dict[str, "ItemReport"] = dataclasses.field(default_factory=dict)
    """An item holding a whole train state, part by part (``params``, ``opt_state``...), for the text view."""
    not_params: dict[str, int] = dataclasses.field(default_factory=dict)
    """Elements of a parameter item that are no parameters, by kind (an nnx state's ``RNG state`` and
    BatchNorm ``batch statistics``: ``ckpt.source.non_param_leaves``); its counts then say ``elements``."""

    @property
    def param_count(self) -> int | None:
        """The parameters this item holds, None when it is no parameter item."""
        if self.label != "params" and not self.not_params:
            return None
        return self.total.params - sum(self.not_params.values())

    @classmethod
    def of(cls, item: Item, leaves: Sequence[Leaf], rows: list[Row]) -> "ItemReport":
        """The report of ``leaves`` (filtered, before aggregation) of ``item``, shown as ``rows``."""
        leaf_rows = [leaf.row for leaf in leaves]
        meshes = [dict(m) for m in {tuple(r.sharding.mesh.items()): 0 for r in leaf_rows
                                    if r.sharding is not None and r.sharding.mesh}]
        values = {leaf.name: leaf.value for leaf in leaves if leaf.row.shape is None and leaf.value is not NO_VALUE}
        value = item.value if item.kind == "json" else NO_VALUE
        label = "params" if counts_params(item.name) else "elements"
        others: dict[str, int] = {}
        if label == "params":
            kinds = non_param_leaves(leaves)
            for leaf in leaves:
                if leaf.path in kinds:
                    others[kinds[leaf.path]] = others.get(kinds[leaf.path], 0) + leaf.row.params
            label = "elements" if others else label
        return cls(rows, totals(leaf_rows), values, meshes, item.kind, value, label, not_params=others)

    def to_json(self) -> dict[str, Any]:
        out = {**self.total.to_json(), "leaves": [r.to_json() for r in self.rows]}
        if self.not_params:
            out["not_params"] = dict(self.not_params)
        if self.kind == "json":
            out["value"] = jsonable(self.value)
        elif self.values:  # scalar and string leaves of a pytree (a step counter, numpy's random state)
            out["values"] = {path: jsonable(v) for path, v in self.values.items()}
        return out


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One step (or the one checkpoint): its saved metadata and items."""

    step: int | None
    items: dict[str, ItemReport]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    unreadable: list[Unreadable] = dataclasses.field(default_factory=list)
    """Items of the step that could not be read (name, handler, reason): listed, never dropped."""

    @property
    def total(self) -> Totals:
        out = Totals(0, 0, {})
        for item in self.items.values():
            out = out + item.total
        return out

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "metadata": jsonable(self.metadata),
                "items": {name: item.to_json() for name, item in self.items.items()},
                "unreadable": [u.to_json() for u in self.unreadable]}


@dataclasses.dataclass(frozen=True)
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
    allow_unread: bool = False
    """``InspectOptions.allow_unread``: whether a partial read counts as ``complete``."""

    @property
    def unread(self) -> list[str]:
        """The items that could not be read (listed in every view with the reason): ``item``, or ``step N: item``
        with several steps shown; ``[]`` when everything was read."""
        several = len(self.by_step) > 1
        return [f"step {s.step}: {u.name}" if several else u.name for s in self.by_step for u in s.unreadable
                if not u.empty]

    @property
    def complete(self) -> bool:
        """Everything was read, or ``allow_unread`` said a partial read will do: the CLI exits 1 when False
        (after printing all that was read), as ``du`` and ``ls`` do for a tree partly unreadable."""
        return self.allow_unread or not self.unread

    def to_json(self) -> dict[str, Any]:
        """The versioned object of ``docs/json-schema.md``; non-finite floats become ``null``."""
        return json_object(SCHEMA, {
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
    # A leaf is known by its path and by item/path (either may be pasted); match each pair once. An unmatched
    # pattern's nearby paths are in one form: the path alone for one item, item/path (one leaf) for several.
    pairs = list(dict.fromkeys((name, leaf.name) for s in snaps for name, item in s.items.items()
                               for leaf in item.leaves))
    several = len({name for name, _ in pairs}) > 1
    forms = [(f"{name}/{path}", path) if several else (path, f"{name}/{path}") for name, path in pairs]
    keep = dict(zip(pairs, select_any(forms, include, exclude)))
    out: list[dict[str, list[Leaf]]] = []
    for s in snaps:
        kept = {name: [leaf for leaf in item.leaves if keep[(name, leaf.name)]] for name, item in s.items.items()}
        out.append({name: leaves for name, leaves in kept.items() if leaves})
    return out


def _with_stats(rows: list[Row], accs: Mapping[tuple[str, ...], StatsAccumulator]) -> list[Row]:
    """Attach statistics; a group row gets its members' streams merged, in leaf order.

    Indexed by path prefix: each leaf is filed under every prefix of its path
    that is a row (its own row, or the group holding it), so the work is
    leaves x path depth, never rows x leaves (``--leaves --stats`` at 4,000
    leaves).
    """
    wanted = {r.path for r in rows}
    members: dict[tuple[str, ...], list[StatsAccumulator]] = {}
    for path, acc in accs.items():
        for k in range(len(path) + 1):
            if path[:k] in wanted:
                members.setdefault(path[:k], []).append(acc)
    groups = {path: functools.reduce(lambda a, b: a.merge(b), found) for path, found in members.items()}
    return [dataclasses.replace(r, stats=groups[r.path].result()) if r.path in groups else r for r in rows]


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def collapse_numbered(rows: Sequence[Row], offset: int = 0) -> list[Row]:
    """Merge sibling rows that differ only by one numbered path part (``layers_0/attn`` .. ``layers_23/attn``).

    The merged row is named ``layers_0..23/attn`` and sums its members; the
    summary view uses it when grouping alone cannot fit an item on a screen
    (24 layers named ``layers_N`` are 24 rows at any depth). Runs of fewer than
    three are left alone.

    >>> rows = [Row(("layers_" + str(i), "w"), None, "float32", 4, 16, leaves=2) for i in range(3)]
    >>> rows.append(Row(("head",), (2,), "float32", 2, 8))
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
        numbers = sorted(int(m.group(2)) for x in groups[k] if (m := _NUMBERED.match(x.path[pos])))  # each matches
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


def inspect_path(path: str, options: InspectOptions | None = None, /, **fields: Any) -> Report:
    """Inspect a checkpoint from its metadata (and, with ``stats``, its data in bounded blocks).

    Args:
      path: any checkpoint a registered format reads (an Orbax root, step or
        item folder, a Flax msgpack file, a ``.safetensors``, an ``.npz``...).
      options: an ``InspectOptions`` (step, item, depth, leaves, include,
        exclude, sort, stats, rows_per_item, block_bytes, memory_budget, progress).
      **fields: the same fields as keywords (``inspect_path(path, depth=1)``), over ``options``.

    Returns:
      A ``Report``; ``Report.to_json()`` is the ``--format json`` object.

    Raises:
      CheckpointNotFoundError: missing path, unknown step or item.
      CheckpointError: not a checkpoint, corrupt or unreadable.
      PatternError: a bad or unmatched include/exclude pattern.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, **{"a/x/w": np.ones((2, 3), np.float32), "a/x/b": np.zeros(3, np.float32), "a/y": np.ones(2)})
    >>> shown = inspect_path(f, depth=1).to_json()["checkpoints"][0]["items"]["default"]["leaves"]
    >>> [(r["path"], r["params"]) for r in shown]
    [('a/x', 9), ('a/y', 2)]
    """
    opts = resolve(InspectOptions, options, fields)
    try:
        return _inspect(path, opts)
    except StepDeletedError as e:
        if parse_step(opts.step, allow_all=True) not in (None, -1, "all"):
            raise
        # The latest step (or, with "all", one of them) went while it was read (a manager saved a newer one
        # and pruned it): once more, from a fresh listing.
        report = _inspect(path, opts)
        shown = "every step present now" if opts.step == "all" else f"step {report.step}"
        report.notes.insert(0, f"{e} Read again: showing {shown}.")
        return report


def _rows(leaf_rows: list[Row], opts: InspectOptions, accs: dict[tuple[str, ...], StatsAccumulator]
          ) -> tuple[list[Row], int | None]:
    """The rows one item (or part of one) shows, and the depth the summary chose (None: not grouped by it)."""
    offset = len(common_prefix(leaf_rows))
    group, chosen = (None if opts.leaves else opts.depth), None
    if opts.depth == 0:
        rows = aggregate_rows(leaf_rows, None, whole=True)
    elif group is None and not opts.leaves and opts.rows_per_item is not None and len(leaf_rows) > opts.rows_per_item:
        rows, chosen = summary_rows(leaf_rows, offset, opts.rows_per_item, collapse=not opts.stats)
    else:
        rows = aggregate_rows(leaf_rows, group, offset=offset)
    if opts.stats:
        rows = _with_stats(rows, accs)
    return sort_rows(rows, opts.sort), chosen


def _every_step(source: Source, names: list[str] | None) -> tuple[list[Snapshot], list[str]]:
    """``--step all``: the snapshot of every committed step, and a note for each deleted since the listing."""
    if source.steps is None:
        raise CheckpointError(f"{source.path}: a single checkpoint, not a checkpoint root; `all` steps needs a "
                              "root.")
    snaps, notes = [], []
    for step in source.steps:
        try:
            snaps.append(source.snapshot(step, names))
        except StepDeletedError as e:  # pruned since the listing: the others are still worth showing
            notes.append(f"{e} Not shown.")
    if not snaps:  # inspect_path lists again
        raise StepDeletedError(f"{source.path}: every listed step was deleted while it was being read.")
    return snaps, notes


def _stats_of(source: Source, kept: list, snaps: list[Snapshot], block_bytes: int,
              progress: bool | None) -> tuple[list, list[str]]:
    """``_compute_stats``, where a step deleted while its arrays were read says so (not "cannot read chunk")."""
    try:
        return _compute_stats(kept, snaps, block_bytes, progress)
    except (CheckpointError, OSError):
        for s in snaps:
            gone = source.step_deleted(s.step)
            if gone is not None:
                raise gone from None
        raise


def _item_reports(s: Snapshot, kept: dict[str, list[Leaf]], accs: dict[str, dict[tuple[str, ...], StatsAccumulator]],
                  opts: InspectOptions) -> tuple[dict[str, ItemReport], int | None]:
    """One step's item reports (with a train state's parts), and the depth rows were grouped at, if any."""
    items = {}
    grouped_at = None
    for name, item_leaves in kept.items():
        item_accs = accs.get(name, {})
        rows, chosen = _rows([leaf.row for leaf in item_leaves], opts, item_accs)
        grouped_at = max(grouped_at or 0, chosen) if chosen is not None else grouped_at
        items[name] = ItemReport.of(s.items[name], item_leaves, rows)
        parts = train_state_parts(name, dataclasses.replace(s.items[name], leaves=item_leaves), list(s.items))
        for key in parts or ():
            part_leaves = [leaf for leaf in item_leaves if leaf.path[:1] == (key,)]
            part_rows, chosen = _rows([leaf.row for leaf in part_leaves], opts, item_accs)
            grouped_at = max(grouped_at or 0, chosen) if chosen is not None else grouped_at
            part = ItemReport.of(dataclasses.replace(s.items[name], name=key), part_leaves, part_rows)
            items[name].parts[key] = part
    return items, grouped_at


def _inspect(path: str, opts: InspectOptions) -> Report:
    context = opts.read_context()
    source = open_source(path, context)
    all_steps = opts.step == "all"
    if opts.item is None:
        wanted, under = None, None
    else:
        wanted, under = item_argument(source.item_names(source.resolve(None if all_steps else opts.step)), opts.item)
    names = [wanted] if wanted is not None else None
    notes: list[str] = []
    if all_steps:
        snaps, notes = _every_step(source, names)
    else:
        snaps = [source.snapshot(opts.step, names)]
    if opts.rules is not None and not opts.rules.empty:
        # Here, not at the top: metadata mode without rules starts without the rules engine (its startup).
        from treetools.checkpoint_io.mapping import map_items

        snaps = [dataclasses.replace(s, items=map_items(s.items, opts.rules)) for s in snaps]
    snaps = [dataclasses.replace(s, items={name: s.items[name] if under is None else _under(s.items[name], under,
                                                                                              source.path)
                                           for name in order_items(list(s.items))}) for s in snaps]
    notes = list(dict.fromkeys(notes + [n for s in snaps for n in s.notes]))
    kept = _filter(snaps, opts.include, opts.exclude)
    accs: list[dict[str, dict[tuple[str, ...], StatsAccumulator]]] = [{} for _ in snaps]
    nonfinite: list[str] = []
    if opts.stats:
        accs, nonfinite = _stats_of(source, kept, snaps, context.block_bytes, opts.progress)
    by_step = []
    grouped_at = None
    for i, s in enumerate(snaps):
        items, chosen = _item_reports(s, kept[i], accs[i], opts)
        grouped_at = max(grouped_at or 0, chosen) if chosen is not None else grouped_at
        by_step.append(StepReport(s.step, items, s.metadata, list(s.unreadable)))
    return Report(
        path=source.path,
        format=source.format,
        steps=source.steps,
        incomplete=source.incomplete,
        step=None if all_steps else snaps[0].step,
        by_step=by_step,
        all_steps=all_steps,
        stats=opts.stats,
        nonfinite=nonfinite,
        notes=notes,
        depth=opts.depth,
        leaves=opts.leaves,
        grouped_at=grouped_at,
        allow_unread=opts.allow_unread,
    )


def _under(item: Item, prefix: str, where: str) -> Item:
    """The leaves of ``item`` at ``prefix`` or below it (``--item params/Dense_0``), paths kept whole."""
    parts = tuple(prefix.split("/"))
    below = [leaf for leaf in item.leaves if leaf.path[:len(parts)] == parts or leaf.name == prefix]
    if not below:
        close = nearby(prefix, [leaf.name for leaf in item.leaves])
        raise CheckpointNotFoundError(
            f"{where}: item `{item.name}` has no leaf or group `{prefix}`; close paths: "
            f"{', '.join(f'{item.name}/{p}' for p in close) or 'none'}.")
    return dataclasses.replace(item, leaves=below)


def _compute_stats(kept, snaps, block_bytes, progress):
    # Here, not at the top: metadata mode starts without the block engine and the statistics (its startup).
    from treetools.checkpoint_tools.progress import Progress
    from treetools.checkpoint_tools.stats import compute_stats

    todo = [(i, name, leaf) for i, items in enumerate(kept) for name, leaves in items.items()
            for leaf in leaves if leaf.reader is not None and is_numeric(leaf.reader.dtype)]
    bar = Progress(sum(leaf.reader.dtype.itemsize * math.prod(leaf.reader.shape) for _, _, leaf in todo),
                   enabled=progress)
    accs: list[dict[str, dict[tuple[str, ...], StatsAccumulator]]] = [{} for _ in snaps]
    nonfinite = []
    try:
        # All cores, a few blocks per task, peak memory bounded per thread (stats.compute_stats).
        computed = compute_stats([leaf.reader for _, _, leaf in todo], block_bytes=block_bytes, progress=bar,
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
