"""Every renderer: rows, inspect reports and diffs as a table, markdown, a tree or JSON.

Data is built elsewhere (``treetools.rows``, ``treetools.inspect.report``,
``treetools.inspect.diff``); this module only turns it into text. It imports
no jax. Names read from a checkpoint are made safe for a terminal here
(control characters escaped), so a file cannot clear the screen or forge rows.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Sequence

from treetools.rows import MIXED, Row, Totals, common_prefix, format_count, format_shape, human, totals

if TYPE_CHECKING:
    from treetools.inspect.diff import DiffReport
    from treetools.inspect.report import ItemReport, Report

__all__ = ["json_safe", "render_diff", "render_report", "render_rows", "safe_text"]

STAT_COLUMNS = ("mean", "std", "min", "max", "l2", "abs_max", "zeros", "nan", "posinf", "neginf", "nonfinite")
"""Every statistic a table can show (``nonfinite`` = nan + posinf + neginf)."""
DEFAULT_STAT_COLUMNS = ("mean", "std", "min", "max", "nonfinite")
"""The compact set ``--stats`` shows unless ``--stats-columns`` chooses."""


def _stat(stats: dict[str, Any], key: str) -> Any:
    if key == "nonfinite":
        return sum(int(stats.get(k) or 0) for k in ("nan", "posinf", "neginf"))
    return stats.get(key)


def safe_text(text: Any) -> str:
    """``text`` with control characters escaped (``\\x1b`` shows as the four characters ``\\x1b``).

    >>> safe_text("a\\x1b[2Jb\\nc")
    'a\\\\x1b[2Jb\\\\nc'
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def json_safe(value: Any) -> Any:
    """Replace NaN and +-Inf floats by None anywhere in a JSON-like value (JSON has no NaN).

    >>> json_safe({"a": [1.0, float("nan")]})
    {'a': [1.0, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


_PARAM_ITEMS = ("params", "params_ema", "ema_params", "target", "default")
"""Items whose element counts are parameters; other items' tables count "elements"."""


def _bytes_text(n: int) -> str:
    """A byte total as every footer prints it: ``600 bytes``, ``2,097,152 bytes (2.00 MiB)``."""
    return f"{n:,} bytes" + (f" ({human(n, 'B')})" if n >= 1024 else "")


