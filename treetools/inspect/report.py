"""``inspect_path``: a checkpoint's rows per step and item, filtered, summed, with stats.

The report is data; ``render_report`` turns it into the terminal table,
markdown, an indented tree, or the JSON object of DESIGN.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

from treetools.inspect._base import DEFAULT_CHUNK_BYTES, NO_VALUE, CheckpointError, Leaf, Snapshot, is_numeric, jsonable
from treetools.inspect.readers import open_checkpoint, select_item
from treetools.inspect.stats import Progress, StatsAccumulator, leaf_stats
from treetools.paths import compile_patterns, match_patterns, path_prefix  # string helpers: no jax
from treetools.table import Row, Totals, aggregate_rows, render_rows, sort_rows, totals

__all__ = ["ItemReport", "Report", "StepReport", "inspect_path", "json_safe", "render_report"]


@dataclasses.dataclass
class ItemReport:
    """One item of one step: the rows shown and the totals of the leaves behind them.

    ``values`` holds the values of non-array leaves that the checkpoint stores
    in its metadata (JSON items, msgpack scalars), by path; ``meshes`` the
    distinct meshes (axis name -> size) of the sharded leaves. Both are for
    the human views; the JSON object keeps DESIGN.md's schema.
    """

    rows: list[Row]
    total: Totals
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    meshes: list[dict[str, int]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, leaves: Sequence[Leaf], rows: list[Row]) -> "ItemReport":
        """The report of ``leaves`` (filtered, before aggregation) shown as ``rows``."""
        leaf_rows = [leaf.row for leaf in leaves]
        meshes = [dict(m) for m in {tuple(r.sharding.mesh.items()): 0 for r in leaf_rows
                                    if r.sharding is not None and r.sharding.mesh}]
        values = {leaf.row.path: leaf.value for leaf in leaves if leaf.row.shape is None and leaf.value is not NO_VALUE}
        return cls(rows, totals(leaf_rows), values, meshes)

    def to_json(self) -> dict[str, Any]:
        return {**self.total.to_json(), "leaves": [r.to_json() for r in self.rows]}


@dataclasses.dataclass
class StepReport:
    step: int | None
    items: dict[str, ItemReport]

    def to_json(self) -> dict[str, Any]:
        return {name: item.to_json() for name, item in self.items.items()}


@dataclasses.dataclass
class Report:
    """What ``treetools inspect`` prints, as data.

    ``steps`` is None for a single checkpoint; ``step`` is the step shown
    (None for a single checkpoint, and with ``all_steps``, where ``by_step``
    holds every committed step); ``nonfinite`` lists ``item/path`` of leaves
    with NaN or Inf (filled by ``stats=True``).
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

    def to_json(self) -> dict[str, Any]:
        """The DESIGN.md object; non-finite floats become ``null`` so the result is valid JSON."""
        out: dict[str, Any] = {
            "path": self.path,
            "format": self.format,
            "steps": self.steps,
            "incomplete": self.incomplete,
            "step": self.step,
        }
        if self.all_steps:
            out["by_step"] = {str(s.step): s.to_json() for s in self.by_step}
        else:
            out["items"] = self.by_step[0].to_json() if self.by_step else {}
        return json_safe(out)


def json_safe(value: Any) -> Any:
    """Replace NaN and +-Inf floats by None anywhere in a JSON-like value (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _filter(snaps: Sequence[Snapshot], include: Sequence[str], exclude: Sequence[str]) -> list[dict[str, list[Leaf]]]:
    """Keep leaves that match an ``include`` pattern and no ``exclude`` pattern.

    Patterns are checked against every leaf of every shown item and step: one
    that matches nothing anywhere is an error naming it. Items left without a
    leaf are dropped (``--include`` asks to see the matches, not every item).
    """
    if not include and not exclude:
        return [dict(s.items) for s in snaps]
    inc = compile_patterns(list(include), name="include")
    exc = compile_patterns(list(exclude), name="exclude")
    # Match each distinct path once: items and steps repeat the same paths.
    paths = list(dict.fromkeys(leaf.row.path for s in snaps for leaves in s.items.values() for leaf in leaves))
    keep = dict(zip(paths, match_patterns(paths, inc, name="include") if inc else [True] * len(paths)))
    if exc:
        for path, dropped in zip(paths, match_patterns(paths, exc, name="exclude")):
            keep[path] = keep[path] and not dropped
    out: list[dict[str, list[Leaf]]] = []
    for s in snaps:
        kept = {name: [leaf for leaf in leaves if keep[leaf.row.path]] for name, leaves in s.items.items()}
        out.append({name: leaves for name, leaves in kept.items() if leaves})
    return out


def _with_stats(rows: list[Row], accs: dict[str, StatsAccumulator], depth: int | None) -> list[Row]:
    """Attach statistics; a ``--depth`` group gets its members' streams merged."""
    groups: dict[str, StatsAccumulator] = dict(accs)
    if depth is not None:
        groups = {}
        for path, acc in accs.items():
            key = path_prefix(path, depth)
            groups[key] = groups[key].merge(acc) if key in groups else acc
    return [dataclasses.replace(r, stats=groups[r.path].result()) if r.path in groups else r for r in rows]


