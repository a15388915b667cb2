"""The checkpoint layer: every checkpoint treetools reads, opened one way, for the library and the CLI alike.

``open_source(path)`` opens any checkpoint (every built-in format, local or in
a ``gs://``/``s3://`` bucket) and returns a ``Source``: its steps, its
incomplete saves, and ``snapshot(step, items)`` with one ``Leaf`` per stored
leaf (a ``Row`` of metadata and, for arrays, an ``ArrayReader`` handing out
bounded blocks). Importing this package imports no jax.

For format authors (see docs/formats.md, "Writing a format"): a format is a
``Format(name, priority, claims, open)`` given to ``register_format``; its
``claims(location, context)`` and ``open(location, display, context)`` read
only through ``context.storage`` (a ``Storage``: the local disk confined to
the checkpoint, or a bucket); ``open`` returns a ``Source`` subclass (or a
``FileSource`` of leaves built with ``array_row``/``value_row``/``tree_leaves``
and a reader such as ``FileReader``) built with that ``ReadContext``.

Modules, bottom to top: ``storage`` (where files live: one interface, a class
per scheme), ``context`` (the read settings), ``steps`` (the one step rule),
``readers`` (block readers, the memory budget), ``stream`` (the block engine),
``leaves`` (Leaf/Item/Snapshot), ``items`` (which item holds the params),
``source`` (Format, Source and its layouts), ``registry``, ``diagnose`` ("did you mean"),
``opening`` (``open_source``), ``formats/`` and ``mapping`` (rules over
leaves), ``writers/``.
"""

# Names are re-exported lazily (PEP 562, as treetools/__init__.py does): importing a module of this package
# (`treetools.checkpoint_io.formats` for `treetools inspect --help`'s list of formats) imports no numpy.
import importlib as _importlib
import typing as _typing

_EXPORTS = {  # public name -> module under treetools.checkpoint_io
    **dict.fromkeys(("ArrayReader", "FileReader", "InMemoryReader", "MemoryBudgetError", "SequentialReader",
                     "checked_shape", "plan_blocks"), "readers"),
    **dict.fromkeys(("DEFAULT_ITEM", "NO_VALUE", "Item", "Leaf", "Snapshot", "Unreadable", "array_row", "check_name",
                     "stored_path",
                     "tree_leaves", "value_row"), "leaves"),
    **dict.fromkeys(("FileSource", "Format", "ItemLayout", "Layout", "RootLayout", "Source", "StepLayout",
                     "file_head"), "source"),
    **dict.fromkeys(("register_format", "registered_formats", "unregister_format"), "registry"),
    "open_source": "opening",
    **dict.fromkeys(("ReadContext", "ReadOptions"), "context"),
    **dict.fromkeys(("Storage", "Upload", "backend", "register_scheme"), "storage"),
    "register_kvstore": "formats._ts_kvstore",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treetools.checkpoint_io' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"treetools.checkpoint_io.{module}"), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return list(__all__)


if _typing.TYPE_CHECKING:
    from treetools.checkpoint_io.context import ReadContext, ReadOptions
    from treetools.checkpoint_io.formats._ts_kvstore import register_kvstore
    from treetools.checkpoint_io.leaves import (
        DEFAULT_ITEM,
        NO_VALUE,
        Item,
        Leaf,
        Snapshot,
        Unreadable,
        array_row,
        check_name,
        stored_path,
        tree_leaves,
        value_row,
    )
    from treetools.checkpoint_io.opening import open_source
    from treetools.checkpoint_io.readers import (
        ArrayReader,
        FileReader,
        InMemoryReader,
        MemoryBudgetError,
        SequentialReader,
        checked_shape,
        plan_blocks,
    )
    from treetools.checkpoint_io.registry import register_format, registered_formats, unregister_format
    from treetools.checkpoint_io.source import (
        FileSource,
        Format,
        ItemLayout,
        Layout,
        RootLayout,
        Source,
        StepLayout,
        file_head,
    )
    from treetools.checkpoint_io.storage import Storage, Upload, backend, register_scheme
