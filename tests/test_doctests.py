"""The ``>>>`` examples in docstrings are run, so they cannot rot: every module of the package, found by a walk.

A module added later is collected without editing this file; ``pytest --doctest-modules treetools`` runs the same
examples (tests/conftest.py sets the 8 fake CPU devices for both).
"""

import doctest
import importlib
import pkgutil

import pytest

import treetools

# Modules that need an optional extra the test environment may lack are still walked; they are skipped only when
# the import itself fails for that reason.
MODULES = sorted(m.name for m in pkgutil.walk_packages(treetools.__path__, "treetools.") if m.name != "treetools.__main__")


def test_the_walk_finds_every_layer():
    # The walk is not vacuous: each layer folder contributes modules with examples.
    with_examples = [name for name in MODULES if _examples(importlib.import_module(name))]
    for folder in ("shared", "rules", "pytree", "checkpoint_io", "checkpoint_jax", "checkpoint_tools", "cli"):
        assert any(name.startswith(f"treetools.{folder}.") for name in with_examples), folder
    assert len(with_examples) >= 40, with_examples


def _examples(module) -> int:
    finder = doctest.DocTestFinder()
    return sum(len(t.examples) for t in finder.find(module, module.__name__))


@pytest.mark.parametrize("name", ["treetools"] + MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
