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

    >>> import numpy as np
    >>> is_array_like(np.float32(1.0)), is_array_like(1.0), is_array_like("w")
    (True, False, False)
    """
    x = unbox(x)
    return hasattr(x, "shape") and hasattr(x, "dtype")


def leaf_size(x: Any, *, per_device: bool = False, mesh: Any = None) -> int:
    """Elements in one leaf (0 for non-arrays); ``per_device`` gives the largest shard.

    >>> import flax.linen as nn, numpy as np
    >>> box = nn.Partitioned(np.ones((8, 4)), names=("fsdp", None))
    >>> leaf_size(box), leaf_size(box, per_device=True, mesh={"fsdp": 8}), leaf_size(None)
    (32, 4, 0)
    """
    value = unbox(x)
    if not per_device or not _array_size(value):
        return _array_size(value)
    return math.prod(shard_shape(x, mesh=mesh))


def leaf_nbytes(x: Any, *, per_device: bool = False, mesh: Any = None) -> int:
    """Bytes in one leaf (itemsize of its dtype times its size).

    >>> import numpy as np
    >>> leaf_nbytes(np.ones((2, 3), np.float16))
    12
    """
    size = leaf_size(x, per_device=per_device, mesh=mesh)
    return size * np.dtype(unbox(x).dtype).itemsize if size else 0


def _total(fn, tree: PyTree, *, per_device: bool, mesh: Any) -> int:
    if per_device:  # shard sizes need each box's names: boxes are leaves here
        return sum((fn(leaf, per_device=True, mesh=mesh) for leaf in jax.tree.leaves(tree, is_leaf=is_box)), 0)
    # A box flattens to the array it holds, so global counts can use the plain
    # (C++) flatten with no is_leaf callback per node, and no unboxing.
    plain = _array_size if fn is leaf_size else _array_nbytes
    return sum(map(plain, jax.tree.leaves(tree)))


def _array_size(value: Any) -> int:
    shape = getattr(value, "shape", None)
    return math.prod(shape) if shape is not None and hasattr(value, "dtype") else 0


def _array_nbytes(value: Any) -> int:
    size = _array_size(value)
    return size * np.dtype(value.dtype).itemsize if size else 0


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
