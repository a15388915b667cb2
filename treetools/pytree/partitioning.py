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
import sys
from typing import Any, Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec

from treetools.shared.aliases import PyTree
from treetools.shared.rows import LeafSharding  # "how a leaf is laid out", shared with the jax-free checkpoint readers

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


def layer_axis(x: Any, name: str = "layers") -> int | None:
    """The array axis a box names ``name``: where a scanned (stacked) leaf keeps its layers.

    flax inserts that name into a box's names at the scan axis: linen
    ``nn.scan(..., metadata_params={nn.PARTITION_NAME: "layers"})`` (a
    ``Partitioned`` or ``LogicallyPartitioned`` box, MaxText's ``layers``
    logical axis) and nnx ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME:
    "layers"})`` (the Variable's sharding names). A names entry that is a tuple
    of mesh axes counts when it holds ``name``. None for anything else: a bare
    array, a box without the name.

    >>> import flax.linen as nn, numpy as np
    >>> layer_axis(nn.Partitioned(np.ones((4, 2, 3)), names=("layers", None, "fsdp")))
    0
    >>> layer_axis(nn.Partitioned(np.ones((2, 3)), names=(None, "fsdp"))) is None
    True
    """
    if _is_linen_box(x):
        names = tuple(x.names or ())
    elif _is_nnx_variable(x):
        names = _nnx_names(x) or ()
    else:
        return None
    for i, entry in enumerate(names):
        if entry == name or (isinstance(entry, (tuple, list)) and name in entry):
            return i
    return None


def unbox(x: Any) -> Any:
    """The array inside a box; anything else is returned as is.

    >>> import flax.linen as nn, numpy as np
    >>> unbox(nn.Partitioned(np.zeros(2), names=("x",)))
    array([0., 0.])
    """
    if not is_box(x):  # one cached type lookup for the common case, an array
        return x
    if _is_nnx_variable(x):
        return x.get_value()
    return x.value


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


def _is_logical_box(x: Any) -> bool:
    return _is_linen_box(x) and hasattr(x, "rules") and "Logically" in type(x).__name__


def _linen_spec(x: Any) -> PartitionSpec:
    # flax's own rules: a LogicallyPartitioned box maps its names with
    # ``nn.logical_to_mesh_axes`` (its ``rules``, else the context's; a name no
    # rule maps is replicated), exactly as its ``unbox`` constrains the value.
    names = tuple(x.names)
    if not _is_logical_box(x):
        return x.get_partition_spec() if hasattr(x, "get_partition_spec") else PartitionSpec(*names)
    from flax import linen as nn  # heavy; only for logical names

    spec = nn.logical_to_mesh_axes(names, getattr(x, "rules", None))
    return spec if spec is not None else PartitionSpec(*([None] * len(names)))


def _nnx_spec(x: Any) -> PartitionSpec | None:
    # flax's own rules: ``nnx.spmd.get_var_pspec`` (the Variable's
    # ``sharding_rules`` composed with the ``logical_axis_rules`` context).
    names = x.get_metadata().get("out_sharding")
    if not names:
        return None
    from flax.core import spmd as core_spmd
    from flax.nnx import spmd

    if isinstance(names, NamedSharding):  # get_var_pspec unpacks the names; flax's shard_value maps the spec
        return core_spmd.apply_rules(names, x.get_metadata().get("sharding_rules")).spec
    return spmd.get_var_pspec(x)


def box_spec(x: Any) -> PartitionSpec | None:
    """The PartitionSpec (over mesh axes) a box's names give, through flax's own rules.

    linen ``Partitioned``: its names; ``LogicallyPartitioned``: its names
    through ``nn.logical_to_mesh_axes`` (its ``rules``, else the
    ``nn.logical_axis_rules`` context); nnx ``Variable``: ``nnx.spmd.get_var_pspec``.
    None for a leaf that is no box or carries no names. The array inside is
    not looked at: that is ``own_sharding``.

    >>> import flax.linen as nn, numpy as np
    >>> box = nn.LogicallyPartitioned(np.ones((4, 4)), names=("embed", "mlp"), rules=(("embed", "fsdp"),))
    >>> box_spec(box)
    P('fsdp', None)
    """
    if _is_linen_box(x):
        return _linen_spec(x)
    if _is_nnx_variable(x):
        return _nnx_spec(x)
    return None


