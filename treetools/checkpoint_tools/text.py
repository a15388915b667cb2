"""Every command's report as text: inspect reports, diffs and verify results as a table, markdown, a tree or JSON.

The reports are data (``Report``, ``DiffReport``, ``VerifyReport``, ``ConvertReport``); this
module only turns them into text, with ``treetools.shared.render``'s row tables and
``safe_text`` for every name read from a checkpoint.
"""

from __future__ import annotations

import json
import textwrap
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from treetools.checkpoint_tools.report import ItemReport, Report

if TYPE_CHECKING:  # annotations only: `inspect` does not load the diff, verify and convert commands
    from treetools.checkpoint_tools.convert import ConvertReport
    from treetools.checkpoint_tools.diff import DiffReport
    from treetools.checkpoint_tools.show import ShowReport
    from treetools.checkpoint_tools.verify import VerifyRun
from treetools.shared.render import (
    CELL_WIDTH,
    DEFAULT_STAT_COLUMNS,
    bytes_text,
    fit_table,
    footer,
    format_stat,
    json_text,
    jsonable,
    render_tree,
    row_cells,
    safe_text,
    stat_value,
    width,
)
from treetools.shared.rows import Row, Totals, format_count, format_shape, human


def _header(report: Report) -> list[str]:
    lines = [f"{safe_text(report.path)} ({report.format})"]
    if report.steps is not None:
        shown = "all" if report.all_steps else report.step
        lines.append(f"steps: {_steps_text(report.steps)} (showing {shown})")
    if report.incomplete:
        lines.append(f"incomplete (not read): {', '.join(safe_text(n) for n in report.incomplete)}")
    return lines


def _steps_text(steps: Sequence[int], most: int = 12) -> str:
    """``100, 200, 300``; a long run as its first and last few steps."""
    if not steps:
        return "none"
    if len(steps) <= most:
        return ", ".join(map(str, steps))
    return ", ".join(map(str, steps[:3])) + f", ... ({len(steps) - 6} more) ..., " + ", ".join(map(str, steps[-3:]))


def _metadata_lines(metadata: dict[str, Any] | None) -> list[str]:
    if not metadata:
        return []
    parts = []
    if metadata.get("saved_at"):
        parts.append(f"saved: {safe_text(metadata['saved_at'])}")
    metrics = metadata.get("metrics")
    if metrics:
        parts.append("metrics: " + ", ".join(f"{safe_text(k)}={safe_text(format_stat(v))}" for k, v in metrics.items()))
    out = ["  ".join(parts)] if parts else []
    custom = metadata.get("custom")
    if custom:
        text = json.dumps(custom, default=str)
        out.append("custom: " + safe_text(text if len(text) <= 92 else text[:89] + "..."))
    return out


def render_report(report: Report, fmt: str = "table", *, tablefmt: str = "simple",
                  stat_columns: Sequence[str] = DEFAULT_STAT_COLUMNS) -> str:
    """Render an inspect ``Report`` as ``table``, ``markdown``, ``tree`` or ``json``.

    One section per item (an item holding a whole train state, one per part),
    titled with its name and mesh, its rows named by their whole path in the
    item (what ``--show``, ``--include`` and ``--item`` take), then its totals;
    an item with the same leaves as an earlier one is one line; a JSON item is
    shown as its values. ``--step all`` is a list of steps, or with
    ``--stats`` one column per step for each chosen statistic.
    """
    if fmt == "json":
        return json_text(report.to_json(), allow_nan=False)
    if fmt not in ("table", "markdown", "tree"):
        raise ValueError(f"`fmt` must be one of table, markdown, tree, json; got {fmt!r}.")
    md = fmt == "markdown"
    head = _header(report)
    out = [f"# {head[0]}", *(f"- {line}" for line in head[1:])] if md else list(head)
    if report.all_steps:
        body = _steps_stats(report, md, stat_columns) if report.stats else _steps_list(report, md)
        return "\n".join(out + [""] + body)
    for s in report.by_step:
        meta = _metadata_lines(s.metadata)
        out += [f"- {line}" for line in meta] if md else meta
        if not s.items:
            out += ["", "(no items read)" if s.unreadable else "(no items)"]
        if report.depth == 0:
            out += ["", *_items_table(s.items, md, len(s.unreadable)), *_unreadable_lines(s.unreadable, md)]
            continue
        shown: dict[tuple, str] = {}
        for name, item in s.items.items():
            sections = [(f"{name}: {key}" if name != key else name, part) for key, part in item.parts.items()] \
                or [(name, item)]
            for title, section in sections:
                out += ["", *_item_section(title, section, fmt, tablefmt, report.stats, stat_columns, shown,
                                           fit=report.depth is None and not report.leaves)]
        out += _unreadable_lines(s.unreadable, md)
        if len(s.items) > 1 or s.unreadable:
            t = s.total
            line = f"Grand total ({_items_read(len(s.items), len(s.unreadable))}): {format_count(t.params)} elements, {bytes_text(t.bytes)}"
            out += ["", f"**{line}**" if md else line]
    if report.grouped_at:
        hint = "rows grouped to fit a screen; --leaves shows every leaf, --depth K chooses."
        out += ["", f"_{hint}_" if md else hint]
    return "\n".join(out)


