"""Abstract ``ShapeDtypeStruct`` trees, replication, and EMA updates."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from treetools.shared.aliases import PyTree
from treetools.pytree.counting import is_array_like
from treetools.pytree.partitioning import (
    active_mesh,
    box_spec,
    is_box,
    mesh_axes_of,
    own_sharding,
    rebox,
    resolve_sharding,
    unbox,
)
from treetools.pytree.paths import is_leaf, map_with_path, path_str


@dataclasses.dataclass(frozen=True)
class Remapped:
    """A placed leaf whose layout on another mesh did not carry over to ``make_abstract``'s ``mesh`` as it was.

    ``was`` is its spec on the old mesh, ``now`` the spec it got: the old one
    without the mesh axes the new mesh lacks, or that no longer divide the
    dimension (those dimensions replicated).
    """

    path: str
    was: PartitionSpec
    now: PartitionSpec

    @property
    def replicated(self) -> bool:
        """Whether nothing of the old layout was kept: the leaf is whole on every device."""
        return all(entry is None for entry in self.now)

    def __str__(self) -> str:
        return f"`{self.path}` {self.was} -> {self.now}{' (replicated)' if self.replicated else ''}"


def _carried_over(spec: PartitionSpec, mesh: Mesh, shape: tuple[int, ...]) -> PartitionSpec:
    """``spec`` (from another mesh) on ``mesh``: per dimension, the axes ``mesh`` has, if they still divide it."""
    entries: list[Any] = []
    for i, entry in enumerate(spec):
        kept = tuple(a for a in mesh_axes_of(entry) if a in mesh.axis_names)
        parts = math.prod(mesh.shape[a] for a in kept)
        if not kept or i >= len(shape) or shape[i] % parts:
            entries.append(None)
        else:
            entries.append(kept if isinstance(entry, (tuple, list)) else kept[0])
    return PartitionSpec(*entries)


def _on_mesh(leaf: Any, mesh: Mesh) -> tuple[Sharding, PartitionSpec | None]:
    """Where ``make_abstract(mesh=mesh)`` puts a leaf: box names, else its own spec, else replicated.

    Also, for an array laid out on another mesh whose spec does not carry over
    whole (an axis ``mesh`` lacks, a split that no longer divides), the old spec.
    """
    spec = box_spec(leaf)
    if spec is not None:
        return NamedSharding(mesh, spec), None
    own = own_sharding(leaf)
    if isinstance(own, NamedSharding):
        if own.mesh == mesh:
            return own, None
        # XLA chose this layout for another mesh (the user did not name it): keep what fits on this one.
        carried = _carried_over(own.spec, mesh, tuple(unbox(leaf).shape))
        return NamedSharding(mesh, carried), (None if carried == own.spec else own.spec)
    return NamedSharding(mesh, PartitionSpec()), None  # unboxed, unnamed: replicated on the mesh


def _abstract_leaf(path: "_LazyPath", leaf: Any, sharding: Any, mesh: Mesh | None, remapped: list[Remapped],
                   checked: set) -> Any:
    """``leaf`` as a struct (in its box); ``path`` becomes a path string only for a message, and each
    (sharding, shape) is checked once (``checked``)."""
    if not is_array_like(leaf):
        return leaf
    value = unbox(leaf)
    try:
        if sharding is None and mesh is not None:
            sharding, was = _on_mesh(leaf, mesh)
            if was is not None:
                remapped.append(Remapped(str(path), was, sharding.spec))
        elif sharding is None:
            sharding = own_sharding(leaf)
        if isinstance(sharding, PartitionSpec):
            spec_mesh = mesh if mesh is not None else active_mesh()
            if spec_mesh is None:
                raise ValueError("`sharding` holds PartitionSpecs; pass `mesh=` so they can become NamedShardings.")
            sharding = NamedSharding(spec_mesh, sharding)
        if sharding is not None and not isinstance(sharding, Sharding):
            raise TypeError(
                f"`sharding` leaves must be jax Shardings or PartitionSpecs, got {type(sharding).__name__}."
            )
        sharding = resolve_sharding(sharding, mesh)
        struct = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
        if sharding is not None and (sharding, struct.shape) not in checked:
            sharding.shard_shape(struct.shape)  # indivisible splits fail here, not in Orbax or jit
            checked.add((sharding, struct.shape))
    except TypeError as e:
        raise TypeError(f"leaf `{path}`: {e}") from None
    except Exception as e:
        raise ValueError(f"leaf `{path}` ({value.dtype}{list(value.shape)}): {e}") from None
    return rebox(leaf, struct)


class _Paths:
    """The key paths of a tree's leaves, flattened with their paths only when a message names one (a plain
    flatten is several times cheaper than one with paths, and most calls name no leaf)."""

    __slots__ = ("_tree", "_keypaths")
    _keypaths: list[tuple[Any, ...]] | None

    def __init__(self, tree: PyTree):
        self._tree, self._keypaths = tree, None

    def __getitem__(self, i: int) -> Any:
        if self._keypaths is None:
            self._keypaths = [p for p, _ in jax.tree_util.tree_flatten_with_path(self._tree, is_leaf=is_leaf)[0]]
        return self._keypaths[i]


class _LazyPath:
    """A leaf's path that becomes its path string when printed (most leaves are never named in a message)."""

    __slots__ = ("paths", "index")

    def __init__(self, paths: Any, index: int):
        self.paths, self.index = paths, index

    def __str__(self) -> str:
        return path_str(self.paths[self.index])

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _is_sharding_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Sharding, PartitionSpec))


