"""Abstract ``ShapeDtypeStruct`` trees, replication, and EMA updates."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from treetools._typing import PyTree
from treetools.counting import is_array_like
from treetools.partitioning import is_box, leaf_sharding, rebox, unbox
from treetools.paths import is_leaf, map_with_path

__all__ = ["make_abstract", "replicate", "update_ema"]


def _own_sharding(leaf: Any, mesh: Mesh | None) -> Sharding | None:
    if mesh is not None and is_box(leaf):
        info = leaf_sharding(leaf, mesh=mesh)
        if info is not None:
            return NamedSharding(mesh, info.spec)
    return getattr(unbox(leaf), "sharding", None)


def _abstract_leaf(leaf: Any, sharding: Any, mesh: Mesh | None) -> Any:
    if not is_array_like(leaf):
        return leaf
    value = unbox(leaf)
    sharding = unbox(sharding) if sharding is not None else _own_sharding(leaf, mesh)
    if isinstance(sharding, PartitionSpec):
        if mesh is None:
            raise ValueError("`sharding` holds PartitionSpecs; pass `mesh=` so they can become NamedShardings.")
        sharding = NamedSharding(mesh, sharding)
    if sharding is not None and not isinstance(sharding, Sharding):
        raise TypeError(f"`sharding` leaves must be jax Shardings or PartitionSpecs, got {type(sharding).__name__}.")
    return rebox(leaf, jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))


def make_abstract(tree: PyTree, sharding: Any = None, *, mesh: Mesh | None = None) -> PyTree:
    """A tree of ``jax.ShapeDtypeStruct`` with the structure of ``tree``.

    Nothing is allocated or copied. Boxes stay boxes around the struct, so the
    result is a valid restore target for boxed params.

    Args:
      tree: arrays, structs or boxes; non-array leaves are kept as they are.
      sharding: one ``Sharding`` for every leaf, a tree of them (or of
        ``PartitionSpec``s with ``mesh``) matching ``tree``, or None to keep each
        array's own sharding.
      mesh: with ``sharding=None``, boxes get ``NamedSharding(mesh, their names)``.

    >>> import jax, jax.numpy as jnp
    >>> make_abstract({"w": jnp.zeros((2, 3), jnp.bfloat16)})["w"].shape
    (2, 3)
    """
    if isinstance(sharding, Mesh):
        sharding, mesh = None, sharding
    if sharding is None or isinstance(sharding, (Sharding, PartitionSpec)):
        return jax.tree.map(lambda x: _abstract_leaf(x, sharding, mesh), tree, is_leaf=is_leaf)
    return jax.tree.map(lambda x, s: _abstract_leaf(x, s, mesh), tree, sharding, is_leaf=is_leaf)


def replicate(tree: PyTree, sharding: Sharding | Mesh) -> PyTree:
    """Every array leaf as a global ``jax.Array`` laid out per ``sharding``.

    Built with ``jax.make_array_from_callback``, so each process supplies only
    its addressable shards: it works in multi-process runs where every process
    holds the same host copy. A ``Mesh`` means fully replicated on it.

    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> replicate({"w": np.ones(4)}, mesh)["w"].sharding.is_fully_replicated
    True
    """
    if isinstance(sharding, Mesh):
        sharding = NamedSharding(sharding, PartitionSpec())
    if not isinstance(sharding, Sharding):
        raise TypeError(f"`sharding` must be a jax Sharding or Mesh, got {type(sharding).__name__}.")

    def put(path: str, leaf: Any) -> Any:
        if not is_array_like(leaf):
            return leaf
        if isinstance(unbox(leaf), jax.ShapeDtypeStruct):
            raise TypeError(f"leaf `{path}` is a ShapeDtypeStruct, which holds no values; replicate concrete arrays.")
        host = np.asarray(jax.device_get(unbox(leaf)))
        arr = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
        return rebox(leaf, arr)

    return map_with_path(put, tree)


def update_ema(ema: PyTree, params: PyTree, decay: float | jax.Array) -> PyTree:
    """``ema - (1 - decay) * (ema - params)`` on every leaf, in the EMA's dtype.

    This form stays accurate when ``decay`` is close to 1 (the usual
    ``decay * ema + (1 - decay) * params`` loses the small update in rounding
    of the large product). Boxes are traversed, so boxed trees work.

    >>> import jax.numpy as jnp
    >>> update_ema({"w": jnp.zeros(2)}, {"w": jnp.ones(2)}, 0.9)["w"]
    Array([0.1, 0.1], dtype=float32)
    """

    def step(e: Any, p: Any) -> Any:
        e = jnp.asarray(e)
        # Upcast before subtracting: a bf16 ``ema - params`` rounds the very difference being applied.
        compute = jnp.promote_types(e.dtype, jnp.float32)
        ema, delta = e.astype(compute), e.astype(compute) - jnp.asarray(p).astype(compute)
        return (ema - (1.0 - decay) * delta).astype(e.dtype)

    return jax.tree.map(step, ema, params)
