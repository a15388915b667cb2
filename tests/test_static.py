"""Static checks (issue 45): `ruff check treetools` and `mypy` pass with the configuration in pyproject.toml, each
check catches what it is there for, and the TYPE_CHECKING imports of the lazy packages name exactly their exports."""

from __future__ import annotations

import ast
import importlib
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
BIN = pathlib.Path(sys.executable).parent  # the venv's: ruff and mypy are pinned in the test extra
# A module with standard-library imports only: its copy is checked on its own, quickly.
SAMPLE = ROOT / "treetools" / "shared" / "errors.py"


def _tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{path} is missing: install the test extra (pip install -c constraints.txt -e '.[test]')"
    return str(path)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    # A cache of this test run's own: nothing is written into the checkout, and no other run shares it.
    return str(tmp_path_factory.mktemp("mypy_cache"))


# ------------------------------------------------------------------------------------------------- the checks pass


def test_ruff_passes_on_the_package():
    proc = _run(_tool("ruff"), "check", "--no-cache", "treetools")
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]


def test_mypy_passes_on_the_package(mypy_cache):
    # `mypy` alone checks what pyproject.toml's [tool.mypy] names (packages = treetools), with its settings.
    proc = _run(_tool("mypy"), "--cache-dir", mypy_cache)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout


# ----------------------------------------------------------------------------------- and are not vacuous


def _copy(tmp_path: pathlib.Path, extra: str = "") -> pathlib.Path:
    copy = tmp_path / "sample_copy.py"
    copy.write_text(SAMPLE.read_text(encoding="utf-8") + extra, encoding="utf-8")
    return copy


# Sixteen decision points: one over the bound of 15 (mccabe counts 1 + one per `if`).
TOO_COMPLEX = "\n\ndef _branchy(x: int) -> int:\n" + "".join(
    f"    if x == {i}:\n        return {i}\n" for i in range(16)) + "    return -1\n"
WRONG_TYPE = '\n\ndef _wrong() -> int:\n    return "not an int"\n'


