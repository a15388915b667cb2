"""The ``>>>`` examples in public docstrings are run, so they cannot rot."""

import doctest
import importlib

import pytest

MODULES = ["paths", "partitioning", "counting", "masks", "abstract", "table", "norms", "checkpoint"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    try:
        module = importlib.import_module(f"treetools.{name}")
    except ModuleNotFoundError:
        pytest.skip(f"treetools.{name} not written yet")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in treetools.{name}"
