"""The ``>>>`` examples in docstrings are run, so they cannot rot."""

import doctest
import importlib

import pytest

MODULES = [
    "paths", "partitioning", "counting", "masks", "abstract", "table", "norms", "checkpoint",
    "errors", "steps", "rows", "render", "inspect.source", "inspect.diff", "inspect.report", "inspect.stats",
    "rules", "inspect.formats.orbax", "inspect.formats.safetensors", "inspect.formats.npz", "inspect.formats.hf_sharded", "inspect.formats.t5x", "inspect.verify", "cli", "cli._args", "cli.plot",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"treetools.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"treetools.{name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in treetools.{name}"
