"""Every code block of README.md and docs/*.md runs as pasted (issue 39.21).

* A ```python block runs **on its own**, in a fresh namespace and a fresh current folder, with nothing given to
  it: it imports what it uses and makes what it reads (a tiny checkpoint in a temporary folder). A block written
  as a doctest (``>>>`` prompts) is run by ``doctest``, its printed output checked. A block that reads
  ``gs://my-bucket`` / ``s3://my-bucket`` runs against the local S3 and GCS emulators (tests/_buckets.py) where
  the test has put a small run under that name: the bucket is the reader's, as a checkpoint path is.
* A ```bash block holds ``treetools`` commands on the runs ``make demo`` and the README's trainer examples leave
  (``runs/demo``, ``runs/scan``: made here by the reference trainer, with its defaults); each line runs, in
  order, in the folder holding ``runs/``, and exits 0 (``diff``: 0 or 1, as documented).
* A block right after an ``<!-- illustrative: WHY -->`` line is shown, not run: it needs what no test can make
  here (a bucket with credentials, a checkpoint only T5X writes, an install). WHY says so and names the test file
  that runs the same thing on a stand-in; a test checks that file exists.
* An unlabelled block is text (a synopsis, printed output): one holding a plain ``treetools`` command must be
  labelled ``bash`` (and so run, or be marked illustrative).
"""

from __future__ import annotations

import dataclasses
import doctest
import re
import shlex
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ILLUSTRATIVE = re.compile(r"^<!-- illustrative: (.*?) -->$")
SHELL = ("bash", "sh", "shell", "console")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # "README.md", "docs/cli.md"
    line: int  # of the block's first line of code, 1-based
    lang: str  # "" when unlabelled
    code: str
    illustrative: str | None  # the reason given, for a block marked illustrative

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = re.fullmatch(r"```(\w*)", lines[i].strip())
            if fence is None:
                i += 1
                continue
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            marker = ILLUSTRATIVE.match(lines[i - 1].strip()) if i else None
            out.append(Block(page.relative_to(ROOT).as_posix(), i + 2, fence.group(1), "\n".join(lines[i + 1:j]) + "\n",
                             marker.group(1) if marker else None))
            i = j + 1
    return out


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.illustrative is None]
COMMANDS = [b for b in BLOCKS if b.lang in SHELL and b.illustrative is None]


def test_the_pages_have_blocks_of_each_kind():
    pages = {b.page for b in PYTHON}
    assert {"README.md", "docs/cli.md", "docs/convert.md", "docs/formats.md", "docs/rules.md"} <= pages, pages
    assert {"README.md", "docs/cli.md"} <= {b.page for b in COMMANDS}


def test_every_illustrative_block_says_why_and_names_the_test_that_runs_it_instead():
    marked = [b for b in BLOCKS if b.illustrative is not None]
    assert marked
    for block in marked:
        tests = re.findall(r"tests/[\w/]+\.py", block.illustrative)
        assert len(block.illustrative) > 40 and tests, f"{block.id}: say why it is not run, and which test runs it"
        assert all((ROOT / name).is_file() for name in tests), (block.id, tests)
    # a marker that is not right above a block marks nothing
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if ILLUSTRATIVE.match(line.strip()):
                assert n + 1 < len(lines) and lines[n + 1].startswith("```"), f"{page.name}:{n + 1}: marks no block"


def test_no_unlabelled_block_hides_a_command():
    for block in BLOCKS:
        if block.lang:
            continue
        commands = [line for line in block.code.splitlines()
                    if re.match(r"(treetools|pip|make) ", line) and "[" not in line.split("#")[0]]
        assert not commands, f"{block.id}: label it ```bash (run, or marked illustrative): {commands[0]}"


def _registered_formats() -> set[str]:
    from treetools.checkpoint_io.registry import registered_formats

    return {f.name for f in registered_formats()}


