"""Rows as text: a table, markdown, an indented tree or JSON; and text made safe to print.

Data is built elsewhere (``treetools.shared.rows``); this module only turns it into
text, for ``tabulate_params`` and the checkpoint commands alike (their reports
are rendered by ``treetools.commands.text`` with these pieces). It imports no
jax. Names read from a checkpoint are made safe for a terminal here
(``safe_text``: control characters escaped), so a file cannot clear the
screen or forge rows.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

from treetools.shared.rows import MIXED, STATS, Row, Totals, format_count, format_shape, human, nonfinite_count, totals

DERIVED_STATS = {"nonfinite": nonfinite_count}
"""Statistic columns a table can show beside ``rows.STATS``: each computed from a row's statistics."""
STAT_COLUMNS = STATS + tuple(DERIVED_STATS)
"""Every statistic a table can show."""
DEFAULT_STAT_COLUMNS = ("mean", "std", "min", "max", "nonfinite")
"""The compact set ``--stats`` shows unless ``--stats-columns`` chooses."""


def stat_value(stats: Mapping[str, Any], name: str) -> Any:
    """One statistic of a row's ``stats``, derived ones summed.

    >>> stat_value({"nan": 1, "posinf": 2, "neginf": 0}, "nonfinite")
    3
    """
    if name in DERIVED_STATS:
        return DERIVED_STATS[name](stats)
    return stats.get(name)


CELL_WIDTH = 160
"""The most characters a table cell shows of a name (a longer one is cut, and says so); JSON keeps names whole."""


def safe_text(text: Any, *, width: int | None = None, lines: bool = False) -> str:
    """``text`` as it may be printed: every character a terminal would act on escaped.

    Control characters (ESC, carriage return, newline...), bidirectional
    overrides (U+202E) and every other non-printable character show as their
    escape (``\\x1b`` as the four characters ``\\x1b``), so a name read from a
    checkpoint cannot clear the screen, move the cursor, reorder a line or forge
    one. Every string treetools prints, on stdout and stderr alike, passes here.

    Args:
      text: anything; ``str()`` of it is shown.
      width: at most this many characters: a longer text is cut, ``…[+N chars]…`` in its middle and both ends
        kept (a table cell never pads its column to a 100,000-character name); where ``width`` is too small
        for that, its head alone, and never longer than the text itself.
      lines: keep newlines (a rendered report's own line structure); everything else is escaped.

    >>> safe_text("a\\x1b[2Jb\\nc\\u202e")
    'a\\\\x1b[2Jb\\\\nc\\\\u202e'
    >>> safe_text("params/layers_11/attention/query/kernel", width=32)
    'params/lay…[+20 chars]…ry/kernel'
    """
    text = str(text)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() or (lines and ch == "\n") else
                       ch.encode("unicode_escape").decode("ascii") for ch in text)
    if width is not None and len(text) > width:
        return _cut(text, max(width, 0))
    return text


