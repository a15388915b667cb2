"""Parameter and byte counts, global and per device, without allocating.

What a state counts: ``params_of`` (``treetools.pytree.partitioning``) decides, for
``get_num_params``, ``get_num_bytes`` and ``tabulate_params`` alike: a
TrainState counts its ``params``, an nnx Module its ``nnx.Param`` variables,
any other tree every array leaf.

Per device (``per_device=True``), the answer is the most that any one device
holds, summed over the leaves:

* a leaf whose array is placed (a ``jax.Array``, or a ``ShapeDtypeStruct``
  with a ``Sharding`` on a concrete mesh) counts what each device really holds,
  from its own sharding (``Sharding.devices_indices_map``, which agrees with
  ``addressable_shards``); box names never override where an array is;
* a leaf with no placement (numpy arrays, ``jax.eval_shape`` structs, structs
  on an ``AbstractMesh``) counts its largest shard on every device: from its
  sharding's ``shard_shape`` when it has one, else from its box names and the
  mesh (uneven splits round up), else the whole leaf.

The result is ``max over devices (placed sums) + sum (unplaced largest
shards)``: exact for a tree of placed arrays (a tree whose buffers all sit on
device 0 reports everything), and for a tree laid out on one mesh the same
number as the names give.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

import jax
import numpy as np

from treetools.shared.aliases import PyTree
from treetools.pytree.partitioning import is_box, own_sharding, params_of, shard_shape, unbox


def is_array_like(x: Any) -> bool:
    """Arrays, ``ShapeDtypeStruct``s and numpy scalars: things with a shape and a dtype.

    Python scalars, strings and None are not (they count 0).

    >>> import numpy as np
    >>> is_array_like(np.float32(1.0)), is_array_like(1.0), is_array_like("w")
    (True, False, False)
    """
    x = unbox(x)
    return hasattr(x, "shape") and hasattr(x, "dtype")


@functools.cache
def _itemsize_cached(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # jax extended dtypes (typed PRNG keys: key<fry> is 8 bytes) know their own size
        return int(dtype.itemsize)


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``, as jax's ``nbytes`` counts them (typed PRNG keys included).

    >>> import jax, numpy as np
    >>> itemsize(np.float16), itemsize(jax.random.key(0).dtype)
    (2, 8)
    """
    return _itemsize_cached(dtype)


