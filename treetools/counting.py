"""Parameter and byte counts, global and per device, without allocating."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from treetools._typing import PyTree
from treetools.partitioning import is_box, shard_shape, unbox

__all__ = ["get_num_bytes", "get_num_params", "is_array_like", "leaf_nbytes", "leaf_size"]


def is_array_like(x: Any) -> bool:
    """Arrays, ``ShapeDtypeStruct``s and numpy scalars: things with a shape and a dtype.

    Python scalars, strings and None are not (they count 0).
    """
    x = unbox(x)
    return hasattr(x, "shape") and hasattr(x, "dtype")


def leaf_size(x: Any, *, per_device: bool = False, mesh: Any = None) -> int:
    """Elements in one leaf (0 for non-arrays); ``per_device`` gives the largest shard."""
    if not is_array_like(x):
        return 0
    shape = shard_shape(x, mesh=mesh) if per_device else unbox(x).shape
    return math.prod(shape)


def leaf_nbytes(x: Any, *, per_device: bool = False, mesh: Any = None) -> int:
    """Bytes in one leaf (itemsize of its dtype times its size)."""
    if not is_array_like(x):
        return 0
    return leaf_size(x, per_device=per_device, mesh=mesh) * np.dtype(unbox(x).dtype).itemsize


def _total(fn, tree: PyTree, **kw: Any) -> int:
    return sum((fn(leaf, **kw) for leaf in jax.tree.leaves(tree, is_leaf=is_box)), 0)


def get_num_params(tree: PyTree, *, per_device: bool = False, mesh: Any = None) -> int:
    """Number of elements in ``tree``.

    Works on arrays, ``ShapeDtypeStruct``s (nothing is allocated), flax boxes,
    nnx State and optax states; non-array leaves count 0.

    Args:
      tree: any pytree.
      per_device: count the elements one device holds instead: each leaf's
        largest shard, from its ``Sharding`` or its box names and the mesh.
        For trees laid out on one mesh that is the most any device holds.
      mesh: a ``Mesh`` or ``{axis: size}`` for boxes that name axes but carry no
        mesh (default: the ambient ``jax.set_mesh`` mesh).

    Returns:
      A Python int.

    >>> import jax, jax.numpy as jnp
    >>> get_num_params({"w": jax.ShapeDtypeStruct((1024, 512), jnp.float32), "b": jnp.zeros(512)})
    524800
    """
    return _total(leaf_size, tree, per_device=per_device, mesh=mesh)


def get_num_bytes(tree: PyTree, *, per_device: bool = False, mesh: Any = None) -> int:
    """Like ``get_num_params``, in bytes (each leaf's dtype itemsize).

    >>> import jax.numpy as jnp
    >>> get_num_bytes({"w": jnp.zeros((4, 4), jnp.bfloat16)})
    32
    """
    return _total(leaf_nbytes, tree, per_device=per_device, mesh=mesh)