def inspect_path(
    path: str,
    *,
    step: int | str | None = None,
    item: str | None = None,
    depth: int | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    sort: str | None = None,
    stats: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool | None = None,
) -> Report:
    """Inspect a checkpoint from its metadata (and, with ``stats``, its data in bounded blocks).

    Args:
      path: an Orbax CheckpointManager root, step folder or item folder, a Flax
        msgpack file, a ``.safetensors`` or an ``.npz``.
      step: a step number, ``"latest"`` (default) or ``"all"``; roots only.
      item: show only this item (e.g. ``params``).
      depth: one row per path prefix of ``depth`` parts, summed.
      include: regexes (``re.search`` on path strings); keep leaves matching any.
      exclude: regexes; drop leaves matching any. A pattern that matches no leaf is an error.
      sort: ``path``, ``params`` or ``bytes``; default stored order.
      stats: stream every array and attach mean, std, min, max, l2, abs_max,
        zeros, nan, posinf, neginf.
      chunk_bytes: the block budget for ``stats``.
      progress: draw a progress bar on stderr (default: when stderr is a terminal).

    Returns:
      A ``Report``; ``Report.to_json()`` is the ``--format json`` object.

    Raises:
      CheckpointError: missing path, not a checkpoint, corrupt or unreadable.
      ValueError: a bad or unmatched include/exclude pattern, a bad ``depth``.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, **{"a/w": np.ones((2, 3), np.float32), "a/b": np.zeros(3, np.float32)})
    >>> inspect_path(f, depth=1).to_json()["items"]["default"]["leaves"][0]["params"]
    9
    """
    if depth is not None and depth < 1:
        raise ValueError(f"`depth` must be a positive integer, got {depth}.")
    source = open_checkpoint(path)
    all_steps = step == "all"
    if all_steps:
        if source.steps is None:
            raise CheckpointError(f"--step all: {source.path} is a single checkpoint, not a CheckpointManager root.")
        snaps = [source.snapshot(s) for s in source.steps]
    else:
        snaps = [source.snapshot(step)]
    notes = [n for s in snaps for n in s.notes]
    if item is not None:
        for s in snaps:
            where = f"{source.path} (step {s.step})" if source.steps is not None else source.path
            s.items = select_item(s.items, item, where=where)
    kept = _filter(snaps, include, exclude)
    accs: list[dict[str, dict[str, StatsAccumulator]]] = [{} for _ in snaps]
    nonfinite: list[str] = []
    if stats:
        accs, nonfinite = _compute_stats(kept, snaps, chunk_bytes, progress)
    by_step = []
    for i, s in enumerate(snaps):
        items = {}
        for name, leaves in kept[i].items():
            rows = aggregate_rows([leaf.row for leaf in leaves], depth)
            if stats:
                rows = _with_stats(rows, accs[i].get(name, {}), depth)
            items[name] = ItemReport.of(leaves, sort_rows(rows, sort))
        by_step.append(StepReport(s.step, items))
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
    )


def _compute_stats(kept, snaps, chunk_bytes, progress):
    todo = [(i, name, leaf) for i, items in enumerate(kept) for name, leaves in items.items()
            for leaf in leaves if leaf.reader is not None and is_numeric(leaf.reader.dtype)]
    bar = Progress(sum(leaf.row.bytes for _, _, leaf in todo), enabled=progress)
    accs: list[dict[str, dict[str, StatsAccumulator]]] = [{} for _ in snaps]
    nonfinite = []
    try:
        for i, name, leaf in todo:
            bar.start(f"{name}/{leaf.row.path}")
            acc = leaf_stats(leaf.reader, chunk_bytes=chunk_bytes, progress=bar)
            accs[i].setdefault(name, {})[leaf.row.path] = acc
            if acc.nonfinite:
                where = f"{name}/{leaf.row.path}"
                nonfinite.append(where if snaps[i].step is None or len(snaps) == 1 else f"{snaps[i].step}:{where}")
    finally:
        bar.close()
    return accs, nonfinite


