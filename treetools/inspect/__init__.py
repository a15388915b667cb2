"""Read-only checkpoint inspection: Orbax, Flax msgpack, safetensors and npz.

``inspect_path`` reads a checkpoint's metadata (and, with ``stats=True``,
streams its arrays in bounded blocks) into a ``Report``; ``diff_paths``
compares two checkpoints. Both never write anything under the path they read.
The CLI (``treetools inspect`` / ``treetools diff``) renders these reports.
"""

from treetools.inspect._base import DEFAULT_CHUNK_BYTES, CheckpointError, Leaf, Snapshot, plan_blocks
from treetools.inspect.diff import DiffReport, LeafChange, ValueDiff, diff_paths, render_diff, value_diff
from treetools.inspect.readers import Source, open_checkpoint, select_item
from treetools.inspect.report import ItemReport, Report, StepReport, inspect_path, render_report
from treetools.inspect.stats import StatsAccumulator, array_stats, leaf_stats

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "CheckpointError",
    "DiffReport",
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
    "inspect_path",
    "leaf_stats",
    "open_checkpoint",
    "plan_blocks",
    "render_diff",
    "render_report",
    "select_item",
    "value_diff",
]
