"""The package surface: help(treetools), dir(treetools), the quickstart runs, py.typed ships."""

from __future__ import annotations

import doctest
import pathlib
import pydoc
import re
import shutil
import subprocess
import sys


import treetools as tt

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dir_is_exactly_the_public_api():
    assert dir(tt) == sorted(tt.__all__)
    assert "__version__" in dir(tt)
    for helper in ("Any", "importlib", "TYPE_CHECKING", "annotations", "_importlib", "_typing", "_EXPORTS"):
        assert helper not in dir(tt), helper
    # Every listed name resolves, and `import *` gives exactly these names.
    assert [name for name in tt.__all__ if not hasattr(tt, name)] == []  # each resolves to its module's object
    namespace: dict = {}
    exec("from treetools import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(tt.__all__)


def test_metrics_names_are_exported_from_their_module():
    from treetools.pytree import metrics

    assert tt.MetricsLogger is metrics.MetricsLogger and tt.JsonlWriter is metrics.JsonlWriter
    assert tt.read_metrics is metrics.read_metrics
    assert {"MetricsLogger", "JsonlWriter", "read_metrics"} <= set(tt.__all__)


def test_help_starts_with_the_quickstart_and_lists_only_the_api():
    text = pydoc.render_doc(tt, renderer=pydoc.plaintext)
    lines = text.splitlines()
    description = lines[lines.index("DESCRIPTION") + 1].strip()
    assert description.startswith("Quickstart"), description
    # Grouped by task, each group a runnable example.
    for group in ("Count and tabulate", "Norms to log", "Masks and labels", "Abstract trees", "Inspect"):
        assert group in text, group
    assert "lazily" not in tt.__doc__ and "PEP 562" not in tt.__doc__  # an implementation note, kept in a comment
    assert len(tt.__doc__.splitlines()) < 80
    # The quickstart fits a couple of screens; the API reference pydoc adds after it lists only public names.
    sections = [i for i, line in enumerate(lines) if re.match(r"^[A-Z]", line)]
    assert [lines[i] for i in sections][1:4] == ["NAME", "DESCRIPTION", "PACKAGE CONTENTS"]
    assert sections[3] - sections[2] < 80
    assert "DATA" not in lines  # no annotations, __all__ or typing helpers listed as module data
    for noise in ("__getattr__", "__dir__", "TYPE_CHECKING", "importlib", "_EXPORTS"):
        assert noise not in text, noise
    documented = set(re.findall(r"^    (?:class )?([A-Za-z_]\w*)\(", text, flags=re.M))
    assert documented == set(tt.__all__) - {"__version__"}


def test_quickstart_examples_run():
    result = doctest.testmod(tt, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 15
    assert result.failed == 0


def test_py_typed_is_in_the_package():
    assert (ROOT / "treetools" / "py.typed").is_file()
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["treetools"]


def test_py_typed_ships_with_the_built_package(tmp_path):
    # setuptools' build_py lays out exactly the files a wheel holds; run it on a copy (nothing written
    # into the checkout) and look for the marker.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "treetools", src / "treetools", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    build = tmp_path / "build"
    proc = subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "-q", "build_py",
                           "--build-lib", str(build)], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (build / "treetools" / "pytree" / "metrics.py").is_file()
    assert (build / "treetools" / "py.typed").is_file()