def _same_leaves(item: ItemReport) -> tuple:
    return tuple((r.path, r.shape, r.dtype, r.params, r.leaves) for r in item.rows)


def _item_section(title: str, item: ItemReport, fmt: str, tablefmt: str, stats: bool, stat_columns: Sequence[str],
                  shown: dict[tuple, str], fit: bool) -> list[str]:
    md = fmt == "markdown"
    safe_title = safe_text(title)
    mesh = "  ".join(f"mesh: {', '.join(f'{safe_text(a)}={n}' for a, n in m.items())}" for m in item.meshes)
    head = f"{'##'} {safe_title}" if md else f"[{safe_title}]"
    head += ("  " + mesh) if mesh else ""
    key = _same_leaves(item)
    if item.rows and not stats and not item.values and key in shown:  # params_ema: the same leaves as params
        total = f"{format_count(item.total.params)} {item.label}, {human(item.total.bytes, 'B')}"
        return [f"[{safe_title}] the same leaves as [{shown[key]}]: {total}"]
    shown.setdefault(key, safe_title)
    values = item.values
    # A scalar or string leaf whose value is known is shown by its value (under `values:`), not as an empty row.
    rows = [r for r in item.rows if not (r.shape is None and r.leaves == 1 and r.name in values)]
    if not item.rows:
        body = ["(no leaves)"]
    elif not rows:
        body = [_render_values(values, md)]  # a JSON item, or scalars: their values are what they hold
    else:
        if fmt == "tree":
            body = [render_tree(rows, label=item.label, sizes=True)]
        else:
            table, dropped = _table(rows, item.label, stats, stat_columns, md, tablefmt, fit=fit)
            body = [table]
            if dropped:
                body.append(f"({', '.join(dropped)} left out to fit {width()} columns; --leaves shows every column)")
        body.insert(1, footer(item.total, label=item.label, markdown=md, not_params=item.not_params))
        if values:
            body += ["values:", _render_values(values, md)]
    if md:  # markdown needs blank lines between a heading, a paragraph and a table
        return [line for part in [head, *body] if part for line in (part, "")][:-1]
    return [head, *body]


DROPPED_TO_FIT = ("sharding", "bytes", "shape", "dtype")
"""Columns the one-screen view leaves out, in this order, while a table is wider than ``width()``; a column
empty on every row (a checkpoint that records no sharding) goes before any of them, and unsaid: it hides nothing."""


def _table(rows: Sequence[Row], label: str, stats: bool, stat_columns: Sequence[str], md: bool, tablefmt: str,
           fit: bool = False) -> tuple[str, list[str]]:
    """Rows as a table: path, shape, dtype, then the counts and sharding, or with ``stats`` the statistics.

    With ``fit`` (the one-screen view) the table fits ``width()`` by the one rule (``fit_table``): the columns
    empty on every row go first, then those of ``DROPPED_TO_FIT``; paths stay whole (each pastes into
    ``--show``). Returns the table and the columns left out that held something.
    """
    headers, data = row_cells(rows, ["path", "shape_cell", "dtype",
                                     *(stat_columns if stats else ["count", "bytes", "sharding"])], label=label)
    table = fit_table(headers, data, style="github" if md else tablefmt, fit=fit, droppable=DROPPED_TO_FIT)
    return table.text, list(table.dropped)


