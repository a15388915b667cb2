"""``tabulate_params``: a tree -> rows (``treetools.rows``) -> a rendered table (``treetools.render``).

The row type and the renderers live in their own modules so that the
checkpoint inspector and the CLI share them; their names are re-exported here
for code that imported them from ``treetools.table``.
"""

from __future__ import annotations

from typing import Any, Sequence

from treetools._typing import PyTree
from treetools.render import render_rows
from treetools.rows import Row, Totals, aggregate_rows, dtype_name, human, rows_from_tree, sort_rows, totals

__all__ = [
    "Row",
    "Totals",
    "aggregate_rows",
    "dtype_name",
    "human",
    "render_rows",
    "rows_from_tree",
    "sort_rows",
    "tabulate_params",
    "totals",
]


def _params_of(state: Any) -> PyTree:
    """What the table shows: ``treetools.partitioning.params_of``, the rule ``get_num_params`` counts by."""
    from treetools.partitioning import params_of

    return params_of(state)


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
) -> str:
    """A table of parameters: path, shape, dtype, params, bytes, sharding.

    The weight-decay column comes from ``get_param_mask_fn`` itself, the same
    function the optimizer uses, joined by path, so rows and flags cannot be
    misaligned. Totals (params, bytes, per dtype) are at the bottom.

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

    Returns:
      The rendered table as a string.

    >>> import jax.numpy as jnp
    >>> print(tabulate_params({"w": jnp.zeros((2, 3))}).splitlines()[2])
    w       (2, 3)   float32  6         24 B
    """
    params = _params_of(state)
    mask = None
    if show_weight_decay:
        from treetools.masks import get_param_mask_fn

        mask = get_param_mask_fn(weight_decay_exclude or [], weight_decay_include,
                                 allow_unmatched=allow_unmatched)(params)
    leaf_rows = rows_from_tree(params, weight_decay=mask, mesh=mesh)
    rows = sort_rows(aggregate_rows(leaf_rows, depth), sort)
    return render_rows(rows, tablefmt=tablefmt, show_weight_decay=show_weight_decay, total=totals(leaf_rows))
