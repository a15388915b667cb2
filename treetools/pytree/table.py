"""``tabulate_params``: a tree -> rows (``treetools.shared.rows``) -> a rendered table (``treetools.shared.render``).

The row type and the renderers are shared with the checkpoint inspector and
the CLI; this module builds rows from a live tree (``rows_from_tree``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax

from treetools.shared.aliases import PyTree
from treetools.pytree.counting import is_array_like, itemsize, leaf_nbytes, leaf_size
from treetools.pytree.masks import get_param_mask_fn
from treetools.pytree.partitioning import is_box, leaf_sharding, params_of, unbox
from treetools.pytree.paths import is_leaf, leaves_with_paths, path_parts
from treetools.shared.render import render_rows
from treetools.shared.rows import Row, aggregate_rows, dtype_name, sort_rows, totals
from treetools.pytree.stacked import Stacked, find_stacks


def rows_from_tree(tree: PyTree, *, weight_decay: PyTree | None = None, mesh: Any = None) -> list[Row]:
    """One ``Row`` per leaf of ``tree``, in tree order.

    Args:
      tree: any pytree; boxes are leaves and report their sharding.
      weight_decay: optional bool tree of the same structure (e.g. the output
        of ``get_param_mask_fn``); flags are joined by path, never by position.
      mesh: passed to ``leaf_sharding`` for boxes without a mesh.

    >>> import numpy as np
    >>> [(r.name, r.shape, r.params) for r in rows_from_tree({"w": np.ones((2, 3)), "step": 7})]
    [('step', None, 0), ('w', (2, 3), 6)]
    """
    flags: dict[str, Any] = {}
    if weight_decay is not None:
        flags = {p: bool(unbox(f)) for p, f in leaves_with_paths(weight_decay)}
    rows = []
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf):
        parts = path_parts(keypath)
        name = "/".join(parts)
        if weight_decay is not None and name not in flags:
            raise ValueError(f"weight-decay mask has no entry for `{name}`; build it from the same params.")
        decay = flags.get(name) if weight_decay is not None else None
        if not is_box(leaf) and hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            # A bare array or struct (most leaves): its size and bytes straight from its shape and dtype, as
            # leaf_size and leaf_nbytes count them.
            shape = tuple(int(d) for d in leaf.shape)
            size = math.prod(shape)
            rows.append(Row(path=parts, shape=shape, dtype=dtype_name(leaf.dtype), params=size,
                            bytes=size * itemsize(leaf.dtype) if size else 0,
                            sharding=leaf_sharding(leaf, mesh=mesh), weight_decay=decay))
            continue
        arr = is_array_like(leaf)
        value = unbox(leaf)
        rows.append(
            Row(
                path=parts,
                shape=tuple(int(d) for d in value.shape) if arr else None,
                dtype=dtype_name(value.dtype) if arr else None,
                params=leaf_size(leaf),
                bytes=leaf_nbytes(leaf),
                sharding=leaf_sharding(leaf, mesh=mesh) if arr else None,
                weight_decay=decay,
            )
        )
    return rows



def tabulate_params(
    state: Any,
    show_weight_decay: bool = False,
    weight_decay_exclude: Sequence[str] | None = None,
    weight_decay_include: Sequence[str] | None = None,
    *,
    depth: int | None = None,
    tablefmt: str = "simple",
    sort: str | None = None,
    mesh: Any = None,
    allow_unmatched: bool = False,
    stacked: Stacked = None,
) -> str:
    """A table of parameters: path, shape, dtype, params, bytes, sharding.

    The weight-decay column comes from ``get_param_mask_fn`` itself, the same
    function the optimizer uses, joined by path, so rows and flags cannot be
    misaligned. Totals (params, bytes, per dtype) are at the bottom. A
    ``layers`` column, shown when the tree has stacked (scanned) leaves, gives
    each such leaf's layer count (a module's, at ``depth``, when all its leaves
    hold that many layers); the shape keeps the layer axis. The sharding
    column is ``leaf_sharding``'s: where a live array is (a box whose array
    sits whole on one device says ``whole on cuda:0``, as
    ``get_num_params(per_device=True)`` counts it), its box's spec only for
    unplaced leaves.

    Args:
      state: a ``TrainState`` (its ``params``), an nnx Module or State, or a plain tree.
      show_weight_decay: add the weight-decay column.
      weight_decay_exclude: patterns of leaves *not* decayed (``get_param_mask_fn``).
      weight_decay_include: patterns of the only leaves decayed.
      allow_unmatched: let a weight-decay pattern match no leaf, as
        ``get_param_mask_fn(..., allow_unmatched=True)`` (the same config for
        model families with and without biases).
      depth: one row per module prefix of ``depth`` path parts, summed.
      tablefmt: any ``tabulate`` format (``simple``, ``github``, ``simple_grid``...).
      sort: ``path``, ``params`` or ``bytes``; default tree order.
      mesh: sizes for boxes that name mesh axes but carry no mesh.
      stacked: which leaves are stacked layers, as in ``norm_metrics``: None
        (default) from ``layers`` axis names in their boxes (``nn.scan`` with
        ``metadata_params={nn.PARTITION_NAME: "layers"}``), ``{pattern: axis}``,
        or False.

    Returns:
      The rendered table as a string.

    >>> import jax.numpy as jnp
    >>> print(tabulate_params({"w": jnp.zeros((2, 3))}).splitlines()[2])
    w       (2, 3)   float32  6         24 B
    >>> print(tabulate_params({"layers": {"w": jnp.zeros((24, 2, 3))}}, stacked={"layers": 0}).splitlines()[2])
    layers/w  (24, 2, 3)  24        float32  144       576 B
    """
    params = params_of(state)
    mask = None
    if show_weight_decay:
        mask = get_param_mask_fn(weight_decay_exclude or [], weight_decay_include,
                                 allow_unmatched=allow_unmatched)(params)
    leaf_rows = _with_layers(rows_from_tree(params, weight_decay=mask, mesh=mesh), params, stacked)
    rows = sort_rows(aggregate_rows(leaf_rows, depth), sort)
    return render_rows(rows, tablefmt=tablefmt, show_weight_decay=show_weight_decay, total=totals(leaf_rows))


def _with_layers(rows: list[Row], params: PyTree, stacked: Stacked) -> list[Row]:
    """Rows with the layer count of each stacked leaf (``treetools.pytree.stacked``), joined by path."""
    if stacked is False or (stacked in (None, True) and not any(map(is_box, jax.tree.leaves(params, is_leaf=is_leaf)))):
        return rows  # found from boxes, and there is none: no path needs building
    pairs = leaves_with_paths(params)
    counts = {path: stack.length for (path, _), stack in zip(pairs, find_stacks(pairs, stacked)) if stack}
    return [dataclasses.replace(r, layers=counts[r.name]) if r.name in counts else r for r in rows]