def _items_read(read: int, unreadable: int) -> str:
    """``3 items``, or ``3 of 4 items read`` when some could not be read."""
    if not unreadable:
        return f"{read} items"
    return f"{read} of {read + unreadable} items read"


def _unreadable_lines(unreadable: Sequence[Any], md: bool) -> list[str]:
    """The items that could not be read: one line each, naming the item, its handler and the reason."""
    if not unreadable:
        return []
    head = f"Not read ({len(unreadable)} item{'s' if len(unreadable) != 1 else ''}):"
    lines = [f"- `{u.name}` ({u.handler}): {u.reason}" for u in unreadable]
    return ["", f"**{head}**" if md else head, *[safe_text(line) for line in lines]]


def _items_table(items: dict[str, ItemReport], md: bool, unreadable: int = 0) -> list[str]:
    """``--depth 0``: one row per item, then the grand total."""
    data = [[safe_text(name, width=CELL_WIDTH), f"{item.total.leaves:,}", f"{format_count(item.total.params)} {item.label}",
             human(item.total.bytes, "B")] for name, item in items.items()]
    table = fit_table(["item", "leaves", "count", "bytes"], data, style="github" if md else "simple", fit=False).text
    t = Totals(0, 0, {})
    for item in items.values():
        t = t + item.total
    return [table, f"Grand total ({_items_read(len(items), unreadable)}): {format_count(t.params)} elements, "
                   f"{bytes_text(t.bytes)}"]


def _steps_list(report: Report, md: bool) -> list[str]:
    """``--step all`` without statistics: one line per step (its save time, metrics and size)."""
    metric_names = list(dict.fromkeys(k for s in report.by_step for k in (s.metadata.get("metrics") or {})))[:4]
    headers = ["step", "saved", *(safe_text(m) for m in metric_names), "params", "size"]
    data = []
    for s in report.by_step:
        metrics = s.metadata.get("metrics") or {}
        # The model's parameters: the first item (or train-state part) known to hold them, not its EMA copy too.
        counted = [x for item in s.items.values() for x in [item, *item.parts.values()] if x.param_count is not None]
        params = counted[0].param_count if counted else 0
        data.append([str(s.step), safe_text(s.metadata.get("saved_at", "")),
                     *(safe_text(format_stat(metrics[m])) if m in metrics else "" for m in metric_names),
                     f"{params:,}" if params else "", human(s.total.bytes, "B")])
    table = fit_table(headers, data, style="github" if md else "simple", fit=False).text
    return [table, "", "--stats adds each statistic per leaf or module across these steps; --step N shows one step."]


def _steps_stats(report: Report, md: bool, stat_columns: Sequence[str]) -> list[str]:
    """``--step all --stats``: per item and statistic, one row per leaf or module and one column per step."""
    out: list[str] = []
    names = list(dict.fromkeys(name for s in report.by_step for name in s.items))
    for name in names:
        for stat in stat_columns:
            rows: dict[str, dict[int | None, Any]] = {}
            for s in report.by_step:
                item = s.items.get(name)
                for r in item.rows if item is not None else ():
                    if r.stats is not None:
                        rows.setdefault(r.name, {})[s.step] = stat_value(r.stats, stat)
            if not rows:
                continue
            steps = [s.step for s in report.by_step]
            data = [[safe_text(path, width=CELL_WIDTH), *(format_stat(v[st]) if st in v else "" for st in steps)] for path, v in rows.items()]
            title = f"[{safe_text(name)}] {stat}"
            table = fit_table(["path", *map(str, steps)], data, style="github" if md else "simple", fit=False).text
            out += [f"## {title}" if md else title, *([""] if md else []), table, ""]
    return out[:-1] if out else ["(no statistics: no numeric leaf)"]


