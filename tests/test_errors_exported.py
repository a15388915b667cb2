"""Every exception a user can meet is exported from ``treetools`` and documented in docs/errors.md (issue 45).

The classes are found by importing every module of the package and keeping the ``BaseException`` subclasses
each defines; the exit codes are found by running the ``treetools`` program with a command that raises each.
"""

from __future__ import annotations

import errno
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import treetools as tt
from treetools.cli import main as cli_main

DOC = Path(__file__).resolve().parent.parent / "docs" / "errors.md"

INTERNAL = {
    "treetools.checkpoint_io.formats._orbax_items.UnreadableItem":
        "caught by the Orbax source, which lists the item under Snapshot.unreadable (`not read:`), never raised on",
    "treetools.checkpoint_io.formats._ts_folders.Changed":
        "caught in _ts_folders, which pins the changed folder afresh",
    "treetools.checkpoint_io.formats._ocdbt.Corrupt":
        "turned into a CheckpointError naming the OCDBT file by _ocdbt's callers",
    "treetools.checkpoint_io.formats._ocdbt.NotPlain":
        "caught inside _ocdbt.values, which then returns None: the headers open through TensorStore's lookups",
    "treetools.cli._UsageExit":
        "argparse's exit inside the program, returned as exit code 2 by cli.main",
}
"""Exception classes that never reach a caller, each with where it is caught."""


def _defined_exceptions() -> dict[str, type]:
    """``module.Name`` -> class, for every exception class defined in a module of the package."""
    found: dict[str, type] = {}
    names = ["treetools"] + [m.name for m in pkgutil.walk_packages(tt.__path__, "treetools.")]
    for name in names:
        if name.endswith("__main__"):  # runs the program
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{value.__qualname__}"] = value
    return found


def _doc_rows() -> dict[str, tuple[str, str, str]]:
    """docs/errors.md's table: name -> (bases, when, exit code)."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2], cells[3])
    return rows


EXCEPTIONS = _defined_exceptions()


def test_every_exception_is_exported_and_documented_or_internal_with_a_reason():
    # 22 classes in 13 modules when this was written (18 a user can meet, 4 internal).
    assert len(EXCEPTIONS) >= 20, sorted(EXCEPTIONS)
    rows = _doc_rows()
    for where, cls in EXCEPTIONS.items():
        if where in INTERNAL:
            assert getattr(tt, cls.__name__, None) is not cls and cls.__name__ not in rows, where
            continue
        assert getattr(tt, cls.__name__, None) is cls, f"{where} is not exported from treetools (_EXPORTS)"
        assert cls.__name__ in rows, f"{where} is not in docs/errors.md"
    assert set(INTERNAL) <= set(EXCEPTIONS), set(INTERNAL) - set(EXCEPTIONS)  # no stale entry
    # ...and the table lists nothing else, each exported error exactly as it is.
    exported = {n: getattr(tt, n) for n in tt.__all__ if isinstance(getattr(tt, n), type)
                and issubclass(getattr(tt, n), BaseException)}
    assert set(rows) == set(exported)


def test_the_documented_bases_are_the_classes_own_and_all_sit_under_treetools_error():
    for name, (bases, _, _) in _doc_rows().items():
        cls = getattr(tt, name)
        assert [b.strip("` ") for b in bases.split(",")] == [b.__name__ for b in cls.__bases__], name
        assert issubclass(cls, tt.TreetoolsError)
        if name != "TreetoolsError":
            # the standard base kept: `except ValueError` / `except OSError` written before still catches it
            assert issubclass(cls, (ValueError, OSError)) or cls is tt.OutputError, name


def test_the_type_checking_imports_name_every_exported_error():
    source = (Path(tt.__file__)).read_text(encoding="utf-8")
    block = source[source.index("if _typing.TYPE_CHECKING"):]
    for name in _doc_rows():
        assert re.search(rf"\b{name}\b", block), name


def _instance(cls: type) -> BaseException:
    """One of ``cls`` as the library raises it."""
    if cls is tt.CheckpointMismatchError:
        from treetools.shared.errors import Mismatch

        return cls(5, "ckpt", [Mismatch("params/w", "shape", "(2,)", "(3,)")])
    if cls is tt.RulesError:
        return cls(["`drop` pattern 'x' matches no leaf"])
    if cls is tt.SpecialFileError:
        return cls("ckpt/w: not a regular file (a FIFO); refusing to read it.", path="ckpt/w", kind="a FIFO")
    if cls is tt.LinkRefusedError:
        return cls(errno.ELOOP, "a symbolic link; treetools never writes through a link", "out")
    return cls(f"planted {cls.__name__}")


def _documented_code(text: str, command: str) -> int:
    m = re.fullmatch(r"(\d)(?: \(diff: (\d)\))?", text)
    assert m, text
    return int(m.group(2)) if command == "diff" and m.group(2) else int(m.group(1))


@pytest.mark.parametrize("name", sorted(set(_doc_rows()) - {"TreetoolsError"}))
@pytest.mark.parametrize("command", ["inspect", "diff", "convert"])
def test_the_program_exits_with_the_documented_code(name, command, monkeypatch, tmp_path, capsys):
    rows = _doc_rows()
    cls = getattr(tt, name)
    module = importlib.import_module(f"treetools.cli.{command}")

    def raising(args):
        raise _instance(cls)

    monkeypatch.setattr(module, "main", raising)
    argv = {"inspect": ["inspect", str(tmp_path)], "diff": ["diff", str(tmp_path), str(tmp_path)],
            "convert": ["convert", str(tmp_path), str(tmp_path / "out"), "--to", "safetensors"]}[command]
    code = cli_main(argv)
    err = capsys.readouterr().err
    assert code == _documented_code(rows[name][2], command), (name, command, err)
    assert "Traceback" not in err and "error:" in err  # one line, no traceback


def test_the_error_doc_is_linked_from_the_readme_and_the_cli_reference():
    root = DOC.parent.parent
    assert "(docs/errors.md)" in (root / "README.md").read_text(encoding="utf-8")
    assert "(errors.md)" in (root / "docs" / "cli.md").read_text(encoding="utf-8")