def _fmt_stat(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _table_data(rows: Sequence[Row], show_weight_decay: bool, strip: int,
                stat_columns: Sequence[str] = DEFAULT_STAT_COLUMNS,
                count_label: str = "params") -> tuple[list[str], list[list[Any]]]:
    show_stats = any(r.stats is not None for r in rows)
    show_leaves = any(r.leaves != 1 for r in rows)
    headers = ["path", "shape", "dtype", count_label, "bytes", "sharding"]
    if show_leaves:
        headers.insert(1, "leaves")
    if show_weight_decay:
        headers.append("weight_decay")
    if show_stats:
        headers += list(stat_columns)
    data = []
    for r in rows:
        line: list[Any] = [
            safe_text(r.sep.join(r.path[strip:]) or r.name),
            format_shape(r.shape),
            r.dtype or "",
            f"{r.params:,}",
            human(r.bytes, "B"),
            "" if r.sharding is None else str(r.sharding),
        ]
        if show_leaves:
            line.insert(1, r.leaves)
        if show_weight_decay:
            line.append(MIXED if r.weight_decay is None else str(r.weight_decay))
        if show_stats:
            line += ["" if r.stats is None else _fmt_stat(_stat(r.stats, k)) for k in stat_columns]
        data.append(line)
    return headers, data


def _footer(t: Totals, *, markdown: bool = False, count_label: str = "params") -> str:
    # In markdown the per-dtype lines are a list, so they do not run together into one paragraph.
    indent = "- " if markdown else "  "
    lines = [f"Total: {format_count(t.params)} {count_label}, {_bytes_text(t.bytes)}"]
    if len(t.by_dtype) > 1:
        for dtype, d in t.by_dtype.items():
            lines.append(f"{indent}{dtype}: {format_count(d['params'])} {count_label}, {human(d['bytes'], 'B')}")
    if markdown and len(lines) > 1:
        lines.insert(1, "")
    return "\n".join(lines)


def _render_tree(rows: Sequence[Row], strip: int = 0) -> str:
    """An indented tree with a subtotal on every folder line."""
    sub: dict[tuple[str, ...], int] = {}
    for r in rows:
        for k in range(strip, len(r.path)):
            sub[r.path[:k]] = sub.get(r.path[:k], 0) + r.params
    lines: list[str] = []
    opened: tuple[str, ...] = tuple()
    for r in rows:
        parts = r.path[strip:]
        common = 0
        while common < min(len(opened), len(parts) - 1) and opened[common] == parts[common]:
            common += 1
        opened = opened[:common]
        for depth in range(common, len(parts) - 1):
            folder = r.path[: strip + depth + 1]
            lines.append("  " * depth + safe_text(parts[depth]) + f"{r.sep}  {format_count(sub.get(folder, 0))} params")
            opened = opened + (parts[depth],)
        shape = f" {format_shape(r.shape)}" if r.shape is not None else ""
        dtype = f" {r.dtype}" if r.dtype else ""
        spec = f" {r.sharding}" if r.sharding is not None else ""
        last = safe_text(parts[-1]) if parts else safe_text(r.name)
        lines.append("  " * max(len(parts) - 1, 0) + f"{last}{shape}{dtype}  {r.params:,} params{spec}")
    return "\n".join(lines)


def render_rows(
    rows: Sequence[Row],
    *,
    fmt: str = "table",
    tablefmt: str = "simple",
    show_weight_decay: bool = False,
    total: Totals | None = None,
    strip: int = 0,
    stat_columns: Sequence[str] = DEFAULT_STAT_COLUMNS,
    count_label: str = "params",
) -> str:
    """Render rows as ``table`` (tabulate's ``tablefmt``), ``markdown``, ``tree`` or ``json``.

    ``total`` defaults to the totals of ``rows``; pass the leaf totals when the
    rows are aggregated or filtered and the footer should say so. ``strip``
    drops that many leading path parts (a section header shows them once).

    >>> import numpy as np
    >>> from treetools.rows import rows_from_tree
    >>> print(render_rows(rows_from_tree({"enc": {"w": np.ones(4, np.float32)}}), fmt="tree"))
    enc/  4 params
      w (4,) float32  4 params
    Total: 4 params, 16 bytes
    """
    total = total if total is not None else totals(rows)
    if fmt == "json":
        return json.dumps({**total.to_json(), "leaves": [r.to_json() for r in rows]}, indent=2)
    if fmt == "tree":
        return _render_tree(rows, strip) + "\n" + _footer(total)
    if fmt not in ("table", "markdown"):
        raise ValueError(f"`fmt` must be one of table, markdown, tree, json; got {fmt!r}.")
    from tabulate import tabulate

    headers, data = _table_data(rows, show_weight_decay, strip, stat_columns, count_label)
    body = tabulate(data, headers=headers, tablefmt="github" if fmt == "markdown" else tablefmt, disable_numparse=True)
    return body + "\n\n" + _footer(total, markdown=fmt == "markdown", count_label=count_label)


# ---------------------------------------------------------------------------- inspect reports


def _header(report: "Report") -> list[str]:
    lines = [f"{safe_text(report.path)} ({report.format})"]
    if report.steps is not None:
        shown = "all" if report.all_steps else report.step
        lines.append(f"steps: {', '.join(map(str, report.steps)) or 'none'} (showing {shown})")
    if report.incomplete:
        lines.append(f"incomplete (not read): {', '.join(safe_text(n) for n in report.incomplete)}")
    return lines


def _metadata_lines(metadata: dict[str, Any] | None) -> list[str]:
    if not metadata:
        return []
    out = []
    if metadata.get("saved_at"):
        out.append(f"saved: {metadata['saved_at']}")
    metrics = metadata.get("metrics")
    if metrics:
        out.append("metrics: " + ", ".join(f"{safe_text(k)}={_fmt_stat(v)}" for k, v in metrics.items()))
    custom = metadata.get("custom")
    if custom:
        text = json.dumps(custom, default=str)
        out.append("custom: " + safe_text(text if len(text) <= 100 else text[:97] + "..."))
    return out


def render_report(report: "Report", fmt: str = "table", *, tablefmt: str = "simple",
                  stat_columns: Sequence[str] = DEFAULT_STAT_COLUMNS) -> str:
    """Render an inspect ``Report`` as ``table``, ``markdown``, ``tree`` or ``json``.

    One section per step and item, each with its totals; a section's title
    names the path prefix its rows share (optax states nest deep) and its
    mesh; a JSON item is shown as its values.
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
        meta = _metadata_lines(s.metadata)
        out += [f"- {line}" for line in meta] if md else meta
        if not s.items:
            out += ["", "(no items)"]
        for name, item in s.items.items():
            out += ["", *_item_section(name, item, fmt, tablefmt, level=3 if report.all_steps else 2,
                                       stat_columns=stat_columns)]
        if len(s.items) > 1:
            t = s.total
            line = f"Grand total ({len(s.items)} items): {format_count(t.params)} elements, {_bytes_text(t.bytes)}"
            out += ["", f"**{line}**" if md else line]
    grouped = report.grouped_at if hasattr(report, "grouped_at") else None
    if grouped:
        hint = f"rows grouped {grouped} level(s) below each item's shared prefix; --leaves shows every leaf, --depth K chooses."
        out += ["", f"_{hint}_" if md else hint]
    return "\n".join(out)


def _item_section(name: str, item: "ItemReport", fmt: str, tablefmt: str, *, level: int,
                  stat_columns: Sequence[str] = DEFAULT_STAT_COLUMNS) -> list[str]:
    md = fmt == "markdown"
    prefix = common_prefix(item.rows) if fmt != "tree" else ()
    sep = item.rows[0].sep if item.rows else "/"
    shown_prefix = sep.join(prefix) + sep if prefix else ""
    strip = len(prefix)
    values = {safe_text(p[len(shown_prefix):] if p.startswith(shown_prefix) else p): v for p, v in item.values.items()}
    title = safe_text(name)
    if md:
        head = [f"{'#' * level} {title}" + (f": `{safe_text(shown_prefix)}`" if shown_prefix else "")]
    else:
        head = [f"[{title}]" + (f" {safe_text(shown_prefix)}" if shown_prefix else "")]
    head += [f"mesh: {', '.join(f'{safe_text(a)}={n}' for a, n in mesh.items())}" for mesh in item.meshes]
    names = {safe_text(r.sep.join(r.path[strip:])) for r in item.rows}
    if not item.rows:
        body = ["(no leaves)"]
    elif values and len(values) == len(item.rows) and names <= set(values):
        body = [_render_values(values, md)]  # a JSON item: its values are what it holds
    else:
        # Optimizer moments and other state are elements, not parameters.
        label = "params" if name in _PARAM_ITEMS else "elements"
        body = [render_rows(item.rows, fmt=fmt, tablefmt=tablefmt, total=item.total, strip=strip,
                            stat_columns=stat_columns, count_label=label)]
        if values:
            body += ["", "values:", _render_values(values, md)]
    if md:  # markdown needs blank lines between a heading, a paragraph and a table
        return [line for part in [*head, *body] if part for line in (part, "")][:-1]
    return [*head, *body]


def _render_values(values: dict[str, Any], md: bool) -> str:
    from treetools.inspect.source import jsonable

    def shown(v: Any) -> str:
        text = safe_text(json.dumps(jsonable(v), allow_nan=True))
        return text if len(text) <= 80 else text[:77] + "..."

    if md:
        from tabulate import tabulate

        return tabulate([[p, shown(v)] for p, v in values.items()], headers=["path", "value"], tablefmt="github",
                        disable_numparse=True)
    width = max(len(p) for p in values)
    return "\n".join(f"{p:<{width}}  {shown(v)}" for p, v in values.items())


# ---------------------------------------------------------------------------- diffs


def render_diff(report: "DiffReport", fmt: str = "table") -> str:
    """Render a ``DiffReport`` as ``table``, ``markdown`` or ``json``; the last line of a table is the verdict."""
    if fmt == "json":
        return json.dumps(report.to_json(), indent=2, allow_nan=False)
    if fmt not in ("table", "markdown"):
        raise ValueError(f"`fmt` must be one of table, markdown, json; got {fmt!r}.")
    from tabulate import tabulate

    from treetools.inspect.source import jsonable

    md = fmt == "markdown"

    def side(d: dict[str, Any]) -> str:
        extra = [f"step {d['step']}"] if d["step"] is not None else []
        extra += [f"item {safe_text(d['item'])}"] if d["item"] else []
        return f"{safe_text(d['path'])} ({', '.join([d['format'], *extra])})"

    def shown(r: Row, field: str, value: Any) -> str:
        if field == "value":
            return safe_text(json.dumps(jsonable(value)))
        if field == "shape":
            return format_shape(r.shape)
        v = getattr(r, field)
        return "-" if v is None else str(v)

    def table(data: list[list[str]], headers: list[str]) -> str:
        return tabulate(data, headers=headers, tablefmt="github" if md else "simple", disable_numparse=True)

    sections: list[tuple[str, str | None]] = []
    for title, rows in (("added (only in B)", report.added), ("removed (only in A)", report.removed)):
        if rows:
            sections.append((f"{title}: {len(rows)}", table([[safe_text(r.name), format_shape(r.shape), r.dtype or "",
                                                               f"{r.params:,}"] for r in rows],
                                                             ["path", "shape", "dtype", "params"])))
    if report.changed:
        data = [[safe_text(c.path), f, shown(c.a, f, c.value_a), shown(c.b, f, c.value_b)]
                for c in report.changed for f in c.fields]
        sections.append((f"changed metadata: {len(report.changed)}", table(data, ["path", "field", "A", "B"])))
    if report.values is not None:
        diffs = [v for v in report.values if not v.bit_identical]
        body = table([[safe_text(v.path), f"{v.max_abs_diff:.4g}", f"{v.rel_l2:.4g}", f"{v.mismatched:,}",
                       _nonfinite_change(v), "yes" if v.allclose else "no"]
                      for v in diffs], ["path", "max_abs_diff", "rel_l2", "outside tol", "non-finite A->B", "allclose"]
                     ) if diffs else None
        sections.append((f"values (atol={report.atol:g}, rtol={report.rtol:g}): {len(report.values)} leaves compared",
                         body))
    out = [f"- A: {side(report.a)}", f"- B: {side(report.b)}"] if md else [f"A: {side(report.a)}", f"B: {side(report.b)}"]
    for title, body in sections:
        # Markdown needs a blank line between a paragraph and a table.
        out += ["", title, *([""] if md and body else []), *([body] if body else [])]
    out += ["", report.verdict()]
    return "\n".join(out)


def _nonfinite_change(v: Any) -> str:
    if v.nonfinite_a == v.nonfinite_b == 0:
        return "-"
    return f"{v.nonfinite_a:,} -> {v.nonfinite_b:,}"