def _broadcast_shardings(tree: PyTree, sharding: PyTree, n_leaves: int) -> list[Any]:
    """One sharding per leaf of ``tree``: ``sharding`` may be a tree prefix of it (as for ``jax.jit``)."""
    prefix = jax.tree.map(unbox, sharding, is_leaf=is_box)  # nnx.get_named_sharding gives Variables
    specs, prefix_def = jax.tree_util.tree_flatten(prefix, is_leaf=_is_sharding_leaf)
    try:
        subtrees = prefix_def.flatten_up_to(tree)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef stub lacks it
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"`sharding` must be one Sharding, or a tree of Shardings / PartitionSpecs that is the tree or a prefix "
            f"of it (as jax.jit's shardings); it does not match: {e}"
        ) from None
    out = []
    for spec, sub in zip(specs, subtrees):
        out.extend([spec] * len(jax.tree_util.tree_leaves(sub, is_leaf=is_leaf)))
    if len(out) != n_leaves:  # a prefix leaf that is None over a None subtree, etc.
        raise ValueError("`sharding` does not match the tree's leaves; give one sharding per leaf or per subtree.")
    return out


def make_abstract(tree: PyTree, sharding: Any = None, *, mesh: Mesh | None = None) -> PyTree:
    """A tree of ``jax.ShapeDtypeStruct`` with the structure of ``tree``.

    Nothing is allocated or copied. Boxes stay boxes around the struct, so the
    result is a valid restore target for boxed params.

    Args:
      tree: arrays, structs or boxes; non-array leaves are kept as they are.
      sharding: one ``Sharding`` for every leaf, or a tree of them (or of
        ``PartitionSpec``s, laid on ``mesh`` or the active mesh) that is
        ``tree`` or a tree prefix of it, as ``jax.jit`` accepts (a ``None``
        entry: those leaves as with ``sharding=None``); or None.
      mesh: with ``sharding=None``, puts every leaf on ``mesh``: a box per its
        names (through flax's rules), an array laid out by name on another
        mesh with the same spec where it fits, and every other leaf (unboxed
        biases on one device, numpy arrays) replicated. Without ``mesh``, each
        leaf keeps its own sharding (none for numpy arrays and
        ``jax.eval_shape`` structs).

    An unboxed array laid out on another mesh (XLA chose its layout in
    training: ``P('data',)``) keeps, per dimension, the mesh axes ``mesh``
    has, where they still divide it; the rest is replicated. One warning
    names every such leaf with its old and new spec (``(replicated)`` where
    nothing was kept); pass ``sharding=`` for those leaves to choose instead.

    Shardings on an ``AbstractMesh`` (structs from ``nnx.eval_shape`` under
    ``jax.set_mesh``) are laid on ``mesh``, else on the active ``jax.set_mesh``
    mesh: they cannot place data themselves.

    Raises:
      ValueError: a leaf's sharding does not fit it (rank, an indivisible split,
        an axis the mesh lacks, an AbstractMesh with no concrete mesh to resolve
        it on); the message names the leaf's path. Also when ``sharding`` is no
        prefix of ``tree``.

    >>> import jax, jax.numpy as jnp
    >>> make_abstract({"w": jnp.zeros((2, 3), jnp.bfloat16)})["w"].shape
    (2, 3)
    """
    if isinstance(sharding, Mesh):
        sharding, mesh = None, sharding
    flat, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
    if sharding is None or isinstance(sharding, (Sharding, PartitionSpec)):
        shardings = [sharding] * len(flat)
    else:
        shardings = _broadcast_shardings(tree, sharding, len(flat))
    remapped: list[Remapped] = []
    checked: set = set()
    paths = _Paths(tree)
    leaves = [_abstract_leaf(_LazyPath(paths, i), x, s, mesh, remapped, checked)
              for i, (x, s) in enumerate(zip(flat, shardings))]
    if remapped:
        warnings.warn(_remapped_message(remapped, mesh), stacklevel=2)
    return jax.tree_util.tree_unflatten(treedef, leaves)


_SHOWN = 8
"""How many remapped leaves the warning names before it counts the rest."""


def _remapped_message(remapped: list[Remapped], mesh: Mesh | None) -> str:
    """The warning for leaves laid out anew on ``mesh`` (only a mesh remaps leaves: never None here)."""
    replicated = sum(r.replicated for r in remapped)
    shape = dict(mesh.shape) if mesh is not None else {}
    lines = [f"make_abstract: {len(remapped)} leaves laid out on another mesh do not fit the mesh "
             f"{shape} as they were ({replicated} now replicated); their layout here:"]
    lines += [f"  {r}" for r in remapped[:_SHOWN]]
    if len(remapped) > _SHOWN:
        lines.append(f"  ... and {len(remapped) - _SHOWN} more")
    lines.append("Pass `sharding=` (a tree or prefix of shardings) to lay them out otherwise.")
    return "\n".join(lines)


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
        value = unbox(leaf)
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # typed keys: place their data, rewrap
            host = np.asarray(jax.device_get(jax.random.key_data(value)))
            data = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
            return rebox(leaf, jax.random.wrap_key_data(data, impl=jax.random.key_impl(value)))
        host = np.asarray(jax.device_get(value))
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