def _box_mesh(x: Any) -> Any:
    if _is_linen_box(x):
        return getattr(x, "mesh", None)
    if _is_nnx_variable(x):
        meta = x.get_metadata()
        names = meta.get("out_sharding")
        return names.mesh if isinstance(names, NamedSharding) else meta.get("mesh")
    return None


def own_sharding(x: Any) -> jax.sharding.Sharding | None:
    """The ``Sharding`` the array (or ``ShapeDtypeStruct``) inside ``x`` carries itself.

    That is where a placed array really is, whatever names its box carries.
    None for numpy arrays, tracers, structs without a sharding and non-arrays.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> own_sharding(np.ones(2)) is None, own_sharding(jnp.ones(2)).is_fully_replicated
    (True, True)
    """
    value = unbox(x)
    if isinstance(value, jax.core.Tracer):
        return None
    sharding = getattr(value, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def active_mesh() -> jax.sharding.Mesh | None:
    """The concrete ``Mesh`` of the enclosing ``jax.set_mesh(...)``, or None.

    >>> active_mesh() is None
    True
    """
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    if get_mesh is None:
        return None
    try:
        mesh = get_mesh()
    except Exception:  # no concrete mesh in this context
        return None
    return mesh if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty else None


def _is_abstract_mesh_sharding(sharding: Any) -> bool:
    return isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh)