# ---------------------------------------------------------------------------- rendering


def _header(report: Report) -> list[str]:
    lines = [f"{report.path} ({report.format})"]
    if report.steps is not None:
        shown = "all" if report.all_steps else report.step
        lines.append(f"steps: {', '.join(map(str, report.steps)) or 'none'} (showing {shown})")
    if report.incomplete:
        lines.append(f"incomplete (not read): {', '.join(report.incomplete)}")
    return lines


def render_report(report: Report, fmt: str = "table", *, tablefmt: str = "simple") -> str:
    """Render a ``Report`` as ``table``, ``markdown``, ``tree`` or ``json``.

    Tables and trees reuse ``treetools.table.render_rows``: one section per
    step and item, each with its totals and per-dtype breakdown. A section's
    title names the path prefix its rows share (optax states nest deep) and
    its mesh; a JSON item is shown as its values.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, **{"opt/0/mu": np.ones(2, np.float32), "opt/0/nu": np.ones(2, np.float32)})
    >>> print(render_report(inspect_path(f)).splitlines()[2])
    [default] opt/0/
    """
    if fmt == "json":
        return json.dumps(report.to_json(), indent=2, allow_nan=False)
    if fmt not in ("table", "markdown", "tree"):
        raise ValueError(f"`fmt` must be one of table, markdown, tree, json; got {fmt!r}.")
    md = fmt == "markdown"
    head = _header(report)
    out = [f"# {head[0]}", *(f"- {line}" for line in head[1:])] if md else list(head)
    for s in report.by_step:
        if report.all_steps:
            out += ["", f"## step {s.step}" if md else f"=== step {s.step} ==="]
        if not s.items:
            out += ["", "(no items)"]
        for name, item in s.items.items():
            out += ["", *_item_section(name, item, fmt, tablefmt, level=3 if report.all_steps else 2)]
    return "\n".join(out)


def _common_folder(paths: Sequence[str]) -> str:
    """``a/b/`` when every one of two or more paths lies below it (a path's own last part is never shared)."""
    import os.path

    shared = os.path.commonprefix([p.split("/")[:-1] for p in paths]) if len(paths) > 1 else []
    return "/".join(shared) + "/" if shared else ""


def _item_section(name: str, item: ItemReport, fmt: str, tablefmt: str, *, level: int) -> list[str]:
    md = fmt == "markdown"
    prefix = _common_folder([r.path for r in item.rows]) if fmt != "tree" else ""
    rows = [dataclasses.replace(r, path=r.path[len(prefix):]) for r in item.rows]
    values = {p[len(prefix):]: v for p, v in item.values.items()}
    if md:
        head = [f"{'#' * level} {name}" + (f": `{prefix}`" if prefix else "")]
    else:
        head = [f"[{name}]" + (f" {prefix}" if prefix else "")]
    head += [f"mesh: {', '.join(f'{a}={n}' for a, n in mesh.items())}" for mesh in item.meshes]
    if not rows:
        body = ["(no leaves)"]
    elif values and len(values) == len(rows) and all(r.path in values for r in rows):
        body = [_render_values(values, md)]  # a JSON item: its values are what it holds
    else:
        body = [render_rows(rows, fmt=fmt, tablefmt=tablefmt, total=item.total)]
        if values:
            body += ["", "values:", _render_values(values, md)]
    if md:  # markdown needs blank lines between a heading, a paragraph and a table
        return [line for part in [*head, *body] if part for line in (part, "")][:-1]
    return [*head, *body]


def _render_values(values: dict[str, Any], md: bool) -> str:
    def shown(v: Any) -> str:
        text = json.dumps(jsonable(v), allow_nan=True)
        return text if len(text) <= 80 else text[:77] + "..."

    if md:
        from tabulate import tabulate

        return tabulate([[p, shown(v)] for p, v in values.items()], headers=["path", "value"], tablefmt="github",
                        disable_numparse=True)
    width = max(len(p) for p in values)
    return "\n".join(f"{p:<{width}}  {shown(v)}" for p, v in values.items())
