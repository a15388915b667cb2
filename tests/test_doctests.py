"""The ``>>>`` examples in docstrings are run, so they cannot rot."""

import doctest
import importlib

import pytest

MODULES = [
    "paths", "patterns", "rules", "partitioning", "stacked", "counting", "masks", "abstract", "table", "norms", "manager", "restore",
    "errors", "rows", "render", "ckpt.storage", "ckpt.steps", "ckpt.readers", "ckpt.stream", "ckpt.source", "ckpt.mapping",
    "ckpt.formats.orbax", "ckpt.formats.safetensors", "ckpt.formats.npz", "ckpt.formats.hf_sharded", "ckpt.formats.t5x",
    "ckpt.formats._msgpack", "ckpt.formats.msgpack", "ckpt.writers.safetensors", "ckpt.writers.orbax",
    "inspect.options", "inspect.diff", "inspect.report", "inspect.show", "inspect.stats", "inspect.verify", "inspect.convert",
    "cli", "cli._args", "cli.options", "cli.plot",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"treetools.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"treetools.{name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in treetools.{name}"