def _render_values(values: dict[str, Any], md: bool) -> str:
    def shown(v: Any) -> str:
        text = safe_text(json.dumps(jsonable(v), allow_nan=True))
        return text if len(text) <= 80 else text[:77] + "..."

    # No column padded to a huge name; a list, not a dict, so two names that cut alike stay two rows.
    cells = [(safe_text(p, width=CELL_WIDTH), v) for p, v in values.items()]
    return fit_table(["path", "value"] if md else None, [[p, shown(v)] for p, v in cells],
                     style="github" if md else "plain", fit=False).text


# ---------------------------------------------------------------------------- --show

SHOW_THRESHOLD = 200
"""``--show`` prints at most about this many elements (numpy's summarization with ``...`` beyond)."""


def render_show(report: ShowReport, fmt: str = "table", *, stat_columns: Sequence[str] = DEFAULT_STAT_COLUMNS) -> str:
    """Render what ``inspect --show`` read: per step, the leaf, its shape and dtype and its values (numpy's own
    printing, summarized beyond ``SHOW_THRESHOLD`` elements), or a value as JSON, then its statistics where they
    were computed; or the JSON object (``ShowReport.to_json``)."""
    if fmt == "json":
        return json.dumps(report.to_json(), default=str)  # NaN/Inf as null, as every command's JSON
    lines = []
    for s in report.shown:
        where = safe_text(s.path) + ("" if s.step is None else f" (step {s.step})")
        if s.is_array:
            lines.append(f"{where}: shape {tuple(s.value.shape)}, {s.value.dtype}")
            with np.printoptions(threshold=SHOW_THRESHOLD, edgeitems=3, linewidth=100):
                lines.append(safe_text(np.array2string(s.value), lines=True))
        else:
            lines.append(f"{where}: {safe_text(json.dumps(jsonable(s.value), default=str))}")
        if s.stats is not None:
            lines.append("stats: " + "  ".join(f"{c}={format_stat(stat_value(s.stats, c))}" for c in stat_columns))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- diffs