def _bucket_run(request, tmp_path) -> dict:
    """``gs://my-bucket`` and ``s3://my-bucket`` on the local emulators, each holding a small Orbax run at
    ``runs/llm/checkpoints`` (the test's stand-in for the reader's); its params, as saved."""
    import numpy as np

    import treetools as tt
    from tests._buckets import Store, _create_bucket

    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    run = tmp_path / "llm"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=run)
    tt.save_checkpoint(mngr, 1, {"params": params}, wait=True)
    mngr.close()
    for name in ("_s3_service", "_gcs_service"):
        service = request.getfixturevalue(name)
        try:
            _create_bucket(service, "my-bucket")
        except RuntimeError as e:  # made by an earlier block of this session
            if not re.search(r"\b409\b|already", str(e)):
                raise
        store = Store(service.scheme, "my-bucket", service.counter.url, dict(service.env), service.counter)
        store.upload(run, "runs", "llm", "checkpoints")
        store.restart_clients()
    return params


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs_on_its_own(block, devices, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)  # whatever it writes, in a fresh folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and its mkdtemp() folders under it
    saved = _bucket_run(request, tmp_path / "bucket") if re.search(r"(gs|s3)://my-bucket/", block.code) else None
    formats = _registered_formats()
    namespace: dict = {"__name__": "__main__"}
    try:
        if re.search(r"^\s*>>> ", block.code, re.M):
            test = doctest.DocTestParser().get_doctest(block.code, namespace, block.id, block.page, block.line - 1)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            failures: list[str] = []
            runner.run(test, out=failures.append, clear_globs=False)
            assert runner.failures == 0, f"{block.id}:\n" + "".join(failures)
        else:
            exec(compile(block.code, block.id, "exec"), namespace)  # noqa: S102 - the documentation's own code
    finally:
        from treetools.checkpoint_io.registry import unregister_format

        for name in _registered_formats() - formats:  # a format a block registered (and did not remove)
            unregister_format(name)
    if saved is not None:  # what it read from the buckets is the run put there
        import numpy as np

        assert {k: np.asarray(v).tolist() for k, v in namespace["params"].items()} == \
            {k: v.tolist() for k, v in saved.items()}


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """A folder holding ``runs/demo`` (what ``make demo`` leaves) and ``runs/scan`` (the README's
    ``treetools train --workdir runs/scan --scan-layers``), both trained by the reference trainer with its
    defaults (200 steps, checkpoints at 100 and 200)."""
    from treetools.reference.model import ModelConfig
    from treetools.reference.train import TrainConfig, train

    folder = tmp_path_factory.mktemp("docs")
    train(TrainConfig(workdir=str(folder / "runs" / "demo"), quiet=True))
    train(TrainConfig(workdir=str(folder / "runs" / "scan"), quiet=True, model=ModelConfig(scan_layers=True)))
    return folder


def _commands(block: Block) -> list[list[str]]:
    """Each line of a shell block as argv (its comment dropped); a line that is not a ``treetools`` command is an
    error (mark such a block illustrative)."""
    out = []
    for line in block.code.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        assert argv[0] == "treetools", f"{block.id}: `{line}` is not a treetools command; mark the block illustrative"
        out.append(argv[1:])
    return out


def _reads_and_writes(argv: list[str]) -> tuple[list[str], list[str]]:
    """The local paths a README command reads and those it creates, from its parsed arguments."""
    from treetools.cli import build_parser

    args = build_parser(argv[0]).parse_args(argv)
    reads = {"inspect": [args.path] if argv[0] == "inspect" else [], "plan": [getattr(args, "path", None)],
             "diff": [getattr(args, "a", None), getattr(args, "b", None)], "verify": getattr(args, "paths", []),
             "convert": [getattr(args, "src", None)], "plot": getattr(args, "metrics", []), "train": []}[argv[0]]
    writes = {"convert": [getattr(args, "dst", None)], "train": [getattr(args, "workdir", None)],
              "plot": [getattr(args, "output", None)]}.get(argv[0], [])
    local = lambda ps: [p.rstrip("/") for p in ps if p and "://" not in p]  # noqa: E731
    return local(reads), local(writes)


def test_readme_blocks_run_top_to_bottom():
    # Issue 47 (23): a reader runs the README's blocks in order; blocks used `runs/scan` two sections before the
    # one that trains it. Every path a block reads is made by `make demo` (runs/demo) or by an earlier line.
    made = ["runs/demo"]  # the first block: make demo
    for block in [b for b in COMMANDS if b.page == "README.md"]:
        for argv in _commands(block):
            reads, writes = _reads_and_writes(argv)
            for path in reads:
                assert any(path == m or path.startswith(m + "/") for m in made), \
                    f"{block.id}: treetools {shlex.join(argv)} reads {path} before any block above makes it"
            made += writes


@pytest.mark.parametrize("block", COMMANDS, ids=[b.id for b in COMMANDS])
def test_shell_block_runs_on_the_demo_runs(block, devices, demo_runs, monkeypatch, capsys):
    from treetools.cli import main

    monkeypatch.chdir(demo_runs)
    commands = _commands(block)
    assert commands
    for argv in commands:
        rc = main(argv)
        out, err = capsys.readouterr()
        allowed = (0, 1) if argv[0] == "diff" else (0,)  # diff: 0 same, 1 different (GNU diff's codes)
        assert rc in allowed, f"{block.id}: treetools {shlex.join(argv)} exited {rc}\n{out[-2000:]}\n{err[-2000:]}"


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
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "-o", f"{venv}/.installed-demo", "demo",
                           f"VENV={venv}", f"WORKDIR={workdir}"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MAKEFLAGS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"make demo: {workdir} holds a run already; keeping it"), proc.stdout
    assert "steps: 300, 400 (showing 400)" in proc.stdout  # then inspected, as the README says
    assert "is already at step 400 >= --steps 200; nothing to train" in proc.stderr
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before
    assert (workdir / "metrics.jsonl").read_text() == metrics and (workdir / "notes.txt").read_text() == "my run"
