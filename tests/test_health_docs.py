"""docs/health.md runs as written: every ```python block in order, in one namespace, each block's printed
output equal to the ```text block right after it (when there is one)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "health.md"


def _blocks() -> list[tuple[str, str | None]]:
    """``(code, expected output or None)`` per python block."""
    text = DOC.read_text(encoding="utf-8")
    found = re.findall(r"```(python|text)\n(.*?)\n```", text, flags=re.S)
    out: list[tuple[str, str | None]] = []
    for kind, body in found:
        if kind == "python":
            out.append((body, None))
        elif out and out[-1][1] is None:
            out[-1] = (out[-1][0], body)
    return out


def test_docs_health_examples_run_and_print_what_the_doc_says(tmp_path, monkeypatch, devices):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks()
    assert len(blocks) == 4 and all(expected is not None for _, expected in blocks)
    namespace: dict = {"__name__": "docs_health"}
    for i, (code, expected) in enumerate(blocks):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"docs/health.md (block {i})", "exec"), namespace)
        assert printed.getvalue().strip() == expected.strip(), f"block {i}"
    assert namespace["dump_path"].endswith("health_00000027.json")


def test_the_figure_the_doc_shows_is_committed():
    assert "](health_spike.png)" in DOC.read_text()
    assert (DOC.parent / "health_spike.png").read_bytes().startswith(b"\x89PNG")
    assert (DOC.parent / "health_spike.py").is_file()