def render_diff(report: DiffReport, fmt: str = "table") -> str:
    """Render a ``DiffReport`` as ``table``, ``markdown`` or ``json``; the last line of a table is the verdict.

    Section titles count leaves (with ``depth``, also the groups they form), as the verdict does. A table
    fits ``width()`` columns: path cells are cut to what is left, and the values table leaves out its
    ``allclose`` column (saying so) where the paths would get too little room; markdown keeps paths whole.
    """
    if fmt == "json":
        return json_text(report.to_json(), allow_nan=False)
    if fmt not in ("table", "markdown"):
        raise ValueError(f"`fmt` must be one of table, markdown, json; got {fmt!r}.")
    md = fmt == "markdown"

    def side(d: dict[str, Any]) -> str:
        extra = [f"step {d['step']}"] if d["step"] is not None else []
        extra += [f"item {safe_text(d['item'])}"] if d["item"] else []
        return f"{safe_text(d['path'])} ({', '.join([d['format'], *extra])})"

    def shown(r: Row, field: str, value: Any) -> str:
        if field == "value":
            return safe_text(json.dumps(jsonable(value)), width=CELL_WIDTH)
        if field == "shape":
            return format_shape(r.shape)
        v = getattr(r, field)
        return "-" if v is None else safe_text(v, width=CELL_WIDTH)

    def counted(leaves: int, groups: int | None = None) -> str:
        text = f"{leaves:,} lea{'f' if leaves == 1 else 'ves'}"
        if report.depth is not None and groups is not None:
            text += f" (in {groups:,} group{'s' * (groups != 1)}, --depth {report.depth})"
        return text

    said: list[bool] = []  # the note on shortened paths, said under the first table that has one

    def noted(body: str, cut: bool) -> str:
        if not cut or said:
            return body
        said.append(True)
        fit = f"{width()} columns" if not md else f"{CELL_WIDTH} characters"
        note = (f"(… shortens paths to fit {fit}; --format json" + (" or a wider terminal" if not md else "")
                + " prints them whole)")
        return body + ("\n\n" + note if md else "\n" + "\n".join(textwrap.wrap(note, width())))

    sections: list[tuple[str, str | None]] = []
    body: str | None  # a section's text; None: its title alone
    for title, rows in (("added (only in B)", report.added), ("removed (only in A)", report.removed)):
        if rows:
            headers, data = row_cells(rows, ["path", "shape_cell", "dtype", "count"], path_width=None)
            body, _, cut = _diff_table(data, headers, md)
            sections.append((f"{title}: {counted(sum(r.leaves for r in rows), len(rows))}", noted(body, cut)))
    if report.changed:
        data = [[c.path, f, shown(c.a, f, c.value_a), shown(c.b, f, c.value_b)]
                for c in report.changed for f in c.fields]
        body, _, cut = _diff_table(data, ["path", "field", "A", "B"], md)
        sections.append((f"changed metadata: {counted(len(report.changed))}", noted(body, cut)))
    if report.values is not None:
        diffs = [v for v in report.values if not v.bit_identical]
        compared = sum(v.leaves for v in report.values)
        title = f"values (atol={report.atol:g}, rtol={report.rtol:g}): {counted(compared)} compared"
        body = None
        if diffs:
            title += f", {counted(compared - sum(v.same_leaves for v in report.values), len(diffs))} not bit-identical"
            headers = ["path", "max_abs", "rel_l2", "outside tol"]
            data = [[v.path, f"{v.max_abs_diff:.4g}", f"{v.rel_l2:.4g}", outside_text(v.mismatched, v.size)]
                    for v in diffs]
            if any(v.nonfinite_a or v.nonfinite_b for v in diffs):  # else a column of "-" only
                headers.append("nonfinite A->B")
                for line, v in zip(data, diffs):
                    line.append(_nonfinite_change(v))
            headers.append("allclose")
            for line, v in zip(data, diffs):
                line.append("yes" if v.allclose else "no")
            body, dropped, cut = _diff_table(data, headers, md, droppable=("allclose",))
            if dropped:
                body += f"\n(allclose left out to fit {width()} columns: it is yes where outside tol is 0)"
            body = noted(body, cut)
        sections.append((title, body))
    for name, unread in (("A", report.unread_a), ("B", report.unread_b)):
        if unread:
            body = "\n".join(safe_text(f"- `{u.name}` ({u.handler}): {u.reason}") for u in unread)
            sections.append((f"not read (in {name}): {len(unread)} item{'s' * (len(unread) != 1)}", body))
    out = [f"- A: {side(report.a)}", f"- B: {side(report.b)}"] if md else [f"A: {side(report.a)}", f"B: {side(report.b)}"]
    for title, body in sections:
        # Markdown needs a blank line between a paragraph and a table.
        out += ["", title, *([""] if md and body else []), *([body] if body else [])]
    out += ["", *(piece for line in report.verdict().splitlines() for piece in _wrap_list(line))]
    return "\n".join(out)


def _wrap_list(line: str, room: int | None = None, indent: str = "  ") -> list[str]:
    """A line of ``a, b, c`` items as lines of at most ``room`` columns (default ``width()``), broken after a
    comma (an item longer than that stays whole), continuations indented.

    >>> _wrap_list("counts: 10 added, 20 removed, 30 moved", 20)
    ['counts: 10 added,', '  20 removed,', '  30 moved']
    """
    room = width() if room is None else room
    parts = line.split(", ")
    out, current = [], parts[0]
    for part in parts[1:]:
        if len(current) + 2 + len(part) + (part is not parts[-1]) <= room:
            current += ", " + part
        else:
            out.append(current + ",")
            current = indent + part
    return [*out, current]


def outside_text(count: int, size: int) -> str:
    """Elements outside the tolerance, with their share of the leaf: ``1,234 (3.1%)``, ``0``.

    >>> outside_text(1234, 40000), outside_text(1, 10**7), outside_text(5, 5), outside_text(0, 9)
    ('1,234 (3.1%)', '1 (<0.1%)', '5 (100%)', '0')
    """
    if not count:
        return "0"
    pct = 100 * count / size if size else 100.0
    if count == size:
        share = "100%"
    elif pct < 0.1:
        share = "<0.1%"
    elif pct > 99.9:
        share = ">99.9%"
    else:
        share = f"{pct:.1f}%"
    return f"{count:,} ({share})"


