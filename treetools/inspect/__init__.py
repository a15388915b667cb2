"""Read-only checkpoint reading for the library and the CLI alike.

``open_source(path)`` opens any checkpoint through the format registry
(``treetools/inspect/formats/``: Orbax, safetensors, npz, Flax msgpack; more
by ``register_format``); ``inspect_path`` turns a checkpoint's metadata (and,
with ``stats=True``, its arrays streamed in bounded blocks) into a ``Report``;
``diff_paths`` compares two checkpoints. Nothing here writes under the path it reads.
"""

from treetools.errors import CheckpointError, CheckpointNotFoundError
from treetools.inspect.arrays import DEFAULT_CHUNK_BYTES, ArrayReader, plan_blocks
from treetools.inspect.diff import DiffReport, LeafChange, ValueDiff, diff_paths, value_diff
from treetools.inspect.report import ItemReport, Report, StepReport, inspect_path
from treetools.inspect.source import (
    Format,
    Item,
    Leaf,
    Snapshot,
    Source,
    formats,
    open_source,
    register_format,
    unregister_format,
)
from treetools.inspect.stats import StatsAccumulator, array_stats, leaf_stats
from treetools.render import render_diff, render_report



def open_checkpoint(path):  # noqa: ANN001, ANN201 - the 0.1 name, kept for code written against it
    """``open_source(path)`` under the name treetools 0.1 exported."""
    return open_source(path)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ArrayReader",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DiffReport",
    "Format",
    "Item",
    "ItemReport",
    "Leaf",
    "LeafChange",
    "Report",
    "Snapshot",
    "Source",
    "StatsAccumulator",
    "StepReport",
    "ValueDiff",
    "array_stats",
    "diff_paths",
    "formats",
    "inspect_path",
    "leaf_stats",
    "open_checkpoint",
    "open_source",
    "plan_blocks",
    "register_format",
    "render_diff",
    "render_report",
    "unregister_format",
    "value_diff",
]
