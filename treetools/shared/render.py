"""Rows as text: a table, markdown, an indented tree or JSON; and text made safe to print.

Data is built elsewhere (``treetools.shared.rows``); this module only turns it into
text, for ``tabulate_params`` and the checkpoint commands alike (their reports
are rendered by ``treetools.checkpoint_tools.text`` with these pieces). It imports no
jax. Names read from a checkpoint are made safe for a terminal here
(``safe_text``: control characters escaped), so a file cannot clear the
screen or forge rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

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


WIDTH = 100
"""The columns the text views fit where no width is given: output to a file or a pipe, or a library caller. The
one width constant: every table (``fit_table``) and every wrapped line fits ``width()``."""

MIN_WIDTH = 60
"""The fewest columns a view is fitted to, however narrow the terminal."""

_columns: list[int | None] = [None]


def set_width(columns: int | None) -> None:
    """The columns the text views fit from now on (the ``treetools`` program sets the terminal's while a command
    runs, when stdout is one); None: ``WIDTH``."""
    _columns[0] = columns


def terminal_columns(stream: Any) -> int | None:
    """The columns of the terminal ``stream`` is (what the ``treetools`` program gives ``set_width``):
    ``COLUMNS`` where set (a shell keeps it to the terminal's), else the terminal's own; None (``WIDTH``) for a
    file or a pipe, whose output stays the same wherever it runs.

    >>> import io; terminal_columns(io.StringIO()) is None
    True
    """
    try:
        if not stream.isatty():
            return None
        env = os.environ.get("COLUMNS", "").strip()
        return int(env) if env.isdigit() and int(env) > 0 else os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a StringIO)
        return None


def width() -> int:
    """The columns the text views fit: what ``set_width`` gave (never under ``MIN_WIDTH``), else ``WIDTH``.

    >>> set_width(200); width()
    200
    >>> set_width(None); width()
    100
    """
    return WIDTH if _columns[0] is None else max(_columns[0], MIN_WIDTH)


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
        text = _escaped(text, lines)
    if width is not None and len(text) > width:
        return _cut(text, max(width, 0))
    return text


def _escaped(text: str, lines: bool) -> str:
    """``text`` with every non-printable character escaped (newlines kept with ``lines``), a piece at a time: a
    35 MB report is checked in 64 KiB pieces, and only a piece holding something to escape is rebuilt character by
    character (a list of 35 million one-character strings was 280 MB)."""
    parts = []
    for a in range(0, len(text), 2**16):
        piece = text[a:a + 2**16]
        if (piece.replace("\n", "") if lines else piece).isprintable():
            parts.append(piece)
        else:
            parts.append("".join(ch if ch.isprintable() or (lines and ch == "\n") else
                                 ch.encode("unicode_escape").decode("ascii") for ch in piece))
    return "".join(parts)


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


_PARTS = re.compile(r"([/.])")
"""Where a path splits into parts: ``/`` (tree paths) and ``.`` (flat stored names, ``model.layers.0.q``)."""


def cut_paths(paths: Sequence[str], width: int) -> list[str]:
    """The paths of a table's rows, each made safe (``safe_text``) and at most ``width`` characters, keeping what
    tells the rows apart.

    A path longer than ``width`` loses whole parts that other rows share at the same place, the most shared first
    and, among those, the first first (the rows' common prefix goes first), each run shown as ``…``; its last part
    stays. Where that is not enough, what is left is cut in its middle (``safe_text(width=...)``); a row that would
    read like another is cut in its middle alone.

    >>> cut_paths(["opt_state/0/mu/params/layers_0/ln/bias", "opt_state/0/nu/params/layers_0/ln/bias"], 28)
    ['…/mu/params/layers_0/ln/bias', '…/nu/params/layers_0/ln/bias']
    """
    texts = [safe_text(p) for p in paths]
    pieces = [_PARTS.split(t) for t in texts]  # parts at even places, separators between them
    shared = Counter((i, part) for ps in pieces for i, part in enumerate(ps[0::2]))
    out = []
    for text, ps in zip(texts, pieces):
        parts = ps[0::2]
        shown, dropped = text, set()
        # The last part always stays; a part no other row has at its place tells this row apart: it stays too.
        for i in sorted((i for i in range(len(parts) - 1) if shared[(i, parts[i])] > 1),
                        key=lambda i: (-shared[(i, parts[i])], i)):
            if len(shown) <= width:
                break
            dropped.add(i)
            shown = _without(ps, dropped)
        out.append(shown if len(shown) <= width else _cut(shown, max(width, 0)))
    alike = Counter(out)
    return [shown if alike[shown] == 1 or shown == text else safe_text(text, width=width)
            for shown, text in zip(out, texts)]


def _without(pieces: Sequence[str], dropped: set[int]) -> str:
    """A path split by ``_PARTS`` with its ``dropped`` parts (numbered from 0) left out, each run as ``…``."""
    out = []
    for i, part in enumerate(pieces[0::2]):
        if i and not (i in dropped and i - 1 in dropped):
            out.append(pieces[2 * i - 1])
        if i not in dropped:
            out.append(part)
        elif i - 1 not in dropped:
            out.append("…")
    return "".join(out)


def one_line(message: Any) -> str:
    """A diagnostic as one printable line: whitespace runs (newlines included) as one space, the rest escaped.

    >>> one_line("bad name 'a\\nforged'\\x1b[31m")
    "bad name 'a forged'\\\\x1b[31m"
    """
    return safe_text(" ".join(str(message).split()))


def _map_nested(value: Any, leaf: Any, key: Any = None) -> Any:
    """``value`` with every dict, list and tuple rebuilt (tuples as lists, keys through ``key``) and every other
    value through ``leaf``; iterative, so metadata nested 900 deep is no ``RecursionError``."""
    top: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(top, 0, value)]
    while stack:
        holder, slot, node = stack.pop()
        if isinstance(node, dict):
            new: Any = {}
            for k, v in node.items():
                k = key(k) if key is not None else k
                new[k] = None  # the order of the keys, filled below
                stack.append((new, k, v))
        elif isinstance(node, (list, tuple)):
            new = [None] * len(node)
            stack.extend((new, i, v) for i, v in enumerate(node))
        else:
            new = leaf(node)
        holder[slot] = new
    return top[0]


def json_safe(value: Any) -> Any:
    """Replace NaN and +-Inf floats by None anywhere in a JSON-like value (JSON has no NaN).

    >>> json_safe({"a": [1.0, float("nan")]})
    {'a': [1.0, None]}
    """
    def bad(v: Any) -> bool:
        return isinstance(v, float) and not math.isfinite(v)

    # Copy on write, children before parents, no recursion: a report of 144,629 leaves with no NaN is returned as
    # it is (rebuilding it doubled what to_json holds), and metadata nested 900 deep is no RecursionError.
    if not isinstance(value, (dict, list, tuple)):
        return None if bad(value) else value
    done: dict[int, Any] = {}
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        node, expanded = stack.pop()
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        if not expanded:
            stack.append((node, True))
            stack.extend((v, False) for _, v in items if isinstance(v, (dict, list, tuple)) and id(v) not in done)
            continue
        new = [(k, done[id(v)] if isinstance(v, (dict, list, tuple)) else (None if bad(v) else v)) for k, v in items]
        if all(a is b[1] for (_, a), b in zip(items, new)):
            done[id(node)] = node
        else:
            done[id(node)] = dict(new) if isinstance(node, dict) else [v for _, v in new]
    return done[id(value)]


def json_text(value: Any, *, allow_nan: bool = True) -> str:
    """``json.dumps(value, indent=2)``, the same text, built in one buffer: ``json.dumps`` with an indent joins a
    list of every small piece (three million for a report of 144,629 leaves: 180 MB beside a 35 MB text).

    >>> json_text({"a": [1, None]}) == json.dumps({"a": [1, None]}, indent=2)
    True
    """
    import io

    out = io.StringIO()
    for piece in json.JSONEncoder(indent=2, allow_nan=allow_nan).iterencode(value):
        out.write(piece)
    return out.getvalue()


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
    def leaf(v: Any) -> Any:
        if isinstance(v, (str, int, float, bool)) or v is None:
            return v
        return v.tolist() if hasattr(v, "tolist") else str(v)

    return _map_nested(value, leaf, key=str)


def bytes_text(n: int) -> str:
    """A byte total as every footer prints it: ``600 bytes``, ``2,097,152 bytes (2.00 MiB)``."""
    return f"{n:,} bytes" + (f" ({human(n, 'B')})" if n >= 1024 else "")


def format_stat(v: Any) -> str:
    """A statistic (or a metric value read from a checkpoint) as a table cell: floats to 4 significant digits,
    anything else as safe text."""
    return f"{v:.4g}" if isinstance(v, float) else safe_text(v, width=CELL_WIDTH)


def shape_cell(r: Row) -> str:
    """A leaf's shape; a group's leaf count, with the shape they all share: ``24 x (8, 8)``.

    >>> shape_cell(Row(("w",), (2, 3), "float32", 6, 24)), shape_cell(Row(("g",), None, "float32", 12, 48, leaves=2))
    ('(2, 3)', '2 leaves')
    """
    if r.leaves == 1:
        return format_shape(r.shape)
    if r.leaf_shape is not None:
        return f"{r.leaves} x {format_shape(r.leaf_shape)}"
    return f"{r.leaves} leaves"


def row_cells(rows: Sequence[Row], columns: Sequence[str], *, strip: int = 0, label: str = "params",
              path_width: int | None = CELL_WIDTH) -> tuple[list[str], list[list[str]]]:
    """``(headers, cells)`` of ``rows`` for the named columns: the one way every table of rows (``tabulate_params``,
    ``inspect``, ``diff``'s added and removed leaves) turns a ``Row`` into text.

    Columns: ``path`` (the path below its first ``strip`` parts, escaped, cut at ``path_width``), ``leaves``,
    ``shape`` (``format_shape``), ``shape_cell`` (headed ``shape``: a group's leaf count too, ``shape_cell``),
    ``layers``, ``dtype``, ``count`` (headed ``label``), ``bytes``, ``sharding``, ``weight_decay``, and any
    statistic of ``STAT_COLUMNS`` (empty for a row without statistics).

    >>> row_cells([Row(("enc", "w"), (4,), "float32", 4, 16)], ["path", "shape", "count", "bytes", "mean"])
    (['path', 'shape', 'params', 'bytes', 'mean'], [['enc/w', '(4,)', '4', '16 B', '']])
    """
    cells: dict[str, Callable[..., str]] = {
        "path": lambda r: safe_text(r.sep.join(r.path[strip:]) or r.name, width=path_width),
        "leaves": lambda r: str(r.leaves),
        "shape": lambda r: format_shape(r.shape),
        "shape_cell": shape_cell,
        "layers": lambda r: "" if r.layers is None else str(r.layers),
        "dtype": lambda r: safe_text(r.dtype or ""),
        "count": lambda r: f"{r.params:,}",
        "bytes": lambda r: human(r.bytes, "B"),
        "sharding": lambda r: "" if r.sharding is None else safe_text(r.sharding, width=CELL_WIDTH),
        "weight_decay": lambda r: MIXED if r.weight_decay is None else str(r.weight_decay),
    }
    for name in STAT_COLUMNS:
        cells[name] = lambda r, name=name: "" if r.stats is None else format_stat(stat_value(r.stats, name))
    headers = {"shape_cell": "shape", "count": label}
    return [headers.get(c, c) for c in columns], [[cells[c](r) for c in columns] for r in rows]


def footer(t: Totals, *, label: str = "params", markdown: bool = False, not_params: Mapping[str, int] | None = None
           ) -> str:
    """The totals under a table of rows: the count and bytes, then one line per dtype when there are several; with
    ``not_params`` (an nnx state's RNG state, batch statistics), the parameters apart from those.

    >>> print(footer(Totals(6, 20, {"float32": {"params": 4, "bytes": 16}, "int8": {"params": 2, "bytes": 4}})))
    Total: 6 params, 20 bytes
      float32: 4 params, 16 B
      int8: 2 params, 4 B
    """
    counted = f"{format_count(t.params)} {label}"
    if not_params:  # an nnx state: its parameters apart from its RNG state and batch statistics
        others = ", ".join(f"{format_count(n)} {kind}" for kind, n in not_params.items())
        counted += f" ({format_count(t.params - sum(not_params.values()))} params, {others})"
    lines = [f"Total: {counted}, {bytes_text(t.bytes)}"]
    if len(t.by_dtype) > 1:
        indent = "- " if markdown else "  "  # in markdown a list, so the lines do not run together
        lines += [f"{indent}{dtype}: {format_count(d['params'])} {label}, {human(d['bytes'], 'B')}"
                  for dtype, d in t.by_dtype.items()]
    if markdown and len(lines) > 1:
        lines.insert(1, "")
    return "\n".join(lines)


TREE_INDENT = 32
"""Levels the tree view indents; a deeper line says its depth instead (``[depth 40] name``): a name of 3,000
parts would otherwise print 9 MB of spaces (the view grew with the square of a name's depth)."""


def tree_indent(depth: int) -> str:
    """The indentation of a tree line at ``depth``: two spaces a level up to ``TREE_INDENT``, then the depth said.

    >>> tree_indent(2), tree_indent(40)[-11:]
    ('    ', '[depth 40] ')
    """
    if depth <= TREE_INDENT:
        return "  " * depth
    return "  " * TREE_INDENT + f"[depth {depth}] "


def folder_chains(paths: Sequence[Sequence[str]], values: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """For each path, the folders above its leaf (one per leading part), each a list of totals summed over every
    path under that folder; two paths under the same folder share its list (compare with ``is``).

    Linear in the parts of all paths (the folders form a trie), where keying each folder by its prefix tuple was
    quadratic in a path's depth.

    >>> chains = folder_chains([("a", "x"), ("a", "y"), ("b",)], [(1,), (2,), (4,)])
    >>> [[f[1:] for f in c] for c in chains], chains[0][0] is chains[1][0]
    ([[[3]], [[3]], []], True)
    """
    root: dict[str, Any] = {}
    out = []
    for path, vals in zip(paths, values):
        children, chain = root, []
        for part in path[:-1]:
            folder = children.get(part)
            if folder is None:
                folder = children[part] = [{}, *([0] * len(vals))]
            for i, v in enumerate(vals):
                folder[i + 1] += v
            chain.append(folder)
            children = folder[0]
        out.append(chain)
    return out


def render_tree(rows: Sequence[Row], *, strip: int = 0, label: str = "params", sizes: bool = False) -> str:
    """An indented tree: a folder line per path prefix with its subtotal, then each row with its shape, dtype, count
    and sharding; ``sizes`` adds the bytes to every line (``inspect --format tree``). Linear in the parts of all
    paths: folders summed in a trie (``folder_chains``), at most ``TREE_INDENT`` levels indented.

    >>> print(render_tree([Row(("enc", "w"), (4,), "float32", 4, 16), Row(("enc", "b"), (4,), "float32", 4, 16)],
    ...                   sizes=True))
    enc/  8 params, 32 B
      w (4,) float32  4 params, 16 B
      b (4,) float32  4 params, 16 B
    """
    chains = folder_chains([r.path[strip:] for r in rows], [(r.params, r.bytes) for r in rows])

    def counted(params: int, nbytes: int) -> str:
        return f"{format_count(params)} {label}" + (f", {human(nbytes, 'B')}" if sizes else "")

    lines: list[str] = []
    opened: list[Any] = []
    for r, chain in zip(rows, chains):
        parts = r.path[strip:]
        common = 0
        while common < min(len(opened), len(chain)) and opened[common] is chain[common]:
            common += 1
        del opened[common:]
        for depth in range(common, len(chain)):
            _, params, nbytes = chain[depth]
            lines.append(tree_indent(depth) + f"{safe_text(parts[depth], width=CELL_WIDTH)}{r.sep}  "
                         f"{counted(params, nbytes)}")
            opened.append(chain[depth])
        last = safe_text(parts[-1] if parts else r.name, width=CELL_WIDTH)
        shape = f" {shape_cell(r)}" if r.shape is not None or r.leaves != 1 else ""
        dtype = f" {r.dtype}" if r.dtype else ""
        spec = f" {safe_text(r.sharding, width=CELL_WIDTH)}" if r.sharding is not None else ""
        lines.append(tree_indent(max(len(parts) - 1, 0)) + f"{last}{shape}{dtype}  {counted(r.params, r.bytes)}{spec}")
    return "\n".join(lines)


def _plain(headers: Sequence[str], data: Sequence[Sequence[str]]) -> bool:
    """Whether every cell is printable ASCII (one column a character, no line breaks, no escape codes)."""
    return all(c.isascii() and c.isprintable() for c in headers) and all(
        c.isascii() and c.isprintable() for row in data for c in row)


def _simple_table(headers: Sequence[str], data: Sequence[Sequence[str]]) -> str:
    """tabulate's ``simple`` format of string cells (``disable_numparse``), byte for byte, without its per-cell
    type detection (26x the time at 100,000 rows): columns left aligned, each as wide as its widest cell and at
    least its header plus 2, joined by two spaces, lines right-stripped; a dashed line under the headers.
    Only for printable ASCII cells (``_plain``); tabulate does the rest."""
    data = [[c.strip() for c in row] for row in data]  # tabulate strips each cell
    widths = [len(h) + 2 for h in headers]
    for row in data:
        for i, c in enumerate(row):
            if len(c) > widths[i]:
                widths[i] = len(c)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers).rstrip(), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*row).rstrip() for row in data]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- one table fitter

PATH_MIN = 40
"""A fitted table's path column keeps at least this many characters while a ``droppable`` column can go."""


@dataclasses.dataclass(frozen=True)
class Table:
    """A table as text (``fit_table``): ``dropped`` the columns left out to fit that held something (a column
    empty on every row goes unsaid: it hides nothing), ``cut`` whether a path was shortened (``…``)."""

    text: str
    dropped: tuple[str, ...] = ()
    cut: bool = False


def fit_table(headers: Sequence[str] | None, rows: Sequence[Sequence[str]], *, style: str = "simple",
              fit: bool = True, paths: bool = False, droppable: Sequence[str] = (),
              right: Sequence[int] = ()) -> Table:
    """Cells as a table that fits ``width()`` columns: the one way every table treetools prints is laid out.

    ``style``: ``simple`` (tabulate's, the terminal tables), ``github`` (markdown), ``plain`` (columns joined
    by two spaces, the headers as the first line, no rule; ``right`` the columns aligned right), or any other
    tabulate format. Cells are text as shown (escaped by the caller), but with ``paths`` the first column's raw
    names, escaped and cut here. The one width rule, with ``fit`` on a terminal table (markdown is read
    rendered, not on a terminal: never fitted, its paths cut at ``CELL_WIDTH`` only): while the table is wider
    than ``width()``, the columns empty on every row go first, then those of ``droppable`` in order, then (with
    ``paths``) the path column is cut to what the others leave (``cut_paths``: the parts the rows share go
    first, what tells them apart stays); with ``paths`` a ``droppable`` column only goes while the paths would
    get under ``PATH_MIN`` characters, or where leaving the rest out shows every path whole (a whole path pastes
    into ``inspect --show``).

    >>> set_width(None); print(fit_table(["path", "n"], [["a/b", "1"]]).text)
    path    n
    ------  ---
    a/b     1
    >>> fit_table(["path", "note"], [["w", "x" * 120]], droppable=["note"])
    Table(text='path\\n------\\nw', dropped=('note',), cut=False)
    """
    markdown = style == "github"
    cols = len(headers) if headers is not None else max(map(len, rows), default=0)
    names = list(headers) if headers is not None else [str(i) for i in range(cols)]
    whole = [safe_text(r[0]) for r in rows] if paths else []
    longest = max(map(len, whole), default=0)

    def render(keep: Sequence[int], room: int | None, stand_in: str | None = None) -> tuple[str, bool]:
        shown = [list(r) for r in rows]
        cut = False
        if paths:
            if stand_in:
                cells = [stand_in] * len(rows)
            else:
                cells = whole if room is None else cut_paths([r[0] for r in rows], room)
                cut = cells != whole
            for line, c in zip(shown, cells):
                line[0] = c
        heads = [names[i] for i in keep] if headers is not None else None
        aligned = [keep.index(i) for i in right if i in keep]
        return _layout(heads, [[r[i] for i in keep] for r in shown], style, aligned), cut

    if markdown or not fit:
        text, cut = render(range(cols), CELL_WIDTH if paths else None)
        return Table(text, (), cut)
    room = width()
    empty = [names[i] for i in range(1, cols) if rows and not any(str(r[i]).strip() for r in rows)]
    order = [*empty, *(h for h in droppable if h in names and h not in empty)]

    def path_room(keep: Sequence[int]) -> int:
        # What the other columns take, measured on a table whose path cells are 8 characters (wider than the
        # header "path" with its padding, so the column is exactly 8 wide).
        return max(room - (max(map(len, render(keep, None, "x" * 8)[0].splitlines())) - 8), 12)

    dropped: list[str] = []
    while True:
        keep = [i for i in range(cols) if names[i] not in dropped]
        left = [h for h in order if h not in dropped]
        if paths:
            have = path_room(keep)
            wide = have < longest
            worth = have < PATH_MIN or path_room([i for i in keep if names[i] not in left]) >= longest
            if not (wide and left and worth):
                text, cut = render(keep, have)
                return Table(text, tuple(h for h in dropped if h not in empty), cut)
        else:
            text, _ = render(keep, None)
            if not (left and max(map(len, text.splitlines()), default=0) > room):
                return Table(text, tuple(h for h in dropped if h not in empty))
        dropped.append(left[0])


def _layout(headers: Sequence[str] | None, rows: Sequence[Sequence[str]], style: str, right: Sequence[int]) -> str:
    """The cells laid out in ``style`` (``fit_table``), nothing fitted."""
    if style == "plain":
        table = ([list(headers)] if headers is not None else []) + [list(r) for r in rows]
        if not table:
            return ""
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                         .rstrip() for r in table)
    if style == "simple" and headers is not None and rows and _plain(headers, rows):
        return _simple_table(headers, rows)
    from tabulate import tabulate

    return tabulate(rows, headers=list(headers) if headers is not None else (), tablefmt=style,
                    disable_numparse=True)


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
        return json_text({**total.to_json(), "leaves": [r.to_json() for r in rows]})
    if fmt == "tree":
        return render_tree(rows, strip=strip, label=count_label) + "\n" + footer(total, label=count_label)
    if fmt not in ("table", "markdown"):
        raise ValueError(f"`fmt` must be one of table, markdown, tree, json; got {fmt!r}.")
    columns = ["path", "shape", "dtype", "count", "bytes", "sharding"]
    if any(r.layers is not None for r in rows):  # stacked (scanned) leaves: how many layers each holds
        columns.insert(2, "layers")
    if any(r.leaves != 1 for r in rows):
        columns.insert(1, "leaves")
    if show_weight_decay:
        columns.append("weight_decay")
    if stat_columns and any(r.stats is not None for r in rows):
        columns += list(stat_columns)
    headers, data = row_cells(rows, columns, strip=strip, label=count_label)
    body = fit_table(headers, data, style="github" if fmt == "markdown" else tablefmt, fit=False).text
    return body + "\n\n" + footer(total, label=count_label, markdown=fmt == "markdown")


