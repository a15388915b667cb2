"""The release steps of the README ("Releasing"): a wheel and an sdist built with `python -m build`, accepted by
`twine check --strict`, holding every module of the package. Offline: `--no-isolation` builds with the venv's own
setuptools (the test extra pins it), so no build environment is downloaded."""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build", reason="needs the test extra's `build`: pip install -c constraints.txt -e '.[test]'")
pytest.importorskip("twine", reason="needs the test extra's `twine`: pip install -c constraints.txt -e '.[test]'")

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _run(*args, cwd):
    env = {**os.environ, **OFFLINE}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _modules(root: Path) -> set[str]:
    """Every .py file, py.typed and shipped preset (package data) of the package, as paths relative to ``root``
    (read from the source tree)."""
    return {p.relative_to(root).as_posix() for p in (root / "treetools").rglob("*")
            if p.suffix == ".py" or p.name == "py.typed" or (p.parent.name == "presets" and p.suffix == ".toml")
            } - {""}


def test_wheel_and_sdist_build_offline_and_pass_twine_check(tmp_path):
    # A copy of what the build reads: nothing is written into the checkout (no build/, no *.egg-info).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "treetools", src / "treetools", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel_name, sdist_name = f"jax_treetools-{version}-py3-none-any.whl", f"jax_treetools-{version}.tar.gz"
    # The README's release steps are these commands, and its install line names the wheel they make.
    readme = (ROOT / "README.md").read_text()
    release = readme[readme.index("## Releasing"):readme.index("## Development")]
    assert "python -m build " in release and "twine check --strict dist/*" in release
    assert f"pip install 'dist/{wheel_name}[plot]'" in readme and sdist_name in release
    out = tmp_path / "dist"
    _run("-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(out), str(src), cwd=tmp_path)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [wheel_name]
    assert [s.name for s in sdists] == [sdist_name]

    # twine's own checks (metadata, the README rendered as the index would), warnings as errors.
    report = _run("-m", "twine", "check", "--strict", *map(str, wheels + sdists), cwd=tmp_path)
    assert report.count("PASSED") == 2, report

    expected = _modules(ROOT)
    assert "treetools/cli/__init__.py" in expected and "treetools/py.typed" in expected
    with zipfile.ZipFile(wheels[0]) as whl:
        names = set(whl.namelist())
        assert {n for n in names if n.startswith("treetools/")} == expected
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(whl.read(info).decode())
        entry_points = whl.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert (meta["Name"], meta["Version"]) == ("jax-treetools", version)
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (ROOT / "README.md").read_text().strip()  # the README is the long description
    assert "treetools = treetools.cli:run" in entry_points
    extras = set(meta.get_all("Provides-Extra"))
    assert {"plot", "test", "remote", "keras", "af3", "tensorboard"} <= extras

    with tarfile.open(sdists[0]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name and m.isfile()}
    assert {"pyproject.toml", "README.md", "PKG-INFO"} <= members
    assert expected <= members
