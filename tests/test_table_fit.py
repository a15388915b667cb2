"""One table fitter (issue 45): every table treetools prints is laid out and fitted to the width by
``treetools.shared.render.fit_table``, with one width constant (``WIDTH``) and one width rule (``width()``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tabulate import tabulate

from treetools.shared import render
from treetools.shared.render import PATH_MIN, WIDTH, fit_table, set_width

PACKAGE = Path(render.__file__).resolve().parent.parent


@pytest.fixture
def columns():
    """``set_width`` for one test, back to the default after it."""
    yield set_width
    set_width(None)


def _widest(text: str) -> int:
    return max(map(len, text.splitlines()))


def test_no_other_module_lays_out_or_fits_a_table():
    # Before: inspect's _table, diff's _diff_table, the memory plan's _table (its own `WIDTH = 100`) and the
    # ljust joins of convert --dry-run, Rules.describe's rows and RestorePlan.describe each did it their way.
    for path in PACKAGE.rglob("*.py"):
        if path.name == "render.py" and path.parent.name == "shared":
            continue
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(PACKAGE)
        assert not re.search(r"\btabulate\(", text) or "def tabulate_params" in text, where
        assert not re.search(r"\bfrom tabulate import|\bimport tabulate\b", text), where
        assert not re.search(r"^WIDTH\s*=", text, re.M), where  # one width constant
        assert "get_terminal_size" not in text, where  # one width rule
        assert not re.search(r"\.ljust\(w\)", text), where


def test_simple_is_tabulates_format_and_plain_joins_with_two_spaces():
    headers, rows = ["path", "n"], [["a/b", "1"], ["c", "22"]]
    assert fit_table(headers, rows, fit=False).text == tabulate(rows, headers=headers, disable_numparse=True)
    assert fit_table(headers, rows, style="github").text == tabulate(rows, headers=headers, tablefmt="github",
                                                                     disable_numparse=True)
    # plain: the headers as the first line, columns as wide as their widest cell, two spaces, lines stripped
    assert fit_table(headers, rows, style="plain", right=[1]).text == "path   n\na/b    1\nc     22"
    assert fit_table(None, rows, style="plain").text == "a/b  1\nc    22"


def test_columns_empty_on_every_row_go_first_unsaid_then_droppable_in_order(columns):
    headers = ["path", "a", "empty", "b"]
    rows = [["w", "x" * 30, "", "y" * 30]]
    columns(200)
    assert fit_table(headers, rows, droppable=["b", "a"]).text.splitlines()[0].split() == headers  # fits
    columns(70)  # 1 + 30 + 5 + 30 and separators: 74 wide; without the empty column 67
    t = fit_table(headers, rows, droppable=["b", "a"])
    assert t.text.splitlines()[0].split() == ["path", "a", "b"] and t.dropped == ()
    columns(60)  # MIN_WIDTH: then b goes, said
    t = fit_table(headers, rows, droppable=["b", "a"])
    assert t.text.splitlines()[0].split() == ["path", "a"] and t.dropped == ("b",)
    assert fit_table(headers, rows, droppable=["b", "a"], fit=False).dropped == ()  # not fitted: all kept


def test_paths_get_what_the_other_columns_leave(columns):
    names = [f"opt_state/{i}/mu/params/layers_{i}/attention/query/kernel" for i in range(3)]
    rows = [[n, "x" * 40, "yes"] for n in names]
    columns(80)
    t = fit_table(["path", "other", "allclose"], rows, paths=True)
    assert t.cut and _widest(t.text) <= 80
    shown = [line.split()[0] for line in t.text.splitlines()[2:]]
    assert len(set(shown)) == 3 and all("…" in s for s in shown)  # each still tells its row apart
    # a droppable column goes where that lets every path show whole
    t = fit_table(["path", "other", "allclose"], rows, paths=True, droppable=["other"])
    assert t.dropped == ("other",) and not t.cut and [line.split()[0] for line in t.text.splitlines()[2:]] == names
    # markdown is not fitted: every column, paths whole up to CELL_WIDTH
    md = fit_table(["path", "other", "allclose"], rows, style="github", paths=True, droppable=["other"])
    assert md.dropped == () and not md.cut and all(n in md.text for n in names)


def test_a_droppable_column_stays_while_the_paths_keep_path_min(columns):
    rows = [["p" * 100, "x" * 10]]
    columns(80)  # the path gets 80 - 12 = 68 >= PATH_MIN: "other" stays, the path is cut
    t = fit_table(["path", "other"], rows, paths=True, droppable=["other"])
    assert t.dropped == () and t.cut and _widest(t.text) == 80
    columns(60)
    rows = [["p" * 100, "x" * 30]]  # 60 - 32 = 28 < PATH_MIN: "other" goes
    assert 60 - 32 < PATH_MIN
    t = fit_table(["path", "other"], rows, paths=True, droppable=["other"])
    assert t.dropped == ("other",) and _widest(t.text) <= 60


def test_the_memory_plan_and_every_text_view_share_the_width(columns):
    from treetools.pytree import plan_text

    rows = [(f"params/encoder/layers_{i}/" + "very_long_module_name/" * 4 + "kernel", "(4096, 4096)", "float32",
             "dim 0 over fsdp (8)", "8.00 MiB") for i in range(3)]
    lines = plan_text._table(("path", "shape", "dtype", "could split", "bytes"), rows)
    assert max(map(len, lines)) <= WIDTH and all(line.endswith("8.00 MiB") for line in lines[1:])
    columns(200)
    wide = plan_text._table(("path", "shape", "dtype", "could split", "bytes"), rows)
    assert [line.split()[0] for line in wide[1:]] == [r[0] for r in rows]  # a wide terminal shows them whole
    assert "\n" not in "".join(plan_text._table(("path", "bytes"), [("a\nforged", "1 B")]))  # escaped
