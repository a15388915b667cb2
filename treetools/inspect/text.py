"""Every command's report as text: inspect reports, diffs and verify results as a table, markdown, a tree or JSON.

The reports are data (``Report``, ``DiffReport``, ``VerifyReport``, ``ConvertReport``); this
module only turns them into text, with ``treetools.render``'s row tables and
``safe_text`` for every name read from a checkpoint.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from tabulate import tabulate

from treetools.ckpt.source import counts_params
from treetools.inspect.convert import ConvertReport
from treetools.inspect.diff import DiffReport
from treetools.inspect.report import ItemReport, Report
from treetools.inspect.verify import VerifyReport
from treetools.render import DEFAULT_STAT_COLUMNS, bytes_text, format_stat, jsonable, render_rows, safe_text
from treetools.rows import Row, common_prefix, format_count, format_shape


def _header(report: Report) -> list[str]:
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
        out.append("metrics: " + ", ".join(f"{safe_text(k)}={format_stat(v)}" for k, v in metrics.items()))
    custom = metadata.get("custom")
    if custom:
        text = json.dumps(custom, default=str)
        out.append("custom: " + safe_text(text if len(text) <= 100 else text[:97] + "..."))
    return out


def render_report(report: Report, fmt: str = "table", *, tablefmt: str = "simple",
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
            line = f"Grand total ({len(s.items)} items): {format_count(t.params)} elements, {bytes_text(t.bytes)}"
            out += ["", f"**{line}**" if md else line]
    grouped = report.grouped_at
    if grouped:
        hint = f"rows grouped {grouped} level(s) below each item's shared prefix; --leaves shows every leaf, --depth K chooses."
        out += ["", f"_{hint}_" if md else hint]
    return "\n".join(out)


def _item_section(name: str, item: ItemReport, fmt: str, tablefmt: str, *, level: int,
                  stat_columns: Sequence[str]) -> list[str]:
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
        label = "params" if counts_params(name) else "elements"
        body = [render_rows(item.rows, fmt=fmt, tablefmt=tablefmt, total=item.total, strip=strip,
                            stat_columns=stat_columns, count_label=label)]
        if values:
            body += ["", "values:", _render_values(values, md)]
    if md:  # markdown needs blank lines between a heading, a paragraph and a table
        return [line for part in [*head, *body] if part for line in (part, "")][:-1]
    return [*head, *body]


def _render_values(values: dict[str, Any], md: bool) -> str:
    def shown(v: Any) -> str:
        text = safe_text(json.dumps(jsonable(v), allow_nan=True))
        return text if len(text) <= 80 else text[:77] + "..."

    if md:
        return tabulate([[p, shown(v)] for p, v in values.items()], headers=["path", "value"], tablefmt="github",
                        disable_numparse=True)
    width = max(len(p) for p in values)
    return "\n".join(f"{p:<{width}}  {shown(v)}" for p, v in values.items())


# ---------------------------------------------------------------------------- diffs


def render_diff(report: DiffReport, fmt: str = "table") -> str:
    """Render a ``DiffReport`` as ``table``, ``markdown`` or ``json``; the last line of a table is the verdict."""
    if fmt == "json":
        return json.dumps(report.to_json(), indent=2, allow_nan=False)
    if fmt not in ("table", "markdown"):
        raise ValueError(f"`fmt` must be one of table, markdown, json; got {fmt!r}.")
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


# ---------------------------------------------------------------------------- verify


def render_verify(reports: Sequence[VerifyReport], fmt: str = "table", *, many: bool = False) -> str:
    """Render verify results: one ``problem:`` line per problem then the verdict, per step; or JSON.

    ``many``: JSON is a list (``--step all``), else the one report's object.
    """
    if fmt == "json":
        return json.dumps([r.to_json() for r in reports] if many else reports[0].to_json(), indent=2)
    lines = []
    for r in reports:
        lines += [f"problem: {safe_text(problem)}" for problem in r.problems]
        lines.append(safe_text(r.verdict()))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- convert


def render_convert(report: ConvertReport, fmt: str = "table") -> str:
    """Render a ``ConvertReport``: with ``dry_run`` the mapping (source -> name, shape, dtype, file), one
    ``problem:`` line per difference ``verify`` found, the dropped leaves' count, then the verdict; or JSON."""
    if fmt == "json":
        return json.dumps(report.to_json(), indent=2)
    if fmt != "table":
        raise ValueError(f"`fmt` must be one of table, json; got {fmt!r}.")

    def change(a: Any, b: Any) -> str:
        return str(a) if a == b else f"{a} -> {b}"

    lines = []
    if report.dry_run:
        table = [["source", "-> name", "shape", "dtype", "file" if report.to == "safetensors" else ""]]
        for r in report.rows:
            table.append([safe_text(r.source), "-> " + safe_text(r.name), change(r.source_shape, r.shape),
                          change(r.source_dtype, r.dtype), safe_text(r.file)])
        table += [[safe_text(p), "(dropped)", "", "", ""] for p in report.dropped]
        widths = [max(len(row[i]) for row in table) for i in range(5)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        lines.append("")
    elif report.dropped:
        lines.append(f"dropped by the rules: {len(report.dropped)} leaves ({', '.join(safe_text(p) for p in report.dropped[:3])}"
                     + (", ..." if len(report.dropped) > 3 else "") + ")")
    lines += [f"problem: {safe_text(p)}" for p in report.problems]
    lines.append(safe_text(report.verdict()))
    if report.verify_verdict() is not None:
        lines.append(safe_text(report.verify_verdict()))
    return "\n".join(lines)