def test_ruff_fails_a_function_over_the_complexity_bound(tmp_path):
    clean = _run(_tool("ruff"), "check", "--no-cache", "--config", str(PYPROJECT), str(_copy(tmp_path)))
    assert clean.returncode == 0, clean.stdout + clean.stderr  # the module as it is passes
    proc = _run(_tool("ruff"), "check", "--no-cache", "--config", str(PYPROJECT), str(_copy(tmp_path, TOO_COMPLEX)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "C901" in proc.stdout and "`_branchy` is too complex (17 > 15)" in proc.stdout, proc.stdout


def test_ruff_fails_an_unused_import(tmp_path):
    proc = _run(_tool("ruff"), "check", "--no-cache", "--config", str(PYPROJECT),
                str(_copy(tmp_path, "\n\nimport json\n")))
    assert proc.returncode == 1 and "F401" in proc.stdout, proc.stdout + proc.stderr


def test_mypy_fails_a_type_error(tmp_path, mypy_cache):
    mypy = _tool("mypy")
    clean = _run(mypy, "--config-file", str(PYPROJECT), "--cache-dir", mypy_cache, str(_copy(tmp_path)))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    proc = _run(mypy, "--config-file", str(PYPROJECT), "--cache-dir", mypy_cache, str(_copy(tmp_path, WRONG_TYPE)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'Incompatible return value type (got "str", expected "int")  [return-value]' in proc.stdout, proc.stdout


def test_mypy_checks_the_bodies_of_unannotated_functions(tmp_path, mypy_cache):
    # check_untyped_defs: a function without annotations is checked too (mypy's default skips its body).
    untyped = '\n\ndef _untyped():\n    return len(3)\n'
    proc = _run(_tool("mypy"), "--config-file", str(PYPROJECT), "--cache-dir", mypy_cache,
                str(_copy(tmp_path, untyped)))
    assert proc.returncode == 1 and "[arg-type]" in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------------- TYPE_CHECKING imports == the exports

LAZY = [("treetools", ROOT / "treetools" / "__init__.py"),
        ("treetools.checkpoint_io", ROOT / "treetools" / "checkpoint_io" / "__init__.py")]


def _type_checking_imports(source: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every import under the module's top-level ``if TYPE_CHECKING:`` blocks, in order."""
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.If) or ast.unparse(node.test) not in ("TYPE_CHECKING", "_typing.TYPE_CHECKING"):
            continue
        for stmt in node.body:
            assert isinstance(stmt, ast.ImportFrom) and stmt.module, ast.unparse(stmt)
            for alias in stmt.names:
                assert alias.asname is None, f"{ast.unparse(stmt)}: a re-export is imported under its own name"
                found.append((stmt.module, alias.name))
    return found


def _drift(package: str, source: str, exports: dict[str, str]) -> list[str]:
    """What differs between the TYPE_CHECKING imports in ``source`` and ``exports`` (name -> module)."""
    imported = _type_checking_imports(source)
    want = {(f"{package}.{module}", name) for name, module in exports.items()}
    got = set(imported)
    problems = [f"exported but not imported under TYPE_CHECKING: {m}.{n}" for m, n in sorted(want - got)]
    problems += [f"imported under TYPE_CHECKING but not exported from there: {m}.{n}" for m, n in sorted(got - want)]
    problems += [f"imported twice: {m}.{n}" for m, n in sorted(got) if imported.count((m, n)) > 1]
    return problems


def _expected_block(package: str, exports: dict[str, str]) -> str:
    """The ``if _typing.TYPE_CHECKING:`` block that imports exactly ``exports``: one import per module, sorted
    (constants, classes, functions), wrapped at 120 columns; printed when the check fails, to paste in."""
    by_module: dict[str, list[str]] = {}
    for name, module in exports.items():
        by_module.setdefault(module, []).append(name)
    lines = ["if _typing.TYPE_CHECKING:"]
    for module in sorted(by_module):
        names = sorted(by_module[module], key=lambda n: (0 if n.isupper() else 1 if n[:1].isupper() else 2, n))
        one = f"    from {package}.{module} import {', '.join(names)}"
        lines += [one] if len(one) <= 120 else [f"    from {package}.{module} import (",
                                                 *(f"        {n}," for n in names), "    )"]
    return "\n".join(lines)


@pytest.mark.parametrize("package, init", LAZY, ids=[p for p, _ in LAZY])
def test_type_checking_imports_are_exactly_the_exports(package, init):
    exports = importlib.import_module(package)._EXPORTS
    assert len(exports) > 10
    drift = _drift(package, init.read_text(encoding="utf-8"), exports)
    assert drift == [], "\n".join([*drift, f"The block {init.name} needs:", _expected_block(package, exports)])


@pytest.mark.parametrize("package, init", LAZY, ids=[p for p, _ in LAZY])
def test_the_printed_block_is_what_the_package_holds(package, init):
    # The block the failure message offers is the one the package has (so pasting it in is the fix).
    exports = importlib.import_module(package)._EXPORTS
    assert _expected_block(package, exports) in init.read_text(encoding="utf-8")
    assert _drift(package, _expected_block(package, exports), exports) == []


@pytest.mark.parametrize("package, init", LAZY, ids=[p for p, _ in LAZY])
def test_a_missing_or_stray_type_checking_import_is_caught(package, init):
    exports = importlib.import_module(package)._EXPORTS
    tree = ast.parse(init.read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    first = block.body[0]
    assert isinstance(first, ast.ImportFrom)
    dropped = first.names.pop(0)
    if not first.names:
        block.body.pop(0)
    missing = f"exported but not imported under TYPE_CHECKING: {first.module}.{dropped.name}"
    assert _drift(package, ast.unparse(tree), exports) == [missing]
    block.body.append(ast.ImportFrom(module="json", names=[ast.alias("dumps")], level=0))
    stray = "imported under TYPE_CHECKING but not exported from there: json.dumps"
    assert _drift(package, ast.unparse(ast.fix_missing_locations(tree)), exports) == [missing, stray]


def test_the_ckpt_alias_exports_the_checkpoint_io_names():
    # treetools.ckpt re-exports treetools.checkpoint_io's list itself (one list, nothing to keep in step).
    ckpt = importlib.import_module("treetools.ckpt")
    assert ckpt.__all__ is importlib.import_module("treetools.checkpoint_io").__all__


def test_the_tools_are_pinned_where_make_installs_them():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert "ruff" in pins and "mypy" in pins
    text = PYPROJECT.read_text(encoding="utf-8")
    assert f'"ruff=={pins["ruff"]}"' in text and f'"mypy=={pins["mypy"]}"' in text
    assert shutil.which("ruff", path=str(BIN)) and shutil.which("mypy", path=str(BIN))