def _diff_table(data: list[list[str]], headers: list[str], md: bool, droppable: Sequence[str] = ()
                ) -> tuple[str, list[str], bool]:
    """A diff section's table, path first (raw names, escaped and cut by ``fit_table``'s one rule: what the
    other columns leave of ``width()``, ``droppable`` left out first where the paths would get too little
    room); returns it, the columns left out, and whether a path was shortened (``…``)."""
    table = fit_table(headers, data, style="github" if md else "simple", paths=True, droppable=droppable)
    return table.text, list(table.dropped), table.cut


def _nonfinite_change(v: Any) -> str:
    if v.nonfinite_a == v.nonfinite_b == 0:
        return "-"
    return f"{v.nonfinite_a:,} -> {v.nonfinite_b:,}"


# ---------------------------------------------------------------------------- verify


def render_verify(run: VerifyRun, fmt: str = "table") -> str:
    """Render what ``verify`` found at each PATH: per PATH a section of one ``problem:`` line per problem and
    a verdict per step, then the unfinished saves of a root named on an ``incomplete:`` line (not damage);
    with several PATHs, a blank line between sections and a last line summing them up. Or JSON: one object
    (``VerifyRun.to_json``). A PATH that could not be read at all (its ``error``, said on stderr) has no section.
    """
    results = run.results
    if fmt == "json":
        return json_text(run.to_json(), allow_nan=False)
    if fmt != "table":
        raise ValueError(f"`fmt` must be one of table, json; got {fmt!r}.")
    sections = []
    for result in results:
        if result.error is not None:
            continue
        lines = []
        for r in result.reports:
            lines += [f"problem: {safe_text(problem)}" for problem in r.problems]
            lines += [f"not read: {safe_text(unread)}" for unread in r.unread]
            lines.append(safe_text(r.verdict()))
        if result.incomplete_line() is not None:
            lines.append(safe_text(result.incomplete_line()))
        sections.append("\n".join(lines))
    if len(results) > 1:
        failed = [r.path for r in results if not r.ok and r.error is None]
        unread = [r.path for r in results if r.error is not None]
        line = f"{len(results)} paths: {len(results) - len(failed) - len(unread)} ok, {len(failed)} FAILED"
        line += f" ({', '.join(failed)})" if failed else ""
        line += f", {len(unread)} not verified ({', '.join(unread)}: see the errors above)" if unread else ""
        sections.append(safe_text(line))
    return "\n\n".join(sections)


# ---------------------------------------------------------------------------- convert


def render_convert(report: ConvertReport, fmt: str = "table") -> str:
    """Render a ``ConvertReport``: with ``dry_run`` the mapping (source -> name, shape, dtype, file), one
    ``problem:`` line per difference ``verify`` found, the dropped leaves' count, then the verdict; or JSON."""
    if fmt == "json":
        return json_text(report.to_json())
    if fmt != "table":
        raise ValueError(f"`fmt` must be one of table, json; got {fmt!r}.")

    def change(a: Any, b: Any) -> str:
        return str(a) if a == b else f"{a} -> {b}"

    lines = []
    if report.dry_run:
        # `rules`: every op a rule does to the leaf, a square matrix's transpose included (its shape tells nothing).
        table = [["source", "-> name", "shape", "dtype", "file", "rules"]]
        for r in report.rows:
            table.append([safe_text(r.source), "-> " + safe_text(r.name), change(r.source_shape, r.shape),
                          change(r.source_dtype, r.dtype), safe_text(r.file), ", ".join(r.ops)])
        table += [[safe_text(p), "(dropped)", "", "", "", "drop"] for p in report.dropped]
        if report.to != "safetensors":  # Orbax: one folder, no file per tensor
            table = [row[:4] + row[5:] for row in table]
        lines += [fit_table(table[0], table[1:], style="plain", fit=False).text, ""]
    elif report.dropped:
        lines.append(f"dropped by the rules: {len(report.dropped)} leaves ({', '.join(safe_text(p) for p in report.dropped[:3])}"
                     + (", ..." if len(report.dropped) > 3 else "") + ")")
    lines += [f"problem: {safe_text(p)}" for p in report.problems]
    lines.append(safe_text(report.verdict()))
    if report.verify_verdict() is not None:
        lines.append(safe_text(report.verify_verdict()))
    return "\n".join(lines)
