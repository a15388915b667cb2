"""The checkpoint layer: every checkpoint treetools reads, opened one way, for the library and the CLI alike.

``open_source(path)`` opens any checkpoint (every built-in format, local or in
a ``gs://``/``s3://`` bucket) and returns a ``Source``: its steps, its
incomplete saves, and ``snapshot(step, items)`` with one ``Leaf`` per stored
leaf (a ``Row`` of metadata and, for arrays, an ``ArrayReader`` handing out
bounded blocks). Importing this package imports no jax.

For format authors (see docs/formats.md, "Writing a format"): a format is a
``Format(name, priority, claims, open)`` given to ``register_format``; its
``open`` returns a ``Source`` subclass (or a ``FileSource`` of leaves built
with ``array_row``/``value_row``/``tree_leaves`` and a reader such as
``FileReader``).
"""

# Names are re-exported lazily (PEP 562, as treetools/__init__.py does): importing a module of this package
# (`treetools.ckpt.formats` for `treetools inspect --help`'s list of formats) imports no numpy.
import importlib as _importlib
import typing as _typing

_EXPORTS = {  # public name -> module under treetools.ckpt
    **dict.fromkeys(("ArrayReader", "FileReader", "InMemoryReader", "MemoryBudgetError", "checked_shape",
                     "plan_blocks"), "readers"),
    **dict.fromkeys(("DEFAULT_ITEM", "NO_VALUE", "FileSource", "Format", "Item", "Leaf", "Snapshot", "Source",
                     "array_row", "check_name", "file_head", "open_source", "register_format", "registered_formats",
                     "stored_path", "tree_leaves", "unregister_format", "value_row"), "source"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treetools.ckpt' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"treetools.ckpt.{module}"), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return list(__all__)


if _typing.TYPE_CHECKING:  # static analysers (and the import contracts) see ordinary imports
    from treetools.ckpt.readers import (
        ArrayReader,
        FileReader,
        InMemoryReader,
        MemoryBudgetError,
        checked_shape,
        plan_blocks,
    )
    from treetools.ckpt.source import (
        DEFAULT_ITEM,
        NO_VALUE,
        FileSource,
        Format,
        Item,
        Leaf,
        Snapshot,
        Source,
        array_row,
        check_name,
        file_head,
        open_source,
        register_format,
        registered_formats,
        stored_path,
        tree_leaves,
        unregister_format,
        value_row,
    )
