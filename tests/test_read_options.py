"""One way in (issue 45): every command and library function that reads a checkpoint takes every read option,
and each option reaches the reader.

The checkpoint is an Orbax root whose step folder is a symlink to a folder outside it (a step kept on another
volume), so ``follow_links`` is needed to read it at all. For every reading command (found in the CLI's own
parser: a new command that reads is in the list without a change here) and every library entry point, and for
every read option (``tt.ReadOptions``' fields, the flags' one table ``READ_SETTINGS``), the test proves the
option took effect where the data is read:

* ``follow_links``: refused without it (the error names the flag), read with it;
* ``memory_budget``: a budget of 100 bytes refuses (the budget error, naming ``--memory-budget``);
* ``block_bytes``, ``workers``, ``share``: the block engine (``stream.job_plan``, spied) plans each reader
  with the block size given, and every reader holds a context with the threads and the share given; for
  ``--show`` (one read, not the block engine) the reader it reads carries them and its statistics take the
  block size; ``plan`` reads metadata only: the source is opened with them and a note says they change nothing;
* ``progress``: the progress bar is made enabled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os

import numpy as np
import pytest

import treetools as tt
from treetools import cli
from treetools.checkpoint_io import opening, stream
from treetools.checkpoint_io.context import READ_FIELDS, ReadContext, ReadOptions
from treetools.checkpoint_tools import progress as progress_mod
from treetools.checkpoint_tools import show as show_mod
from treetools.cli import _distributed
from treetools.shared.errors import CheckpointError
from treetools.shared.settings import READ_SETTINGS

BLOCK = 4096  # a block size no default has: 16 KiB of w is 4 blocks of it
WORKERS = 3
BUDGET = 100  # bytes: Orbax's _CHECKPOINT_METADATA alone (274 bytes, 2 KiB parsed) is over it

NOT_READING = {"train": "runs the reference trainer: writes a checkpoint, reads none"}
"""The commands that read no checkpoint; every other command of the CLI must have every reading flag."""


class OneProcess:
    """A share of a run of one process: the block engine reads everything, as alone; the object is the proof
    that ``--processes`` / ``share=`` reached the reader."""

    index, count = 0, 1

    def allgather(self, payload: bytes) -> list[bytes]:
        return [payload]


@pytest.fixture(scope="module")
def linked(tmp_path_factory):
    """An Orbax root whose only step folder is a symlink to a folder outside it; the array written."""
    base = tmp_path_factory.mktemp("linked")
    root, elsewhere = base / "root", base / "elsewhere"
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    manager = tt.get_checkpoint_manager(1, checkpoint_dir=str(root))
    tt.save_checkpoint(manager, 1, {"params": {"w": w}}, wait=True)
    manager.close()
    elsewhere.mkdir()
    os.rename(root / "1", elsewhere / "1")
    os.symlink(elsewhere / "1", root / "1")
    return str(root), w


@dataclasses.dataclass
class Seen:
    """What the spies saw: the block size the engine planned each reader with, the contexts of the readers
    read, the contexts checkpoints were opened with, the block size ``--show``'s statistics used, the progress
    bars made."""

    planned: list = dataclasses.field(default_factory=list)
    readers: list = dataclasses.field(default_factory=list)
    opened: list = dataclasses.field(default_factory=list)
    show_stats: list = dataclasses.field(default_factory=list)
    bars: list = dataclasses.field(default_factory=list)


@pytest.fixture
def seen(monkeypatch):
    got = Seen()
    job_plan, read, array_stats, opened = stream.job_plan, show_mod._read, show_mod.array_stats, opening._open
    bar_init = progress_mod.Progress.__init__

    def spy_plan(readers, block_bytes, **kw):
        got.planned.append(block_bytes)
        got.readers += [r.context for r in readers]
        return job_plan(readers, block_bytes, **kw)

    def spy_read(source, spec, item_name, leaf, index):
        got.readers.append(leaf.reader.context)
        return read(source, spec, item_name, leaf, index)

    def spy_stats(array, *, block_bytes):
        got.show_stats.append(block_bytes)
        return array_stats(array, block_bytes=block_bytes)

    def spy_open(location, display, context):
        got.opened.append(context)
        return opened(location, display, context)

    def spy_bar(self, *args, **kw):
        got.bars.append(kw.get("enabled"))
        bar_init(self, *args, **kw)

    monkeypatch.setattr(stream, "job_plan", spy_plan)
    monkeypatch.setattr(show_mod, "_read", spy_read)
    monkeypatch.setattr(show_mod, "array_stats", spy_stats)
    monkeypatch.setattr(opening, "_open", spy_open)
    monkeypatch.setattr(progress_mod.Progress, "__init__", spy_bar)
    return got


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------- the commands, from the parser


def _flags(command: str) -> set[str]:
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[command]
    return {s for action in sub._actions for s in action.option_strings}


READING = [c for c in cli.COMMANDS if c not in NOT_READING]

RECIPES = {  # command -> (name, argv builder(root, tmp)): one or more ways it reads a checkpoint's data
    "inspect": [("inspect --stats", lambda root, tmp: ["inspect", root, "--stats"]),
                ("inspect --show", lambda root, tmp: ["inspect", root, "--show", "params/w[0:2]", "--stats"])],
    "diff": [("diff --values", lambda root, tmp: ["diff", root, root, "--values"])],
    "verify": [("verify", lambda root, tmp: ["verify", root])],
    "convert": [("convert", lambda root, tmp: ["convert", root, tmp / "out.safetensors", "--overwrite"])],
    "plot": [("plot --stats", lambda root, tmp: ["plot", root, "--stats", "max", "-o", tmp / "s.png"])],
    "plan": [("plan", lambda root, tmp: ["plan", root])],
}
METADATA_ONLY = {"plan"}
"""Commands that read no array data: the data options are opened with and named in a note."""
ONE_READ = {"inspect --show"}
"""One slice in one read, not the block engine: no threads, no progress bar (a note says so)."""
ONE_PROCESS = {"plan"}
"""Commands that run in one process: ``--processes`` is a usage error saying so."""

def trouble(name: str) -> int:
    """The exit code of a known error: 1, and 2 for diff (GNU diff's "trouble")."""
    return 2 if name.startswith("diff") else 1


CASES = [(name, build) for command in READING for name, build in RECIPES.get(command, [(command, None)])]


def test_every_command_but_train_reads_and_has_every_reading_flag():
    # The list comes from the CLI: a new command is a reading one (with every flag, and a recipe above) unless
    # it is named in NOT_READING with the reason.
    assert set(READING) == set(RECIPES), f"add a recipe for {set(READING) - set(RECIPES)} (or name it in NOT_READING)"
    wanted = {s.flag for s in READ_SETTINGS.values()} | {"--no-progress", "--distributed"}
    wanted |= {s.alias[0] for s in READ_SETTINGS.values() if s.alias}
    for command in READING:
        assert wanted <= _flags(command), (command, wanted - _flags(command))
    assert not wanted & _flags("train")


def test_the_flags_table_is_the_read_options_fields():
    # One table: a row per tt.ReadOptions field, no more, no fewer (a new read option needs its flag).
    assert set(READ_SETTINGS) == {f.name for f in dataclasses.fields(ReadOptions)} == set(READ_FIELDS)


@pytest.mark.parametrize("name, build", CASES, ids=[c[0] for c in CASES])
def test_follow_links_reaches_the_reader(linked, tmp_path, name, build):
    root, _ = linked
    rc, out, err = run(*build(root, tmp_path))
    said = err + out  # verify reports what it could not read as a problem of the checkpoint, on stdout
    assert rc == trouble(name) and "--follow-links" in said and "outside the checkpoint" in said, (rc, said)
    rc, out, err = run(*build(root, tmp_path), "--follow-links")
    assert rc == 0, err


@pytest.mark.parametrize("name, build", CASES, ids=[c[0] for c in CASES])
def test_memory_budget_reaches_the_reader(linked, tmp_path, name, build):
    root, _ = linked
    for flag, value in (("--memory-budget", str(BUDGET)), ("--memory-budget-mb", f"{BUDGET / 2**20!r}")):
        rc, out, err = run(*build(root, tmp_path), "--follow-links", flag, value)
        said = err + out
        assert rc == trouble(name) and "memory budget of 100 B" in said and "--memory-budget " in said, (flag, said)


@pytest.mark.parametrize("name, build", CASES, ids=[c[0] for c in CASES])
def test_block_size_workers_and_processes_reach_the_reader(linked, tmp_path, seen, monkeypatch, name, build):
    root, _ = linked
    share = OneProcess()

    def join(self, args, argv):  # --processes N: this process's share (one process: the proof it arrives)
        if getattr(args, "processes", None):
            args.share = share
    monkeypatch.setattr(_distributed.Run, "join", join)
    argv = [*build(root, tmp_path), "--follow-links", "--block-size", "4KiB", "--workers", str(WORKERS)]
    if name in ONE_PROCESS:
        rc, _, err = run(*argv, "--processes", "2")
        assert rc == 2 and "--processes" in err and "one process" in err, err
    rc, _, err = run(*argv, *([] if name in ONE_PROCESS else ["--processes", "2"]))
    assert rc == 0, err
    assert seen.opened and all(c.block_bytes == BLOCK and c.workers == WORKERS for c in seen.opened)
    if name in METADATA_ONLY:
        assert not seen.readers and "--block-size, --workers change nothing" in err, err
        return
    assert seen.readers and all(c.block_bytes == BLOCK and c.workers == WORKERS and c.share is share
                                for c in seen.readers), seen.readers
    if name in ONE_READ:
        assert seen.show_stats == [BLOCK] and "--workers, --processes change nothing" in err, err
    else:
        assert seen.planned and set(seen.planned) <= {BLOCK, BLOCK // 2}, seen.planned  # convert's check: halves
        assert BLOCK in seen.planned
    rc, _, err = run(*build(root, tmp_path), "--follow-links", "--chunk-mb", f"{BLOCK / 2**20!r}")  # the alias
    assert rc == 0 and (seen.opened[-1].block_bytes == BLOCK), err


@pytest.mark.parametrize("name, build", CASES, ids=[c[0] for c in CASES])
def test_progress_reaches_the_bar(linked, tmp_path, seen, name, build):
    root, _ = linked
    for flag, enabled in (("--progress", True), ("--no-progress", False)):
        seen.bars.clear()
        rc, _, err = run(*build(root, tmp_path), "--follow-links", flag)
        assert rc == 0, err
        if name in METADATA_ONLY or name in ONE_READ:
            assert not seen.bars and f"{flag} change" in err, err  # no bar to draw: a note says so
        else:
            assert seen.bars and set(seen.bars) == {enabled}, seen.bars


def test_sizes_take_units_and_a_bad_one_is_one_line(linked, tmp_path, seen):
    root, _ = linked
    rc, _, err = run("inspect", root, "--follow-links", "--stats", "--block-size", "0.00390625MiB",
                     "--memory-budget", "1GB")
    assert rc == 0 and seen.opened[-1].block_bytes == BLOCK and seen.opened[-1].memory_budget == 10**9, err
    for flag, value, why in (("--block-size", "1x", "is not a size"), ("--block-size", "512", "below 1KiB"),
                             ("--memory-budget", "-3", "is not a size"), ("--device-memory", "lots", "not a size")):
        rc, _, err = run("plan", root, flag, value)
        line = err.strip().splitlines()[-1]
        assert rc == 2 and f"argument {flag}: " in line and why in line and "500MB" in line, err


# ----------------------------------------------------------------------------- the library


def _with(read: ReadOptions) -> dict:
    return {name: getattr(read, name) for name in READ_FIELDS}


def _verified(root: str, read: ReadOptions) -> None:
    """``verify_path``, whose report lists what it could not read as problems: raised here as the others raise."""
    from treetools.checkpoint_tools.verify import verify_path

    report = verify_path(root, **_with(read))
    if not report.ok:
        raise CheckpointError("; ".join(report.problems))


LIBRARY = {  # name -> (call(root, tmp, read), reads array data, draws a progress bar)
    "inspect_path": (lambda root, tmp, read: tt.inspect_path(root, stats=True, **_with(read)), True, True),
    "diff_paths": (lambda root, tmp, read: tt.diff_paths(root, root, values=True, **_with(read)), True, True),
    "verify_path": (lambda root, tmp, read: _verified(root, read), True, True),
    "convert": (lambda root, tmp, read: tt.convert(root, str(tmp / "o.safetensors"), overwrite=True, **_with(read)),
                True, True),
    "show_report": (lambda root, tmp, read: show_mod.show_report(root, "params/w[0:2]", stats=True, read=read),
                    True, False),
    "plan_checkpoint": (lambda root, tmp, read: tt.plan_checkpoint(root, read=read), False, False),
    "stats_report": (lambda root, tmp, read: __import__("treetools.checkpoint_tools.plot", fromlist=["x"])
                     .stats_report(root, read=read), True, True),
    "plot_stats": (lambda root, tmp, read: tt.plot_stats(root, "max", read=read), True, True),
    # The jax side's entry points: the context the checkpoint is opened with reaches every reader (and the
    # block engine, tests/test_restore_engine.py).
    "restore_checkpoint": (lambda root, tmp, read: tt.restore_checkpoint(root, None, _target(), read=read), False,
                           False),
    "plan_restore": (lambda root, tmp, read: tt.plan_restore(root, None, _target(), read=read), False, False),
    "load_parameters": (lambda root, tmp, read: tt.load_parameters(root, read=read), False, False),
}


def _target() -> dict:
    import jax

    return {"params": {"w": jax.ShapeDtypeStruct((64, 64), np.float32)}}


def _entries(kinds=("options", "context")):
    out = []
    for name in LIBRARY:
        for kind in kinds:
            if kind == "context" and name in ("inspect_path", "diff_paths", "verify_path", "convert"):
                continue  # their options classes are ReadOptions (the ReadContext is built inside)
            marks = []
            if name == "plot_stats":
                marks.append(pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib (the plot extra)"))
            out.append(pytest.param(name, kind, marks=marks, id=f"{name}-{kind}"))
    return out


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _read(kind: str, **fields) -> ReadOptions | ReadContext:
    options = ReadOptions(**fields)
    return options if kind == "options" else options.read_context()


@pytest.mark.parametrize("name, kind", _entries())
def test_library_follow_links_and_budget(linked, tmp_path, name, kind):
    root, _ = linked
    call = LIBRARY[name][0]
    with pytest.raises(CheckpointError, match="outside the checkpoint.*follow_links=True"):
        call(root, tmp_path, _read(kind))
    call(root, tmp_path, _read(kind, follow_links=True))
    with pytest.raises(CheckpointError, match="memory budget of 100 B"):
        call(root, tmp_path, _read(kind, follow_links=True, memory_budget=BUDGET))
    with pytest.raises(CheckpointError, match="memory budget of 100 B"):  # a size with its unit: the same
        call(root, tmp_path, _read(kind, follow_links=True, memory_budget="100B"))


@pytest.mark.parametrize("name, kind", _entries())
def test_library_block_size_workers_and_share(linked, tmp_path, seen, name, kind):
    root, _ = linked
    call, data, _ = LIBRARY[name]
    share = OneProcess()
    call(root, tmp_path, _read(kind, follow_links=True, block_bytes="4KiB", workers=WORKERS, share=share))
    assert seen.opened and all(c.block_bytes == BLOCK and c.workers == WORKERS and c.share is share
                               for c in seen.opened)
    if data:
        assert seen.readers and all(c.block_bytes == BLOCK and c.workers == WORKERS and c.share is share
                                    for c in seen.readers)
        assert seen.show_stats == [BLOCK] if name == "show_report" else BLOCK in seen.planned


@pytest.mark.parametrize("name, kind", _entries(("options",)))
def test_library_progress(linked, tmp_path, seen, name, kind):
    root, _ = linked
    call, _, bar = LIBRARY[name]
    if not bar:
        pytest.skip(f"{name} draws no progress bar")
    for enabled in (True, False):
        seen.bars.clear()
        call(root, tmp_path, _read(kind, follow_links=True, progress=enabled))
        assert seen.bars and set(seen.bars) == {enabled}, seen.bars


def test_the_older_keywords_still_work(linked):
    # memory_budget= and prefix= of show_report / plan_checkpoint, context= of show_leaf, over read=.
    root, w = linked
    read = ReadOptions(follow_links=True)
    with pytest.raises(CheckpointError, match="memory budget of 100 B"):
        show_mod.show_report(root, "params/w", read=read, memory_budget=BUDGET)
    path, value = show_mod.show_leaf(root, "params/w[1]", context=read.read_context())
    assert path == "params/w" and np.array_equal(value, w[1])
    with pytest.raises(CheckpointError, match="memory budget of 100 B"):
        tt.plan_checkpoint(root, read=read, memory_budget=BUDGET)
    with pytest.raises(TypeError, match="`read` must be a tt.ReadOptions, a ReadContext or None, got dict"):
        tt.plan_checkpoint(root, read={"follow_links": True})


def test_docs_list_every_reading_flag_once():
    # docs/cli.md "Reading options": one row per setting, its flag and its field, as the table says.
    text = (os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md"))
    with open(text, encoding="utf-8") as f:
        page = f.read()
    section = page[page.index("## Reading options"):page.index("## What PATH may be")]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    assert len(rows) == len(READ_SETTINGS)
    for (name, setting), row in zip(READ_SETTINGS.items(), rows):
        assert row.startswith(f"| `{setting.flag}") and f"`{name}`" in row, (name, row)
