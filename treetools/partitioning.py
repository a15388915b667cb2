"""Boxes and shardings: the one module that knows what a box is.

A *box* is a leaf that wraps an array with axis metadata: flax.linen
``Partitioned`` / ``LogicallyPartitioned`` (anything with ``unbox`` and
``names``, as flax's ``core/meta.py`` treats axis metadata) and nnx
``Variable``. Every other module asks this one whether something is a box,
what array it holds, and how that array is laid out on a mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec

from treetools._typing import PyTree

__all__ = [
    "LeafSharding",
    "is_box",
    "is_partitioned",
    "leaf_sharding",
    "mesh_axes_of",
    "rebox",
    "shard_shape",
    "unbox",
    "unbox_tree",
    "unmapped_logical_names",
]


def _is_nnx_variable(x: Any) -> bool:
    # Duck-typed so that nnx is never imported here: nnx Variables carry their
    # metadata behind ``get_metadata`` and their array behind ``get_value``.
    return hasattr(x, "get_metadata") and hasattr(x, "get_value") and hasattr(x, "_var_metadata")


def _is_linen_box(x: Any) -> bool:
    return hasattr(x, "unbox") and hasattr(x, "names") and hasattr(x, "value")


_BOX_TYPES: dict[type, bool] = {}


def is_box(x: Any) -> bool:
    """True for any array wrapper that treetools treats as one leaf.

    That is a flax.linen ``Partitioned``/``LogicallyPartitioned`` (or other
    axis metadata with ``unbox``/``names``) and every nnx ``Variable``, with or
    without sharding names. Usable as ``is_leaf``.

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> is_box(nn.Partitioned(jnp.ones(2), names=(None,))), is_box(jnp.ones(2))
    (True, False)
    """
    # is_leaf runs on every node of every traversal: answer per type, once.
    t = type(x)
    known = _BOX_TYPES.get(t)
    if known is None:
        known = _BOX_TYPES[t] = _is_linen_box(x) or _is_nnx_variable(x)
    return known


def _nnx_names(x: Any) -> tuple | None:
    meta = x.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names is not None:
            if isinstance(names, PartitionSpec):
                return tuple(names)
            if isinstance(names, NamedSharding):
                return tuple(names.spec)
            return tuple(names)
    return None


def is_partitioned(x: Any) -> bool:
    """True for boxes that carry sharding names. Usable as ``is_leaf``.

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> is_partitioned(nn.Partitioned(jnp.ones((2, 2)), names=(None, "model")))
    True
    >>> is_partitioned(jnp.ones(2))
    False
    """
    if _is_linen_box(x):
        return True
    if _is_nnx_variable(x):
        return _nnx_names(x) is not None
    return False


def unbox(x: Any) -> Any:
    """The array inside a box; anything else is returned as is.

    >>> import flax.linen as nn, numpy as np
    >>> unbox(nn.Partitioned(np.zeros(2), names=("x",)))
    array([0., 0.])
    """
    if _is_nnx_variable(x):
        return x.get_value()
    if _is_linen_box(x):
        return x.value
    return x


def rebox(x: Any, value: Any) -> Any:
    """``x``'s box (same names, mesh and metadata) around ``value``; non-boxes give ``value``.

    Trees built this way keep the params' pytree structure, which is what
    ``optax.masked`` and ``optax.multi_transform`` compare against.

    >>> import flax.linen as nn, numpy as np
    >>> rebox(nn.Partitioned(np.zeros(2), names=("x",)), True)
    Partitioned(value=True, names=('x',), mesh=None)
    """
    if _is_nnx_variable(x):
        return x.replace(value)
    if _is_linen_box(x):
        return x.replace_boxed(value)
    return value


def unbox_tree(tree: PyTree) -> PyTree:
    """Replace every box in ``tree`` by the array it holds.

    >>> import flax.linen as nn, numpy as np
    >>> unbox_tree({"k": nn.Partitioned(np.ones(2), names=("x",))})
    {'k': array([1., 1.])}
    """
    return jax.tree.map(unbox, tree, is_leaf=is_box)


# One class for "how a leaf is laid out", shared with the jax-free checkpoint readers.
from treetools.rows import LeafSharding  # noqa: E402


def _mesh_sizes(mesh: Any) -> dict[str, int] | None:
    if mesh is None:
        return None
    shape = getattr(mesh, "shape", None)
    if isinstance(shape, Mapping) and shape:
        return {str(k): int(v) for k, v in shape.items()}
    return None


def _context_mesh() -> dict[str, int] | None:
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # older jax: no ambient mesh API
        return None
    return _mesh_sizes(mesh) if mesh is not None and not getattr(mesh, "empty", True) else None


def _logical_spec(names: tuple, rules: Any) -> PartitionSpec:
    from flax import linen as nn  # heavy; only for logical names

    if rules is None:
        rules = nn.get_logical_axis_rules()
    spec = nn.logical_to_mesh_axes(names, rules)
    return PartitionSpec(*spec) if spec is not None else PartitionSpec(*([None] * len(names)))


def leaf_sharding(x: Any, *, mesh: Any = None) -> LeafSharding | None:
    """The PartitionSpec (over mesh axes) and mesh-axis sizes of one leaf.

    Args:
      x: a box, a ``jax.Array``, or a ``ShapeDtypeStruct``.
      mesh: a ``Mesh`` (or ``{axis: size}``) used when the leaf names axes but
        carries no mesh itself; defaults to the ambient mesh (``jax.set_mesh``).

    Returns:
      ``LeafSharding`` or None when the leaf has no named sharding
      (numpy arrays, single-device arrays, scalars).

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> leaf_sharding(nn.Partitioned(jnp.ones((4, 4)), names=("fsdp", None)), mesh={"fsdp": 2}).spec
    P('fsdp', None)
    """
    fallback = mesh if isinstance(mesh, Mapping) else _mesh_sizes(mesh)
    if _is_linen_box(x):
        names = tuple(x.names)
        if hasattr(x, "rules") and "Logically" in type(x).__name__:
            spec = _logical_spec(names, getattr(x, "rules", None))
        else:
            spec = PartitionSpec(*names)
        return LeafSharding(spec, _mesh_sizes(getattr(x, "mesh", None)) or fallback or _context_mesh())
    if _is_nnx_variable(x):
        names = _nnx_names(x)
        if names is None:
            return leaf_sharding(x.get_value(), mesh=mesh)
        meta = x.get_metadata()
        rules = meta.get("sharding_rules")
        spec = _logical_spec(names, rules) if rules else PartitionSpec(*names)
        return LeafSharding(spec, _mesh_sizes(meta.get("mesh")) or fallback or _context_mesh())
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return LeafSharding(sharding.spec, _mesh_sizes(sharding.mesh))
    return None


def unmapped_logical_names(x: Any) -> tuple[str, ...]:
    """The logical names of a linen ``LogicallyPartitioned`` box that no rules can map.

    A box carrying its own ``rules``, or read inside ``nn.logical_axis_rules(...)``,
    maps its names (a name without a rule means replicated, as in flax); with
    neither, its layout is unknown and every logical name it carries is returned.
    Any other leaf gives ``()``.

    >>> import flax.linen as nn, numpy as np
    >>> unmapped_logical_names(nn.LogicallyPartitioned(np.ones((2, 2)), names=("embed", None)))
    ('embed',)
    """
    if not (_is_linen_box(x) and hasattr(x, "rules") and "Logically" in type(x).__name__):
        return ()
    if getattr(x, "rules", None) is not None:
        return ()
    from flax import linen as nn  # heavy; only for logical names

    if nn.get_logical_axis_rules():
        return ()
    return tuple(n for n in x.names if isinstance(n, str))


def mesh_axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axis names one PartitionSpec entry shards over (None gives ()).

    >>> mesh_axes_of(("fsdp", "tp")), mesh_axes_of("tp"), mesh_axes_of(None)
    (('fsdp', 'tp'), ('tp',), ())
    """
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(str(e) for e in entry)
    return (str(entry),)