def resolve_sharding(sharding: Any, mesh: jax.sharding.Mesh | None = None) -> Any:
    """A ``NamedSharding`` on an ``AbstractMesh`` put on a concrete mesh; any other value as is.

    ``nnx.eval_shape`` under ``jax.set_mesh`` gives structs whose shardings
    live on the abstract mesh, which cannot place data. The spec is kept and
    laid on ``mesh``, or on the active concrete mesh (``jax.set_mesh``).

    Raises:
      ValueError: no concrete mesh is given or active, or the spec names an
        axis the mesh does not have.
    """
    if not _is_abstract_mesh_sharding(sharding):
        return sharding
    mesh = mesh if mesh is not None else active_mesh()
    if mesh is None:
        raise ValueError(
            f"the sharding {sharding.spec} lives on an AbstractMesh (axes {tuple(sharding.mesh.axis_names)}), "
            "which cannot place data; call inside `with jax.set_mesh(mesh):` or pass `mesh=`."
        )
    missing = [a for e in sharding.spec for a in mesh_axes_of(e) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"the sharding {sharding.spec} names mesh axes {missing} that the mesh (axes "
            f"{tuple(mesh.axis_names)}) does not have."
        )
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def leaf_sharding(x: Any, *, mesh: Any = None) -> LeafSharding | None:
    """The PartitionSpec (over mesh axes) and mesh-axis sizes of one leaf.

    A leaf whose array (or struct) carries a ``NamedSharding`` answers with
    it: that is where the array is, whatever names its box carries. A box
    whose array is placed otherwise answers with that placement too, as
    ``get_num_params(per_device=True)`` counts it: on one device (initialized
    without ``out_shardings``), ``LeafSharding((), device="cpu:0")``; on
    every device of its sharding whole, replicated. Only an unplaced box
    (numpy, ``jax.eval_shape`` structs, tracers) answers with its names, mapped
    to mesh axes by flax's own rules (``box_spec``), the mesh sizes from the
    box's mesh, else ``mesh``, else the ambient mesh. A bare array on one
    device claims no layout: None, as for numpy.

    Args:
      x: a box, a ``jax.Array``, or a ``ShapeDtypeStruct``.
      mesh: a ``Mesh`` (or ``{axis: size}``) used when the leaf names axes but
        carries no mesh itself; defaults to the ambient mesh (``jax.set_mesh``).

    Returns:
      ``LeafSharding`` or None when the leaf has no named sharding
      (numpy arrays, single-device arrays, scalars).

    >>> import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
    >>> leaf_sharding(nn.Partitioned(np.ones((4, 4)), names=("fsdp", None)), mesh={"fsdp": 2}).spec
    P('fsdp', None)
    >>> placed = leaf_sharding(nn.Partitioned(jnp.ones((4, 4)), names=("fsdp", None)))  # on the default device
    >>> placed.spec, placed.device == str(jax.devices()[0])
    ((), True)
    """
    own = own_sharding(x)
    if isinstance(own, NamedSharding):
        return LeafSharding(own.spec, _mesh_sizes(own.mesh))
    spec = box_spec(x)
    if spec is not None and own is not None:  # placed, but not by names: where it is, not what the box says
        if len(own.device_set) == 1:
            return LeafSharding((), device=str(next(iter(own.device_set))))
        if own.is_fully_replicated:
            return LeafSharding(())
    if spec is not None:
        fallback = mesh if isinstance(mesh, Mapping) else _mesh_sizes(mesh)
        return LeafSharding(spec, _mesh_sizes(_box_mesh(x)) or fallback or _context_mesh())
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
    if not _is_logical_box(x):
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

    The array's own ``Sharding`` first (any kind, not only NamedSharding; a
    box's names do not override where its array really is); for a box whose
    array carries no sharding (numpy, ``jax.eval_shape`` structs), its names
    and the mesh. Uneven splits round up.

    Raises:
      ValueError: the leaf names mesh axes but no mesh gives their sizes.

    >>> import flax.linen as nn, numpy as np
    >>> shard_shape(nn.Partitioned(np.ones((10, 4)), names=("fsdp", None)), mesh={"fsdp": 4})
    (3, 4)
    """
    value = unbox(x)
    shape = tuple(getattr(value, "shape", ()) or ())
    sharding = own_sharding(x)
    if sharding is not None:
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
                known = f"the mesh has axes {tuple(sizes)}" if sizes else "no mesh says its size"
                raise ValueError(
                    f"leaf is sharded over mesh axis `{axis}` but {known}; "
                    "pass `mesh=` (a Mesh or {axis: size}) or call inside `jax.set_mesh(mesh)`"
                    + ("; map logical names to mesh axes with `nn.logical_axis_rules(...)`." if sizes else ".")
                )
            parts *= sizes[axis]
        out.append(math.ceil(dim / parts))
    return tuple(out)


def _is_nnx_module(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")  # a Module exists only once flax.nnx is imported
    return nnx is not None and isinstance(x, nnx.Module)


def _is_nnx_state(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.State)


def params_of(state: Any) -> Any:
    """The parameters of a state: what ``get_num_params`` and ``tabulate_params`` count.

    * an nnx ``Module``: ``nnx.state(module, nnx.Param)``, its ``nnx.Param``
      variables only (no ``BatchStat``, no ``Rngs`` keys and counts);
    * a ``TrainState`` (any non-mapping object with a ``params`` attribute,
      e.g. ``flax.training.train_state.TrainState``): its ``params``, not the
      optimizer state or the step;
    * anything else (a params dict, linen ``variables``, an nnx ``State``, an
      optax state): the tree itself, every leaf counted.

    >>> import jax.numpy as jnp, optax
    >>> from flax.training import train_state
    >>> params = {"w": jnp.ones(3)}
    >>> state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    >>> params_of(state) is params
    True
    """
    if _is_nnx_module(state):
        from flax import nnx

        return nnx.state(state, nnx.Param)
    if not isinstance(state, Mapping) and not is_box(state) and hasattr(state, "params"):
        return state.params
    return state


def state_parts(state: Any) -> dict[str, Any]:
    """A train state as named parts, the parameters under ``params``: what ``memory_plan`` lays out part by part.

    * an nnx ``Module``, or an nnx ``State`` holding more than ``nnx.Param``s: ``params`` (its ``nnx.Param``
      variables) and, when it has any, ``state`` (every other variable: ``BatchStat``, RNG streams);
    * a dataclass with a ``params`` field (``flax.training.train_state.TrainState``): its pytree fields by name
      (``step``, ``params``, ``opt_state``), static fields (``apply_fn``, ``tx``) left out;
    * a mapping with a ``params`` key (linen ``variables``, ``{"params": ..., "opt_state": ...}``): its items;
    * anything else: the whole tree as ``params``.

    >>> import jax.numpy as jnp, optax
    >>> from flax.training import train_state
    >>> state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))
    >>> list(state_parts(state)), list(state_parts({"w": jnp.ones(3)}))
    (['step', 'params', 'opt_state'], ['params'])
    """
    if _is_nnx_module(state) or _is_nnx_state(state):
        from flax import nnx

        params, rest = (nnx.state(state, nnx.Param, ...) if _is_nnx_module(state) else
                        nnx.split_state(state, nnx.Param, ...))
        return {"params": params, **({"state": rest} if jax.tree.leaves(rest) else {})}
    if dataclasses.is_dataclass(state) and not isinstance(state, type) and hasattr(state, "params"):
        return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
                if f.metadata.get("pytree_node", True)}
    if isinstance(state, Mapping) and "params" in state and not is_box(state):
        return dict(state)
    return {"params": state}