def _cut(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, saying how many it hides: both ends kept (a path's head says where it
    is, its tail which leaf, so two long paths differing at either end stay apart), else the head alone where
    ``width`` leaves no room for both; never longer than ``text`` itself."""
    n = len(text)
    keep = width
    while keep > 2 and keep + len(f"…[+{n - keep} chars]…") > width:
        keep -= 1
    head = (keep + 1) // 2
    both = text[:head] + f"…[+{n - keep} chars]…" + text[n - (keep - head):]
    if len(both) <= width:
        return both
    cut = width
    while cut > 1 and cut + len(f"…[+{n - cut} chars]") > width:
        cut -= 1
    return min((both, text[:cut] + f"…[+{n - cut} chars]", text), key=len)


def one_line(message: Any) -> str:
    """A diagnostic as one printable line: whitespace runs (newlines included) as one space, the rest escaped.

    >>> one_line("bad name 'a\\nforged'\\x1b[31m")
    "bad name 'a forged'\\\\x1b[31m"
    """
    return safe_text(" ".join(str(message).split()))


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


def json_object(schema: int, fields: dict[str, Any]) -> dict[str, Any]:
    """A command's ``--format json`` object: ``"schema"`` (the version of that command's JSON) first, then
    ``fields``, with non-finite floats as ``null`` (``docs/json-schema.md``). Every command builds its object here.

    >>> json_object(1, {"ok": True, "rel_l2": float("inf")})
    {'schema': 1, 'ok': True, 'rel_l2': None}
    """
    return json_safe({"schema": schema, **fields})


def jsonable(value: Any) -> Any:
    """A value read from a checkpoint as JSON can hold it (numpy scalars as Python numbers, others as text).

    >>> import numpy as np
    >>> jsonable(np.float32(1.5)), jsonable({"a": [1, 2]})
    (1.5, {'a': [1, 2]})
    """
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def bytes_text(n: int) -> str:
    """A byte total as every footer prints it: ``600 bytes``, ``2,097,152 bytes (2.00 MiB)``."""
    return f"{n:,} bytes" + (f" ({human(n, 'B')})" if n >= 1024 else "")


def format_stat(v: Any) -> str:
    """A statistic (or a metric value read from a checkpoint) as a table cell: floats to 4 significant digits,
    anything else as safe text."""
    return f"{v:.4g}" if isinstance(v, float) else safe_text(v, width=CELL_WIDTH)


def _table_data(rows: Sequence[Row], show_weight_decay: bool, strip: int, stat_columns: Sequence[str],
                count_label: str) -> tuple[list[str], list[list[Any]]]:
    show_stats = bool(stat_columns) and any(r.stats is not None for r in rows)
    show_leaves = any(r.leaves != 1 for r in rows)
    show_layers = any(r.layers is not None for r in rows)  # stacked (scanned) leaves: how many layers each holds
    headers = ["path", "shape", "dtype", count_label, "bytes", "sharding"]
    if show_layers:
        headers.insert(2, "layers")
    if show_leaves:
        headers.insert(1, "leaves")
    if show_weight_decay:
        headers.append("weight_decay")
    if show_stats:
        headers += list(stat_columns)
    data = []
    for r in rows:
        line: list[Any] = [
            safe_text(r.sep.join(r.path[strip:]) or r.name, width=CELL_WIDTH),
            format_shape(r.shape),
            safe_text(r.dtype or ""),
            f"{r.params:,}",
            human(r.bytes, "B"),
            "" if r.sharding is None else safe_text(r.sharding, width=CELL_WIDTH),
        ]
        if show_layers:
            line.insert(2, "" if r.layers is None else r.layers)
        if show_leaves:
            line.insert(1, r.leaves)
        if show_weight_decay:
            line.append(MIXED if r.weight_decay is None else str(r.weight_decay))
        if show_stats:
            line += ["" if r.stats is None else format_stat(stat_value(r.stats, k)) for k in stat_columns]
        data.append(line)
    return headers, data


def _footer(t: Totals, *, markdown: bool = False, count_label: str = "params") -> str:
    # In markdown the per-dtype lines are a list, so they do not run together into one paragraph.
    indent = "- " if markdown else "  "
    lines = [f"Total: {format_count(t.params)} {count_label}, {bytes_text(t.bytes)}"]
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
            lines.append("  " * depth + safe_text(parts[depth], width=CELL_WIDTH)
                         + f"{r.sep}  {format_count(sub.get(folder, 0))} params")
            opened = opened + (parts[depth],)
        shape = f" {format_shape(r.shape)}" if r.shape is not None else ""
        dtype = f" {r.dtype}" if r.dtype else ""
        spec = f" {safe_text(r.sharding, width=CELL_WIDTH)}" if r.sharding is not None else ""
        last = safe_text(parts[-1] if parts else r.name, width=CELL_WIDTH)
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
    stat_columns: Sequence[str] = (),
    count_label: str = "params",
) -> str:
    """Render rows as ``table`` (tabulate's ``tablefmt``), ``markdown``, ``tree`` or ``json``.

    ``total`` defaults to the totals of ``rows``; pass the leaf totals when the
    rows are aggregated or filtered and the footer should say so. ``strip``
    drops that many leading path parts (a section header shows them once).
    ``stat_columns`` names the statistics (of ``STAT_COLUMNS``) shown for rows that carry them.

    >>> print(render_rows([Row(("enc", "w"), (4,), "float32", 4, 16)], fmt="tree"))
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