def shard_shape(x: Any, *, mesh: Any = None) -> tuple[int, ...]:
    """The shape of the largest piece of ``x`` that one device holds.

    Uses the array's own ``Sharding`` when it has one (any kind, not only
    NamedSharding); for boxes, the names and the mesh. Uneven splits round up.

    Raises:
      ValueError: the leaf names mesh axes but no mesh gives their sizes.

    >>> import flax.linen as nn, numpy as np
    >>> shard_shape(nn.Partitioned(np.ones((10, 4)), names=("fsdp", None)), mesh={"fsdp": 4})
    (3, 4)
    """
    value = unbox(x)
    shape = tuple(getattr(value, "shape", ()) or ())
    if not is_box(x):
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, jax.sharding.Sharding):
            try:
                return tuple(sharding.shard_shape(shape))
            except Exception:  # uneven split: fall through to the ceil rule
                pass
    info = leaf_sharding(x, mesh=mesh)
    if info is None:
        return shape
    sizes = info.mesh or {}
    out = []
    for dim, entry in zip(shape, tuple(info.spec) + (None,) * (len(shape) - len(info.spec))):
        parts = 1
        for axis in mesh_axes_of(entry):
            if axis not in sizes:
                raise ValueError(
                    f"leaf is sharded over mesh axis `{axis}` but no mesh says its size; "
                    "pass `mesh=` (a Mesh or {axis: size}) or call inside `jax.set_mesh(mesh)`."
                )
            parts *= sizes[axis]
        out.append(math.ceil(dim / parts))
    return tuple(out)