def leaf_size(x: Any, *, per_device: bool = False, mesh: Any = None) -> int:
    """Elements in one leaf (0 for non-arrays); ``per_device`` gives its largest shard.

    The largest shard comes from the array's own sharding first, else from
    its box names and the mesh (see the module docstring).

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
    """Bytes in one leaf (its size times the itemsize of its dtype, as jax's ``nbytes``).

    >>> import jax, numpy as np
    >>> leaf_nbytes(np.ones((2, 3), np.float16)), leaf_nbytes(jax.random.key(0))
    (12, 8)
    """
    size = leaf_size(x, per_device=per_device, mesh=mesh)
    return size * itemsize(unbox(x).dtype) if size else 0


def _array_size(value: Any) -> int:
    shape = getattr(value, "shape", None)
    return math.prod(shape) if shape is not None and hasattr(value, "dtype") else 0


def _array_nbytes(value: Any) -> int:
    size = _array_size(value)
    return size * itemsize(value.dtype) if size else 0


@functools.lru_cache(maxsize=4096)
def _device_sizes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``((device id, elements it holds), ...)`` for every device of ``sharding``."""
    out = []
    for device, index in sharding.devices_indices_map(shape).items():
        held = math.prod(len(range(*s.indices(d))) for s, d in zip(index, shape))
        out.append((device.id, held))  # type: ignore[attr-defined]  # jaxlib's Device stub has no `id`
    return tuple(out)


def _placed_sizes(sharding: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...] | None:
    """Per-device sizes when the sharding names real devices, else None."""
    try:
        return _device_sizes(sharding, shape)
    except Exception:  # a sharding without a device assignment
        return None


def _per_device_total(tree: PyTree, *, nbytes: bool, mesh: Any) -> int:
    per_device: Counter[int] = Counter()
    placed: Counter[tuple[Any, tuple[int, ...], int]] = Counter()
    unplaced = 0
    for leaf in jax.tree.leaves(tree, is_leaf=is_box):  # shard sizes need each box's names
        value = unbox(leaf)
        if not _array_size(value):
            continue
        unit = itemsize(value.dtype) if nbytes else 1
        sharding = own_sharding(value)
        shape = tuple(int(d) for d in value.shape)
        if sharding is not None and not isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
            placed[(sharding, shape, unit)] += 1  # grouped: devices_indices_map once per layout
            continue
        unplaced += math.prod(shard_shape(leaf, mesh=mesh)) * unit
    for (sharding, shape, unit), count in placed.items():
        sizes = _placed_sizes(sharding, shape)
        if sizes is None:
            # No device assignment: the largest shard, uneven splits rounded up (shard_shape's rule).
            struct = jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
            unplaced += math.prod(shard_shape(struct)) * unit * count
            continue
        for device, size in sizes:
            per_device[device] += size * unit * count
    return (max(per_device.values()) if per_device else 0) + unplaced


def _total(tree: PyTree, *, nbytes: bool, per_device: bool, mesh: Any) -> int:
    tree = params_of(tree)
    if per_device:
        return _per_device_total(tree, nbytes=nbytes, mesh=mesh)
    # A box flattens to the array it holds, so global counts can use the plain
    # (C++) flatten with no is_leaf callback per node, and no unboxing.
    return sum(map(_array_nbytes if nbytes else _array_size, jax.tree.leaves(tree)))


def get_num_params(tree: PyTree, *, per_device: bool = False, mesh: Any = None) -> int:
    """Number of elements in ``tree``: the model size, for a state.

    Works on arrays, ``ShapeDtypeStruct``s (nothing is allocated), flax boxes,
    nnx State and optax states; non-array leaves count 0. A ``TrainState``
    counts its ``params`` and an nnx ``Module`` its ``nnx.Param`` variables
    (not the optimizer moments, the step, ``BatchStat``s or RNG state), the
    same leaves ``tabulate_params`` shows; pass ``state.opt_state`` or
    ``nnx.state(model)`` to count those.

    Args:
      tree: any pytree, a TrainState or an nnx Module.
      per_device: count the elements the fullest device holds instead. A placed
        array counts what each device really holds (its own ``Sharding``, as
        ``addressable_shards``); an unplaced leaf (numpy, ``jax.eval_shape``)
        counts its largest shard from its box names and the mesh. The answer
        is the maximum over devices of the placed sums, plus the unplaced shards.
      mesh: a ``Mesh`` or ``{axis: size}`` for unplaced boxes that name axes but
        carry no mesh (default: the ambient ``jax.set_mesh`` mesh).

    Returns:
      A Python int.

    Raises:
      ValueError: ``per_device=True`` and an unplaced box names a mesh axis
        whose size no mesh gives.

    >>> import jax, jax.numpy as jnp
    >>> get_num_params({"w": jax.ShapeDtypeStruct((1024, 512), jnp.float32), "b": jnp.zeros(512)})
    524800
    """
    return _total(tree, nbytes=False, per_device=per_device, mesh=mesh)


def get_num_bytes(tree: PyTree, *, per_device: bool = False, mesh: Any = None) -> int:
    """Like ``get_num_params``, in bytes (each leaf's size times its dtype's itemsize, as jax's ``nbytes``).

    Typed PRNG keys count their real size (``jax.random.key(0)``: 8 bytes).

    >>> import jax, jax.numpy as jnp
    >>> get_num_bytes({"w": jnp.zeros((4, 4), jnp.bfloat16), "rng": jax.random.key(0)})
    40
    """
    return _total(tree, nbytes=True, per_device=per_device, mesh=mesh)
