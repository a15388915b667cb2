"""The package surface: help(treetools), dir(treetools), the quickstart runs, py.typed ships."""

from __future__ import annotations

import doctest
import os
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
    assert (build / "treetools" / "pytree" / "metrics.py").is_file()  # moved there with the layer folders
    assert (build / "treetools" / "py.typed").is_file()


# ------------------------------------------------------------------------------------ the distribution name

# `pip install` and its first argument that is not an option: `pip install 'jax-treetools[plot]'`, `pip install -e
# '.[plot]'` (the argument across a line break too, as a wrapped paragraph has it).
_PIP_INSTALL = re.compile(r"pip\s+install\s+(?:-[a-zA-Z-]+\s+)*(?:\"\s+\")?(?:'([^']*)'|\"([^\"]*)\"|([^\s`'\")]+))")
# (?:"\s+")?: a Python string literal continued on the next line ("... pip install "\n    "'jax-treetools[keras]'")


def _install_targets(text: str) -> list[str]:
    return [next(g for g in m.groups() if g is not None) for m in _PIP_INSTALL.finditer(text)]


def _extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _check_target(target: str, where: str, *, clone: bool) -> None:
    """``jax-treetools[extras]`` (or, where a clone is meant, ``.[extras]``), each extra one pyproject.toml has."""
    from treetools.shared.install import DISTRIBUTION

    names = (DISTRIBUTION, ".") if clone else (DISTRIBUTION,)
    # A wheel built from a clone (README "Releasing"): dist/jax_treetools-VERSION-py3-none-any.whl.
    wheel = rf"(?:dist/)?{DISTRIBUTION.replace('-', '_')}-[\w.]+-py3-none-any\.whl"
    match = re.fullmatch(r"([^\[]+)(?:\[([\w,-]+)\])?", target)
    assert match and (match.group(1) in names or clone and re.fullmatch(wheel, match.group(1))), (
        f"{where}: `pip install {target}` does not install {DISTRIBUTION}")
    unknown = set((match.group(2) or "").split(",")) - {""} - _extras()
    assert not unknown, f"{where}: `pip install {target}` names extras pyproject.toml lacks: {sorted(unknown)}"


def test_the_distribution_name_is_free_of_the_unrelated_treetools_and_keeps_the_command():
    # Issue 39.1: `pip install treetools` installs "Tools for processing treebank trees" (its own treetools/cli.py).
    import tomllib

    from treetools.shared.install import DISTRIBUTION

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION and re.sub(r"[-_.]+", "-", DISTRIBUTION.lower()) != "treetools"
    assert project["scripts"] == {"treetools": "treetools.cli:run"}  # the command keeps its name
    assert tt.__name__ == "treetools"  # and the import name


