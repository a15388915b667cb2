"""The README's Python examples run as written.

Every ```python block of README.md is executed, in README order, in one shared
namespace (a later block may use what an earlier one defined, as a reader
would). A block written as a doctest (``>>>`` prompts) is run by ``doctest``,
its printed output checked. A block right after an ``<!-- notest -->`` line is
shown to readers but not run (it needs things the README cannot provide, such
as a trainer's live gradients); the test reports it as skipped, by section.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
NOTEST = "<!-- notest -->"


def _blocks() -> list[tuple[str, int, str, bool]]:
    """``(id, line, code, skipped)`` for every ```python block, in README order."""
    lines = README.read_text(encoding="utf-8").splitlines()
    out, section, counts, i = [], "top", {}, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-")
        if line.strip() == "```python":
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            before = [x.strip() for x in lines[max(0, i - 2):i] if x.strip()]
            counts[section] = counts.get(section, 0) + 1
            out.append((f"{section}-{counts[section]}", start + 1, "\n".join(lines[start:j]) + "\n",
                        bool(before) and before[-1] == NOTEST))
            i = j
        i += 1
    return out


BLOCKS = _blocks()
_namespace: dict = {"__name__": "readme"}
_ran: list[int] = []  # indices of the blocks run so far (in order)


def _run(index: int) -> None:
    block_id, line, code, _ = BLOCKS[index]
    filename = f"README.md:{line}"
    if re.search(r"^\s*>>> ", code, re.M):
        test = doctest.DocTestParser().get_doctest(code, _namespace, block_id, filename, line - 1)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        failures = []
        runner.run(test, out=failures.append, clear_globs=False)
        assert runner.failures == 0, f"{filename} ({block_id}):\n" + "".join(failures)
    else:
        exec(compile(code, filename, "exec"), _namespace)


def test_readme_has_python_examples():
    ids = [b[0] for b in BLOCKS]
    assert "counting-and-tables-1" in ids and "masks-and-labels-for-optax-1" in ids


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b[0] for b in BLOCKS])
def test_readme_block_runs(index, devices):
    # Blocks before this one (when a test is selected alone) run first, as a reader runs them.
    for earlier in range(len(_ran) and _ran[-1] + 1, index):
        if not BLOCKS[earlier][3]:
            try:
                _run(earlier)
            except Exception:  # reported by that block's own test
                pass
        _ran.append(earlier)
    if BLOCKS[index][3]:
        _ran.append(index)
        pytest.skip(f"README block {BLOCKS[index][0]} (line {BLOCKS[index][1]}) is marked {NOTEST}")
    _ran.append(index)
    _run(index)


def test_make_demo_keeps_a_run_the_user_extended(tmp_path):
    # Issue 24.25: `make demo` deleted runs/demo, a run extended with `treetools train --workdir runs/demo --steps
    # 400` (the example of `treetools train --help`) included. Now it keeps it and says so.
    import json
    import os
    import shutil
    import subprocess
    import sys

    import numpy as np
    import orbax.checkpoint as ocp

    venv = Path(sys.executable).parent.parent
    if shutil.which("make") is None or not (venv / "bin" / "treetools").exists():
        pytest.skip("needs make and the treetools script beside this Python")
    workdir = tmp_path / "runs" / "demo"
    with ocp.CheckpointManager(workdir / "checkpoints") as mngr:  # the run, as extended to step 400
        for step in (300, 400):
            mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.full(3, step, np.float32)}),
                                                    data_iter=ocp.args.JsonSave({"index": step})))
        mngr.wait_until_finished()
    metrics = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(20, 401, 20))
    (workdir / "metrics.jsonl").write_text(metrics)
    (workdir / "notes.txt").write_text("my run")
    before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
    # The venv is there already (-o: its stamp is not remade); the demo's two commands run as written.
    proc = subprocess.run(["make", "-s", "-C", str(README.parent), "-o", f"{venv}/.installed-demo", "demo",
                           f"VENV={venv}", f"WORKDIR={workdir}"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MAKEFLAGS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"make demo: {workdir} holds a run already; keeping it"), proc.stdout
    assert "steps: 300, 400 (showing 400)" in proc.stdout  # then inspected, as the README says
    assert "is already at step 400 >= --steps 200; nothing to train" in proc.stderr
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before
    assert (workdir / "metrics.jsonl").read_text() == metrics and (workdir / "notes.txt").read_text() == "my run"
