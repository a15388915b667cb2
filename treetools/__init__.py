"""treetools: PyTree chores for JAX / Flax / Optax / Orbax trainers.

Names are re-exported lazily (PEP 562) so that ``import treetools`` and the
``treetools`` CLI's ``--help`` do not pay for importing jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # partitioning
    "is_partitioned": "partitioning",
    "is_box": "partitioning",
    "unbox": "partitioning",
    "unbox_tree": "partitioning",
    "leaf_sharding": "partitioning",
    "LeafSharding": "partitioning",
    # paths
    "flatten": "paths",
    "unflatten": "paths",
    "leaves_with_paths": "paths",
    "map_with_path": "paths",
    "path_str": "paths",
    # counting
    "get_num_params": "counting",
    "get_num_bytes": "counting",
    # table
    "tabulate_params": "table",
    "Row": "table",
    "rows_from_tree": "table",
    # norms
    "get_sharded_norm_logits": "norms",
    "get_sharded_global_norm": "norms",
    "get_grad_norms": "norms",
    "get_param_norms": "norms",
    "norm_metrics": "norms",
    "clip_by_global_norm": "norms",
    "MetricsLogger": "norms",
    "JsonlWriter": "norms",
    # masks
    "get_param_mask_fn": "masks",
    "get_param_label_fn": "masks",
    "flattened_traversal": "masks",
    # abstract
    "make_abstract": "abstract",
    "replicate": "abstract",
    "update_ema": "abstract",
    # checkpoint
    "get_checkpoint_manager": "checkpoint",
    "restore_checkpoint": "checkpoint",
    "load_parameters": "checkpoint",
    "save_checkpoint": "checkpoint",
    "list_steps": "checkpoint",
    "list_incomplete": "checkpoint",
    "latest_step": "checkpoint",
    "CheckpointMismatchError": "checkpoint",
    # inspect
    "inspect_path": "inspect",
    "diff_paths": "inspect",
    "open_checkpoint": "inspect",
    "CheckpointError": "inspect",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treetools' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"treetools.{module}"), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # static analysers see ordinary imports
    from treetools.abstract import make_abstract, replicate, update_ema
    from treetools.checkpoint import (
        CheckpointMismatchError,
        get_checkpoint_manager,
        latest_step,
        list_incomplete,
        list_steps,
        load_parameters,
        restore_checkpoint,
        save_checkpoint,
    )
    from treetools.counting import get_num_bytes, get_num_params
    from treetools.inspect import CheckpointError, diff_paths, inspect_path, open_checkpoint
    from treetools.masks import flattened_traversal, get_param_label_fn, get_param_mask_fn
    from treetools.norms import (
        JsonlWriter,
        MetricsLogger,
        clip_by_global_norm,
        get_grad_norms,
        get_param_norms,
        get_sharded_global_norm,
        get_sharded_norm_logits,
        norm_metrics,
    )
    from treetools.partitioning import LeafSharding, is_box, is_partitioned, leaf_sharding, unbox, unbox_tree
    from treetools.paths import flatten, leaves_with_paths, map_with_path, path_str, unflatten
    from treetools.table import Row, rows_from_tree, tabulate_params
