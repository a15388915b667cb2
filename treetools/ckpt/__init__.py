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

__all__ = [
    "ArrayReader",
    "DEFAULT_ITEM",
    "FileReader",
    "FileSource",
    "Format",
    "InMemoryReader",
    "Item",
    "Leaf",
    "MemoryBudgetError",
    "NO_VALUE",
    "Snapshot",
    "Source",
    "array_row",
    "check_name",
    "checked_shape",
    "file_head",
    "open_source",
    "plan_blocks",
    "register_format",
    "registered_formats",
    "stored_path",
    "tree_leaves",
    "unregister_format",
    "value_row",
]