def test_every_install_hint_in_the_package_names_the_distribution():
    hints = {}
    for path in sorted((ROOT / "treetools").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for target in _install_targets(path.read_text(encoding="utf-8")):
            if (where, target) == ("treetools/shared/install.py", "{DISTRIBUTION}[{extra}]"):
                continue  # install_hint's template: its messages are checked below, as users see them
            hints.setdefault(target, []).append(where)
            _check_target(target, where, clone=False)
    # `treetools plot --help` (its module docstring) and `inspect --help` (the keras format's description) say it
    assert {"jax-treetools[plot]", "jax-treetools[keras]"} <= set(hints), hints


def test_every_install_line_of_the_docs_names_the_distribution_or_a_clone():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    targets = {}
    for doc in docs:
        for target in _install_targets(doc.read_text(encoding="utf-8")):
            _check_target(target, doc.relative_to(ROOT).as_posix(), clone=True)
            targets.setdefault(doc.name, set()).add(target)
    readme = targets.get("README.md", set())
    assert "jax-treetools[plot]" in readme and ".[plot]" in readme, readme  # from the index, and from a clone
    assert "pip install -e '.[plot]'" in (ROOT / "README.md").read_text()
    # Issue 47.24: jax-treetools is not on the package index yet; the README must not send users there as if it were.
    index_line = next(line for line in (ROOT / "README.md").read_text().splitlines()
                      if "pip install 'jax-treetools[plot]'" in line)
    assert "not yet" in index_line, index_line


def test_the_messages_of_a_missing_extra_name_the_distribution(tmp_path, monkeypatch):
    # What a user sees, not only the source: each missing extra is reported with the command that installs it.
    from treetools.checkpoint_io import storage
    from treetools.checkpoint_io.context import ReadContext
    from treetools.checkpoint_io.formats import keras
    from treetools.checkpoint_tools import plot as commands_plot
    from treetools.shared.errors import CheckpointError

    seen = []
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    try:
        commands_plot._import_matplotlib()
    except ImportError as e:
        seen.append(("plot", str(e)))
    h5 = tmp_path / "model.weights.h5"
    h5.write_bytes(keras.HDF5_MAGIC + bytes(64))
    monkeypatch.setitem(sys.modules, "h5py", None)
    try:
        keras.FORMAT.open(str(h5), "model.weights.h5", ReadContext().confined_to(str(h5)))
    except CheckpointError as e:
        seen.append(("keras", str(e)))
    for name in ("s3fs", "gcsfs", "gcsfs.core"):
        monkeypatch.setitem(sys.modules, name, None)
    try:
        storage.bucket.S3Storage()  # the client `storage.backend` makes at a process's first s3:// URL
    except storage.RemoteStorageError as e:
        seen.append(("remote", str(e)))
    from treetools.checkpoint_io.formats import af3

    zst = tmp_path / "af3.bin.zst"
    zst.write_bytes(af3.ZSTD_MAGIC + bytes(64))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    try:
        af3.FORMAT.open(str(zst), "af3.bin.zst", ReadContext().confined_to(str(zst)))
    except CheckpointError as e:
        seen.append(("af3", str(e)))
    assert [extra for extra, _ in seen] == ["plot", "keras", "remote", "af3"], seen
    for extra, message in seen:
        assert f"pip install 'jax-treetools[{extra}]'" in message, message
        assert _install_targets(message) == [f"jax-treetools[{extra}]"], message


def _make_installs(target: str, tmp_path) -> list[set[str]]:
    """The extras each ``pip install -e '.[...]'`` of ``make TARGET`` installs, from ``make -n`` on a fresh venv
    path (nothing run)."""
    if shutil.which("make") is None:
        import pytest

        pytest.skip("needs make")
    proc = subprocess.run(["make", "-s", "-n", "-C", str(ROOT), target, f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "MAKEFLAGS": ""})
    assert proc.returncode == 0, proc.stderr
    return [set(extras.split(",")) for extras in re.findall(r"pip install .*-e '\.\[([\w,-]*)\]'", proc.stdout)]


def test_make_demo_installs_what_the_demo_needs_and_make_test_adds_the_test_extras(tmp_path):
    # Issue 39.3: `make demo` installed every extra (moto, keras, equinox, gcsfs, s3fs: a 1.3 GB .venv).
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    demo, test = _make_installs("demo", tmp_path), _make_installs("test", tmp_path)
    assert demo == [{"plot"}]  # treetools, and matplotlib for `treetools plot` after the demo
    demo_deps = " ".join(dep for extra in demo[0] for dep in extras[extra])
    for heavy in ("moto", "keras", "equinox", "gcsfs", "s3fs", "pytest"):
        assert heavy not in demo_deps, heavy
    assert test[0] == demo[0] and test[-1] == {"test", "test-formats", "test-hf", "plot", "remote", "keras",
                                               "tensorboard", "af3", "wandb"}  # on top of it
    assert test[-1] == set(extras)  # every extra: the suite tests them all
    assert _make_installs("bench", tmp_path)[-1] == test[-1]


def test_the_layer_folders_renamed_keep_treetools_ckpt_for_format_authors():
    # Issue 45 "names that say the layer": ckpt/ -> checkpoint_io/, checkpointing/ -> checkpoint_jax/,
    # commands/ -> checkpoint_tools/. `treetools.ckpt` keeps its public names (one list, the same objects).
    import importlib

    import treetools.checkpoint_io as io_layer
    import treetools.ckpt as ckpt

    assert ckpt.__all__ == io_layer.__all__ and len(ckpt.__all__) >= 20
    for name in ckpt.__all__:
        assert getattr(ckpt, name) is getattr(io_layer, name), name
    package = pathlib.Path(tt.__file__).parent
    assert {"checkpoint_io", "checkpoint_jax", "checkpoint_tools", "cli"} <= {p.name for p in package.iterdir()}
    for old in ("checkpointing", "commands", "ckpt.formats"):
        try:
            importlib.import_module(f"treetools.{old}")
        except ImportError:
            continue
        raise AssertionError(f"treetools.{old} still imports: the old layer folders are gone")
