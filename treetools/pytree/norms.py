"""Sharded L2 norms, the norm dictionaries a trainer logs, and a clip that uses them.

Every norm is accumulated in float32: a leaf is upcast *before* it is squared,
so bf16/fp16 trees lose no precision to the accumulator and fp16 values whose
squares exceed the fp16 range (|x| > 256) do not overflow. A complex leaf
contributes ``|z|^2 = re^2 + im^2`` (as ``optax.tree.norm``), in float32.

One pass: each leaf is read once. The non-finite count of ``norm_metrics`` is
chosen per backend when lowering (``jax.lax.platform_dependent``): on GPU/TPU
it is a second reduction of each gradient beside its sum of squares, over the
same axes (the sibling pair XLA's multi-output fusion merges into one kernel;
the program a trainer writes with optax), and the program has no conditional
(on a GPU one would stall the step while the host reads its predicate); on
CPU, where XLA fuses neither, the count runs in a branch taken only when the
norm is not finite.

Where the sum happens (the psum rule):

* Under ``jax.jit`` (GSPMD) or eagerly, leaves are global ``jax.Array``s; the
  sum of squares of a global array is already global. Where the leaves'
  shardings are known at trace time (eager arrays with a ``NamedSharding``;
  under ``jit``, meshes whose axes are all ``Explicit``, the default of
  ``jax.make_mesh`` since jax 0.10), the local sums of squares are computed
  per device and stacked, with one ``psum`` per distinct set of mesh axes,
  instead of the compiler's one all-reduce per split leaf. With ``Auto``
  axes the spec is the compiler's to choose, so XLA inserts the collectives.
* Inside ``shard_map`` a leaf is the local shard. A flax ``Partitioned`` /
  ``LogicallyPartitioned`` box or an nnx ``Variable`` carrying sharding names
  says which mesh axes it is split over (logical names mapped to mesh axes by
  ``treetools.pytree.partitioning.leaf_sharding``); its local sum of squares is
  ``psum``-ed over exactly those of its mesh axes that are *bound in the
  current trace* (that is, the manual axes of the enclosing ``shard_map``;
  checked with ``jax.lax.axis_size``). A replicated leaf, a bare array, or an
  axis left automatic by a partial ``shard_map(axis_names=...)`` is not summed:
  over those axes every device already holds the whole thing.

Per layer (``stacked=``, see ``norm_metrics``): a stacked leaf ``(L, ...)`` is
reduced over every axis but its layer axis, giving L partial sums in the same
read; the leaf's sum is their sum. The L sums follow the rule above: psum-ed
over the same axes as the leaf. Inside ``shard_map`` a layer axis split over
manual mesh axes leaves each device some of the layers (``L / n`` of them, at
its index over those axes): it places its sums at their layers in a zero
vector of length L, and the leaf's psum, which runs over those axes too,
assembles all L.

So the same call is right in both places, and a box handed to plain ``jit`` is
never psum-ed (its axis names are not bound there). Called eagerly, the whole
tree is reduced by one compiled program (not one per leaf). Bare arrays inside
``shard_map`` are taken as replicated: box them (or pass ``axes=`` to
``get_sharded_norm_logits``) if they are sharded. A box whose layout cannot be
known inside ``shard_map`` is an error, never a local answer: a
``LogicallyPartitioned`` box with no logical axis rules in effect (neither its
own ``rules`` nor an ``nn.logical_axis_rules(...)`` context around the trace),
or a box naming an axis the mesh does not have. Caveat: an unrelated
``vmap(axis_name=...)`` that reuses a mesh axis name would also count as bound.

>>> import jax.numpy as jnp
>>> g, per_leaf = get_sharded_global_norm({"w": jnp.full((4,), 2.0), "b": jnp.zeros(3)})
>>> float(g), float(per_leaf["w"])
(4.0, 4.0)
"""

from __future__ import annotations

import functools
import operator
from numbers import Number
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from treetools.shared.aliases import PathStr, PyTree
from treetools.pytree.counting import is_array_like
from treetools.pytree.partitioning import is_partitioned, leaf_sharding, mesh_axes_of, unbox, unmapped_logical_names
from treetools.pytree.paths import SEP, is_leaf, leaves_with_paths, path_str
from treetools.pytree.stacked import Stack, Stacked, find_stacks, layer_parts, split_within


_F32 = jnp.float32


# --------------------------------------------------------------------------- #
# One leaf
# --------------------------------------------------------------------------- #


def _axis_is_bound(name: str) -> bool:
    # ``axis_size`` is the public way to ask the trace for an axis: inside
    # shard_map it knows the manual axes; under jit/eager it raises NameError.
    try:
        jax.lax.axis_size(name)
    except NameError:
        return False
    return True


def _psum_axes(x: Any) -> tuple[str, ...]:
    """The mesh axes a leaf's local sum must be psum-ed over (see module doc)."""
    if not is_partitioned(x):
        return ()
    info = leaf_sharding(x)
    if info is None:
        return ()
    return tuple(a for a in _spec_axes(info.spec) if _axis_is_bound(a))


def _unknown_layout(x: Any) -> str | None:
    """Why a box's local shard cannot be summed right here, or None.

    Only inside ``shard_map`` (where a box holds a local shard): a
    ``LogicallyPartitioned`` box with no rules in effect, or a box split over
    an axis the mesh does not have. Its local sum would pass for the global one.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.manual_axes or not is_partitioned(x):
        return None
    if names := unmapped_logical_names(x):
        return (
            f"a LogicallyPartitioned box with logical names {names} and no rules mapping them to mesh axes; "
            "trace the shard_map'd function inside `with nn.logical_axis_rules(rules):` (or build the box with `rules=`)"
        )
    info = leaf_sharding(x)
    unknown = [a for a in _spec_axes(info.spec) if a not in mesh.axis_names] if info is not None else []
    if unknown:
        return (
            f"split over {unknown}, which the mesh (axes {tuple(mesh.axis_names)}) does not have; name mesh axes, "
            "or map logical names with rules (`nn.logical_axis_rules(...)`, `sharding_rules=` on an nnx Variable)"
        )
    return None


def _check_layouts(pairs: list[tuple[PathStr, Any]]) -> None:
    """Raise once, naming every box whose local shard cannot be summed right (inside shard_map)."""
    problems = [(path, why) for path, x in pairs if (why := _unknown_layout(x))]
    if not problems:
        return
    lines = [f"leaf `{path}` is {why}." if path else f"the tree's one leaf is {why}." for path, why in problems]
    if len(lines) == 1:
        raise ValueError(lines[0])
    raise ValueError(
        f"inside shard_map, {len(lines)} boxes cannot be summed over the right mesh axes:\n  " + "\n  ".join(lines)
    )


def _spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec splits over, each once, in order."""
    return tuple(dict.fromkeys(a for entry in spec for a in mesh_axes_of(entry)))


def _abs_sq(value: Any) -> jax.Array:
    """Elementwise ``|x|^2`` in float32 (complex: ``re^2 + im^2``).

    Upcast first: squares of fp16 > 256 overflow fp16, and bf16 sums drift.
    A complex leaf is split into its parts rather than cast (a cast to a real
    dtype would drop the imaginary part).
    """
    x = jnp.asarray(value)
    if jnp.iscomplexobj(x):
        return jnp.square(jnp.real(x).astype(_F32)) + jnp.square(jnp.imag(x).astype(_F32))
    return jnp.square(x.astype(_F32))


def _local_sq(value: Any) -> jax.Array:
    return jnp.sum(_abs_sq(value))


# A stacked leaf as the reduction sees it: (layer axis, global layer count, the bound mesh axes that
# split the layer axis: inside shard_map the local block holds only some of the layers).
_LeafStack = tuple[int, int, tuple[str, ...]]
_EVERY_LAYER = "every"  # a group member asking for the leaf's per-layer norms as one vector


def _other_axes(ndim: int, axis: int) -> tuple[int, ...]:
    return tuple(a for a in range(ndim) if a != axis)


def _place_layers(part: jax.Array, stack: _LeafStack) -> jax.Array:
    """A stacked leaf's per-layer values, placed among all L layers.

    Where the layer axis is split over bound mesh axes (inside ``shard_map``),
    the local block holds layers ``[k * n, (k + 1) * n)`` (``k`` this device's
    index over those axes, row-major as jax splits): its values go there in a
    zero vector of all L layers, so the collective over the leaf's axes, which
    include those, assembles the whole vector (a sum, or a max of values >= 0).
    """
    _, length, split = stack
    if split:
        start = jax.lax.axis_index(split) * part.shape[0]
        part = jax.lax.dynamic_update_slice(jnp.zeros((length,), part.dtype), part, (start,))
    # XLA folds a sum of these sums (the global norm) or a slice of them (one layer) back into
    # reductions of the squared leaf, which it then writes out and reads again (measured on
    # XLA:CPU: 4x the bytes). The barrier keeps the one read.
    return jax.lax.optimization_barrier(part)


def _layer_sq(value: Any, stack: _LeafStack | None) -> jax.Array:
    """A leaf's sum of squares: a scalar, or for a stacked leaf one partial sum per layer, shape (L,).

    The per-layer sums reduce every axis but the layer axis, in the same read
    as the scalar sum (placed among all L layers by ``_place_layers``).
    """
    if stack is None:
        return _local_sq(value)
    sq = _abs_sq(value)
    return _place_layers(jnp.sum(sq, axis=_other_axes(sq.ndim, stack[0])), stack)


def _layer_count(value: Any, stack: _LeafStack | None) -> jax.Array:
    """A leaf's number of NaN/Inf elements (int32): a scalar, or one count per layer of a stacked leaf.

    A stacked leaf is counted over the same axes as its per-layer squares, so
    that the two stay sibling reductions XLA:GPU/TPU fuse into one read.
    """
    x = jnp.asarray(value)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(() if stack is None else (stack[1],), jnp.int32)
    if stack is None:
        return jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)
    return _place_layers(jnp.sum(~jnp.isfinite(x), axis=_other_axes(x.ndim, stack[0]), dtype=jnp.int32), stack)


def _layer_abs_max(value: Any, stack: _LeafStack | None) -> jax.Array:
    """A leaf's largest ``|x|`` in float32 (0 for an empty leaf; +inf if it holds a NaN): a scalar or one per layer.

    NaN is read as +inf: XLA's cross-device max (an all-reduce under GSPMD, a
    ``pmax``) drops NaN on CPU, and a max that hides a NaN would read as healthy.
    """
    x = jnp.abs(jnp.asarray(value)).astype(_F32)
    x = jnp.where(jnp.isnan(x), jnp.inf, x)
    if stack is None:
        return jnp.max(x, initial=0.0)
    return _place_layers(jnp.max(x, axis=_other_axes(x.ndim, stack[0]), initial=0.0), stack)


def get_sharded_norm_logits(x: Any, *, axes: tuple[str, ...] | None = None) -> jax.Array:
    """Squared L2 norm of one leaf, accumulated in float32.

    Inside ``shard_map`` a box (flax ``Partitioned``/``LogicallyPartitioned``,
    nnx ``Variable`` with sharding names) holds a local shard; its sum of
    squares is ``psum``-ed over the mesh axes its spec names (logical names
    mapped to mesh axes). A replicated leaf is not summed again. Outside
    ``shard_map`` a global array needs no collective. See the module docstring
    for the exact rule. A complex leaf gives ``sum(|z|^2)``.

    Args:
      x: an array, a number, or a box around one.
      axes: mesh axes to ``psum`` over, overriding the box's names (e.g. for a
        bare local shard inside ``shard_map``). ``()`` means no collective.

    Returns:
      A float32 scalar: the sum of squares of the whole (global) leaf.

    Raises:
      ValueError: inside ``shard_map``, a box whose layout cannot be known (a
        ``LogicallyPartitioned`` box with no logical axis rules in effect, or
        a mesh axis the mesh does not have).

    >>> import jax.numpy as jnp
    >>> float(get_sharded_norm_logits(jnp.full((2,), 3.0, jnp.float16)))
    18.0
    >>> float(get_sharded_norm_logits(jnp.array([3 + 4j])))
    25.0
    """
    sq = _local_sq(_check_leaf("x", x))
    if axes is None:
        _check_layouts([("x", x)])
        axes = _psum_axes(x)
    axes = tuple(axes)
    return jax.lax.psum(sq, axes) if axes else sq


def _check_leaf(path: PathStr, x: Any) -> Any:
    value = unbox(x)
    if is_array_like(value) or isinstance(value, Number):
        return value
    raise TypeError(
        f"leaf `{path}` is a {type(value).__name__}, not an array; drop it from the tree before taking norms."
    )


# --------------------------------------------------------------------------- #
# Many leaves: one local reduction per leaf, one psum per distinct axis set
# --------------------------------------------------------------------------- #


def _batched_psum(
    values: list[jax.Array], axes: tuple[tuple[str, ...], ...], collective: Any = jax.lax.psum
) -> list[jax.Array]:
    """psum each value (a scalar, or a stacked leaf's per-layer vector) over its axes, one collective per axis set.

    ``collective=jax.lax.pmax`` for maxima; the values of one axis set share a dtype.
    """
    out = list(values)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, ax in enumerate(axes):
        if ax:
            groups.setdefault(tuple(sorted(ax)), []).append(i)
    for ax, idx in groups.items():
        summed = collective(jnp.concatenate([jnp.ravel(values[i]) for i in idx]), ax)
        start = 0
        for i in idx:
            size = int(np.prod(jnp.shape(values[i])))
            out[i] = summed[start : start + size].reshape(jnp.shape(values[i]))
            start += size
    return out


# A group is a tuple of members ``(leaf index, layer)``: layer None is the whole leaf, an int one layer
# of a stacked leaf, _EVERY_LAYER (alone in its group) the leaf's per-layer norms as a vector.
_Group = tuple[tuple[int, Any], ...]


class _Reduced(NamedTuple):
    """What ``_norms`` computed: the global norm and each group's; the non-finite counts and largest ``|x|``
    (global and per group) where asked, else None."""

    norm: jax.Array
    groups: list[jax.Array]
    nonfinite: jax.Array | None = None
    group_nonfinite: list[jax.Array] | None = None
    abs_max: jax.Array | None = None
    group_abs_max: list[jax.Array] | None = None


def _norms(
    pairs: list[tuple[PathStr, Any]],
    *,
    groups: tuple[_Group, ...] = (),
    count_nonfinite: bool = False,
    group_counts: bool = False,
    abs_max: bool = False,
    stacks: list[Stack | None] | None = None,
) -> _Reduced:
    """The global norm and the norm of each group, in one read of each leaf; ``stacks``: the leaves read per layer.

    ``count_nonfinite``: also the number of NaN/Inf elements (per group too
    with ``group_counts``); ``abs_max``: also the largest ``|x|``, global and per group.
    """
    values = [_check_leaf(p, x) for p, x in pairs]
    # Decided here, in the caller's trace: inside shard_map the axes are bound.
    _check_layouts(pairs)
    axes = tuple(_psum_axes(x) for _, x in pairs)
    leaf_stacks = tuple(
        None if s is None else (s.axis, s.length, _layer_split(path, x, s.axis))
        for (path, x), s in zip(pairs, stacks or [None] * len(pairs))
    )
    layout = None if any(axes) else _known_layout(values)
    # Eagerly, one compiled program (not one per leaf); when traced, the body
    # inline: a nested jit holding the (CPU) lax.cond fails under vmap with
    # unbatched constants beside batch-sharded leaves (a jax limitation).
    traced = any(isinstance(v, jax.core.Tracer) for v in values)
    options = {"groups": groups, "count_nonfinite": count_nonfinite, "stacks": leaf_stacks,
               "group_counts": group_counts, "abs_max": abs_max}
    if layout is not None:
        mesh, specs = layout
        return (_sharded_norms_body if traced else _sharded_norms_kernel)(values, mesh=mesh, specs=specs, **options)
    return (_norms_body if traced else _norms_kernel)(values, axes=axes, **options)


def _entry_axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    return mesh_axes_of(spec[dim]) if dim < len(spec) else ()


def _layer_split(path: PathStr, x: Any, axis: int) -> tuple[str, ...]:
    """The bound mesh axes (inside ``shard_map``) that split a stacked box's layer axis; () elsewhere."""
    if not is_partitioned(x) or (info := leaf_sharding(x)) is None:
        return ()
    axes = _entry_axes(info.spec, axis)
    bound = tuple(a for a in axes if _axis_is_bound(a))
    if bound and len(bound) != len(axes):
        raise ValueError(
            f"leaf `{path}`: its layer axis {axis} is split over mesh axes {axes}, of which only {bound} are manual "
            "in this shard_map; take per-layer norms with all of them manual, or outside shard_map."
        )
    return bound


def _global_shape(x: Any) -> tuple[int, ...] | None:
    """A leaf's global shape; inside ``shard_map`` a box's local shard is scaled up along its bound split axes."""
    value = unbox(x)
    shape = getattr(value, "shape", None)
    if shape is None:
        return () if isinstance(value, Number) else None
    shape = [int(d) for d in shape]
    if is_partitioned(x) and jax.sharding.get_abstract_mesh().manual_axes and (info := leaf_sharding(x)):
        for dim in range(len(shape)):
            for a in _entry_axes(info.spec, dim):
                if _axis_is_bound(a):
                    shape[dim] *= jax.lax.axis_size(a)
    return tuple(shape)


def _known_layout(values: list[Any]) -> tuple[Any, tuple[PartitionSpec, ...]] | None:
    """``(mesh, spec of each leaf)`` when every leaf's sharding is known here and some leaf is split.

    Known means: a concrete ``jax.Array`` with a ``NamedSharding`` (an eager
    call), or a traced leaf whose type carries its spec, i.e. a mesh whose
    axes are all ``Explicit`` (under ``jit``, Auto axes leave the spec to the
    compiler and Manual ones belong to an enclosing ``shard_map``). Python
    numbers and numpy arrays are replicated. All leaves must share one mesh,
    which must be the context mesh if one is set (inside ``shard_map`` it is
    the Manual one), and no spec may carry ``reduced``/``unreduced`` axes;
    otherwise ``None`` (the plain path). jax itself only makes even splits.
    """
    mesh, specs = None, []
    for v in values:
        if isinstance(v, (Number, np.ndarray, np.generic)):
            specs.append(PartitionSpec())
            continue
        if isinstance(v, jax.core.Tracer):
            sharding = jax.typeof(v).sharding
            if not sharding.mesh.axis_names or any(t != AxisType.Explicit for t in sharding.mesh.axis_types):
                return None
        else:
            sharding = getattr(v, "sharding", None)
            if not isinstance(sharding, NamedSharding):
                return None
        if sharding.spec.reduced or sharding.spec.unreduced:
            return None
        if mesh is None:
            mesh = sharding.mesh
        elif sharding.mesh != mesh:
            return None
        specs.append(sharding.spec)
    if mesh is None or not any(_spec_axes(spec) for spec in specs):
        return None  # nothing is split: the plain path already reads each device's data once
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context != getattr(mesh, "abstract_mesh", mesh):
        return None
    return mesh, tuple(specs)


def _sharded_norms_body(values, *, mesh, specs, stacks, **options):
    """``_norms_body`` on each device's blocks, psum-ed once per distinct set of mesh axes.

    Left to itself, the compiler emits one all-reduce per split leaf (optax's
    global norm does too); here the local sums of squares are stacked and
    reduced together, as inside ``shard_map`` on boxes. A stacked leaf whose
    layer axis is split holds some of the layers on each device (see ``_place_layers``).
    """
    axes = tuple(_spec_axes(spec) for spec in specs)
    stacks = tuple(s if s is None else (s[0], s[1], _entry_axes(spec, s[0])) for s, spec in zip(stacks, specs))
    body = functools.partial(_norms_body, axes=axes, stacks=stacks, **options)
    return jax.shard_map(body, mesh=mesh, in_specs=(list(specs),), out_specs=PartitionSpec())(values)


def _vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` marked varying over the manual mesh axes ``like`` varies over (inside ``shard_map``); as is elsewhere."""
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varying(x: jax.Array) -> frozenset[str]:
    # jax 0.10 spells it `manual_axis_type.varying`, other versions `vma`.
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _group_totals(
    parts: list[jax.Array], whole: list[jax.Array], groups: tuple[_Group, ...], combine: Any = operator.add
) -> list[jax.Array]:
    """Each group's total (``combine``: add for squares and counts, ``jnp.maximum`` for maxima).

    ``parts[i]`` is leaf i's value (a scalar, or one per layer of a stacked
    leaf), ``whole[i]`` its total. Norms are the sqrt of a group's summed
    squares, never a sum of norms. Groups of one layer across the same stacked
    leaves (``decoder/layers/0`` ... ``decoder/layers/23``) share one combined
    per-layer vector.
    """
    combined: dict[tuple[int, ...], jax.Array] = {}
    out = []
    for group in groups:
        if len(group) == 1 and group[0][1] == _EVERY_LAYER:
            out.append(parts[group[0][0]])
            continue
        terms = [whole[i] for i, layer in group if layer is None]
        layered = [(i, layer) for i, layer in group if layer is not None]
        leaves = tuple(sorted({i for i, _ in layered}))
        if len({layer for _, layer in layered}) == 1 and len({parts[i].shape for i in leaves}) == 1:
            if leaves not in combined:
                combined[leaves] = functools.reduce(combine, [parts[i] for i in leaves])
            terms.append(combined[leaves][layered[0][1]])
        else:
            terms += [parts[i][layer] for i, layer in layered]
        out.append(functools.reduce(combine, terms) if terms else jnp.zeros((), parts[0].dtype if parts else _F32))
    return out


def _norms_body(values, *, axes, stacks, groups, count_nonfinite, group_counts=False, abs_max=False) -> _Reduced:
    """Per-leaf (per-layer) sums of squares, psum-ed per axis set; the global and group norms; the non-finite
    counts and largest ``|x|`` where asked."""
    sq = _batched_psum([_layer_sq(v, s) for v, s in zip(values, stacks)], axes)
    # A stacked leaf's L partial sums add up to its whole sum: the global norm needs no second read.
    whole = [jnp.sum(s) if s.ndim else s for s in sq]
    total = _tree_total(whole)
    out = _Reduced(jnp.sqrt(total), [jnp.sqrt(t) for t in _group_totals(sq, whole, groups)])
    if abs_max:
        # A sibling of the sum of squares (same leaf, same axes): XLA:GPU/TPU fuse the two into one read.
        peaks = _batched_psum([_layer_abs_max(v, s) for v, s in zip(values, stacks)], axes, jax.lax.pmax)
        peak = [jnp.max(m) if m.ndim else m for m in peaks]
        out = out._replace(abs_max=functools.reduce(jnp.maximum, peak, jnp.zeros((), _F32)),
                           group_abs_max=_group_totals(peaks, peak, groups, jnp.maximum))
    if not count_nonfinite:
        return out

    def count(*_: Any) -> tuple[jax.Array, list[jax.Array]]:
        parts = _batched_psum([_layer_count(v, s) for v, s in zip(values, stacks)], axes)
        leaf = [jnp.sum(c) if c.ndim else c for c in parts]
        out = _tree_total(leaf, dtype=jnp.int32), (_group_totals(parts, leaf, groups) if group_counts else [])
        # Inside shard_map a group's count varies over (at most) the mesh axes the total does; the
        # branches below must agree on that.
        return jax.tree.map(lambda c: _vary_like(c, total), out)

    def lazy(total: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        # A finite total means every element is finite (a NaN or Inf anywhere
        # makes its square, and the sum, non-finite), so the count is 0 and the
        # arrays need not be read a second time. A finite array whose squares
        # overflow float32 takes the counting branch too and counts 0, correctly.
        # ``total * 0`` rather than a constant: inside shard_map it carries the
        # same varying-axes type as the count, which cond requires of its branches.
        zero = (total * 0).astype(jnp.int32)

        def none() -> tuple[jax.Array, list[jax.Array]]:
            shapes = [(stacks[g[0][0]][1],) if g[0][1] == _EVERY_LAYER else () for g in groups] if group_counts else []
            return zero, [jnp.broadcast_to(zero, shape) for shape in shapes]

        return jax.lax.cond(jnp.isfinite(total), none, count)

    # Which program is cheaper depends on the compiler, so it is chosen when
    # lowering. XLA:GPU/TPU can fuse the count's reduction with the sum of
    # squares of the same leaf (sibling multi-output fusion: one read), and
    # a conditional there would stall the step (XLA:GPU copies the predicate to
    # the host and waits). XLA:CPU fuses neither: an unconditional count would
    # read every gradient again, while a conditional is an in-process branch.
    nonfinite, by_group = jax.lax.platform_dependent(total, cpu=lazy, default=count)
    return out._replace(nonfinite=nonfinite, group_nonfinite=by_group if group_counts else None)


# Eager calls: the whole tree in one compiled program (psum axes, mesh and specs are static).
_OPTIONS = ("stacks", "groups", "count_nonfinite", "group_counts", "abs_max")
_norms_kernel = jax.jit(_norms_body, static_argnames=("axes", *_OPTIONS))
_sharded_norms_kernel = jax.jit(_sharded_norms_body, static_argnames=("mesh", "specs", *_OPTIONS))


def _tree_total(leaves: Any, dtype: Any = _F32) -> jax.Array:
    return jax.tree.reduce(operator.add, leaves, initializer=jnp.zeros((), dtype))


def _find_stacks(pairs: list[tuple[PathStr, Any]], stacked: Stacked) -> list[Stack | None]:
    # Inside shard_map a box is its local shard: layer counts come from global shapes, and a
    # box whose layout cannot be known is reported first (as the norms would report it).
    if stacked is not False:
        _check_layouts(pairs)
    return find_stacks(pairs, stacked, shape_of=_global_shape, warn_unmarked=True)


def get_sharded_global_norm(tree: PyTree, *, stacked: Stacked = False) -> tuple[jax.Array, PyTree]:
    """Global L2 norm of a tree and the norm of each leaf, in float32.

    Correct under ``jit``/GSPMD on global arrays and inside ``shard_map`` on
    boxed local shards (each box psum-ed over its own mesh axes, with one
    collective per distinct axis set). The global norm is the square root of
    the summed per-leaf squares, so every array is read once.

    Args:
      tree: any pytree of arrays or boxes; boxes are leaves.
      stacked: which leaves are stacked layers, whose norm is then one per
        layer (see ``norm_metrics``): False (default) none; None or True from
        ``layers`` axis names in their boxes; ``{pattern: axis}``.

    Returns:
      ``(global_norm, per_leaf_norms)``: a float32 scalar (0.0 for an empty
      tree) and a tree of the same structure holding one float32 scalar per
      leaf (boxes replaced by the scalar); a stacked leaf holds a float32
      vector of its L per-layer norms.

    Raises:
      TypeError: a leaf is not an array or a number.
      ValueError: inside ``shard_map``, a box whose layout cannot be known
        (see the module doc); a ``stacked`` pattern that matches no leaf.

    >>> import jax.numpy as jnp
    >>> g, leaves = get_sharded_global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])})
    >>> float(g), float(leaves["a"])
    (5.0, 3.0)
    >>> float(get_sharded_global_norm({"z": jnp.array([3 + 4j])})[0])  # |3 + 4i|
    5.0
    >>> g, leaves = get_sharded_global_norm({"w": jnp.array([[3.0, 4.0], [0.0, 12.0]])}, stacked={"w": 0})
    >>> float(g), leaves["w"].tolist()  # two layers: |(3, 4)| and |(0, 12)|
    (13.0, [5.0, 12.0])
    """
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    named = [(path_str(p), x) for p, x in pairs]
    stacks = _find_stacks(named, stacked)
    groups = tuple(((i, None if s is None else _EVERY_LAYER),) for i, s in enumerate(stacks))
    reduced = _norms(named, groups=groups, stacks=stacks)
    return reduced.norm, jax.tree_util.tree_unflatten(treedef, reduced.groups)


# --------------------------------------------------------------------------- #
# Norm dictionaries
# --------------------------------------------------------------------------- #


def _module_groups(
    pairs: list[tuple[PathStr, Any]], stacks: list[Stack | None], *, depth: int | None
) -> tuple[dict[str, list[tuple[int, int | None]]], list[Stack | None]]:
    """``({module or leaf name: [(leaf index, layer or None)]}, the stacks read per layer)`` in tree order.

    A stacked leaf whose layer index falls within ``depth`` (see ``norm_metrics``)
    adds to one name per layer; it is then read per layer, in the same pass.
    """
    names: dict[str, list[tuple[int, int | None]]] = {}
    split: list[Stack | None] = [None] * len(pairs)
    for i, (path, _) in enumerate(pairs):
        # A bare array (empty path) has no per-parameter entry: it is the global norm.
        if not path:
            continue
        parts = tuple(path.split(SEP))
        stack = stacks[i]
        if split_within(stack, depth):  # depth counts the layer index as a path part
            split[i] = stack
            for layer in range(stack.length):
                names.setdefault(SEP.join(layer_parts(parts, stack, layer)[:depth]), []).append((i, layer))
        else:
            names.setdefault(SEP.join(parts[:depth]), []).append((i, None))
    return names, split


def _norm_entries(
    pairs: list[tuple[PathStr, Any]],
    kind: str,
    *,
    per_param: bool,
    depth: int | None,
    stacked: Stacked = None,
    stacks: list[Stack | None] | None = None,
    count_key: str | None = None,
    max_key: str | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """``({kind: norm, count_key: n, max_key: m}, {"<kind>/<name>": ..., "<count_key>/<name>": ...})``, in tree order.

    ``count_key``: count the NaN/Inf elements too; ``max_key``: the largest
    ``|x|`` too. ``stacks``: the leaves' stacks where the caller knows them
    (else found from ``stacked``). Entries per name only with ``per_param`` or ``depth``.
    """
    names: dict[str, list[tuple[int, int | None]]] = {}
    split: list[Stack | None] = [None] * len(pairs)
    if per_param or depth is not None:
        if stacks is None:
            stacks = _find_stacks(pairs, stacked)
        names, split = _module_groups(pairs, stacks, depth=depth)
    per_name = bool(names)
    reduced = _norms(pairs, groups=tuple(tuple(m) for m in names.values()), count_nonfinite=count_key is not None,
                     group_counts=per_name, abs_max=max_key is not None, stacks=split)
    totals: dict[str, jax.Array] = {kind: reduced.norm}
    per: dict[str, jax.Array] = {f"{kind}/{name}": g for name, g in zip(names, reduced.groups)}
    if count_key is not None:
        totals[count_key] = reduced.nonfinite
        per.update({f"{count_key}/{name}": c for name, c in zip(names, reduced.group_nonfinite or [])})
    if max_key is not None:
        totals[max_key] = reduced.abs_max
        per.update({f"{max_key}/{name}": m for name, m in zip(names, reduced.group_abs_max)})
    return totals, per


# --------------------------------------------------------------------------- #
# Optimizer moments, matched to their params by path
# --------------------------------------------------------------------------- #

_FIRST_MOMENTS = ("mu", "trace")  # Adam/AdamW/AMSGrad/Belief/Novograd/Lion (``mu``); SGD momentum (``trace``)
_SECOND_MOMENTS = ("nu",)  # Adam-family, RMSProp (``scale_by_rms``)
_FACTORED = ("v_row", "v_col", "v")  # Adafactor's ``FactoredState``


def _fields(x: Any) -> tuple[str, ...]:
    fields = getattr(type(x), "_fields", None)  # optax states are NamedTuples
    return tuple(fields) if isinstance(x, tuple) and fields is not None else ()


def _is_moment_state(x: Any) -> bool:
    fields = set(_fields(x))
    return bool(fields & {*_FIRST_MOMENTS, *_SECOND_MOMENTS}) or set(_FACTORED) <= fields


def _moment_pairs(opt_state: PyTree, shapes: dict[PathStr, tuple[int, ...]]) -> dict[str, list[tuple[PathStr, Any]]]:
    """``{"mu_norm": [(param path, moment leaf)], "nu_norm": [...]}`` of every optax state in ``opt_state``.

    A state is found by its fields wherever it sits (``chain``, ``multi_transform``,
    ``masked``, ``inject_hyperparams``: ``optax.MaskedNode`` holds no leaf); the
    path of a moment leaf below its field is its param's path. ``shapes``:
    param path -> (global) shape, which Adafactor's factored moments need.
    """
    out: dict[str, list[tuple[PathStr, Any]]] = {"mu_norm": [], "nu_norm": []}
    nodes = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=lambda x: is_leaf(x) or _is_moment_state(x))[0]
    for where, node in nodes:
        if not _is_moment_state(node):
            continue
        for field in _fields(node):
            if field in _FIRST_MOMENTS:
                out["mu_norm"] += leaves_with_paths(getattr(node, field))
            elif field in _SECOND_MOMENTS:
                out["nu_norm"] += leaves_with_paths(getattr(node, field))
        if set(_FACTORED) <= set(_fields(node)):
            out["nu_norm"] += _factored_second_moment(node, shapes, path_str(where))
    return out


def _factored_dims(shape: tuple[int, ...], rows: tuple[int, ...], cols: tuple[int, ...]) -> tuple[int, int] | None:
    """``(d1, d0)`` as optax's Adafactor factors a param of ``shape`` (its two largest axes), or None if unfactored."""
    if len(shape) < 2:
        return None
    d1, d0 = (int(d) for d in np.argsort(shape)[-2:])
    without = lambda axis: shape[:axis] + shape[axis + 1 :]  # noqa: E731
    return (d1, d0) if rows == without(d0) and cols == without(d1) else None


def _factored_second_moment(state: Any, shapes: dict[PathStr, tuple[int, ...]], where: str) -> list[tuple[PathStr, Any]]:
    """Adafactor's second-moment estimate per param: ``v``, or rebuilt from its factors as optax uses them.

    A factored param (its two largest axes ``d1``, ``d0``) keeps a row factor
    ``r`` (the mean of ``g^2`` over ``d0``) and a column factor ``c`` (over
    ``d1``); optax divides the update by the square root of
    ``V = r / mean_d1(r) [at d0] * c [at d1]``, so that estimate, of the
    param's shape, is what ``nu_norm`` measures: a broadcast product that XLA
    reduces without writing it (it reads only the factors).
    """
    rows, cols = dict(leaves_with_paths(state.v_row)), dict(leaves_with_paths(state.v_col))
    out = []
    for path, v in leaves_with_paths(state.v):
        shape = shapes.get(path)
        if shape is None:
            raise ValueError(
                f"Adafactor state `{where}` holds a second moment for `{path}`, but no `params=`, `updates=` or "
                "`grads=` tree has that path to give its shape; pass the params beside `opt_state=`."
            )
        r, c = unbox(rows[path]), unbox(cols[path])
        dims = _factored_dims(shape, tuple(np.shape(r)), tuple(np.shape(c)))
        if dims is None:
            if tuple(np.shape(unbox(v))) != shape:
                raise ValueError(
                    f"Adafactor state `{where}`: the second moment of `{path}` has shape {np.shape(unbox(v))}, rows "
                    f"{np.shape(r)} and columns {np.shape(c)}, which fit no factoring of its param's shape {shape}; "
                    "pass the params the optimizer state was made for."
                )
            out.append((path, v))
            continue
        if jax.sharding.get_abstract_mesh().manual_axes:
            raise ValueError(
                f"Adafactor state `{where}`: the factored second moment of `{path}` cannot be rebuilt from local "
                "shards inside shard_map; take `nu_norm` outside shard_map (under jit)."
            )
        d1, d0 = dims
        r, c = jnp.asarray(r, _F32), jnp.asarray(c, _F32)
        reduced_d1 = d1 - 1 if d1 > d0 else d1
        mean = jnp.mean(r, axis=reduced_d1, keepdims=True)
        rows_scaled = jnp.where(mean == 0, 0.0, r / jnp.where(mean == 0, 1.0, mean))  # a fresh state: 0, not 0/0
        out.append((path, jnp.expand_dims(rows_scaled, d0) * jnp.expand_dims(c, d1)))
    return out


def get_grad_norms(
    grads: PyTree, return_per_param: bool = False, *, depth: int | None = None, stacked: Stacked = None
) -> dict[str, jax.Array]:
    """``{"grad_norm": g}`` plus ``{"grad_norm/<path>": ...}`` per parameter.

    Args:
      grads: gradient tree (arrays or boxes; sharded or not, see module doc).
      return_per_param: add one entry per leaf.
      depth: add one entry per module instead: leaves grouped by the first
        ``depth`` parts of their path, norm = sqrt of the group's summed squares.
      stacked: stacked (scanned) leaves, split per layer: as ``norm_metrics``.

    Returns:
      A dict of float32 scalars.

    >>> import jax.numpy as jnp
    >>> {k: float(v) for k, v in get_grad_norms({"w": jnp.array([3.0, 4.0])}, True).items()}
    {'grad_norm': 5.0, 'grad_norm/w': 5.0}
    """
    totals, per = _norm_entries(
        leaves_with_paths(grads), "grad_norm", per_param=return_per_param, depth=depth, stacked=stacked
    )
    return {**totals, **per}


def get_param_norms(
    params: PyTree, return_per_param: bool = False, *, depth: int | None = None, stacked: Stacked = None
) -> dict[str, jax.Array]:
    """``{"param_norm": p}`` plus ``{"param_norm/<path>": ...}`` per parameter.

    Same arguments as ``get_grad_norms``.

    >>> import jax.numpy as jnp
    >>> {k: float(v) for k, v in get_param_norms({"w": jnp.array([6.0, 8.0])}).items()}
    {'param_norm': 10.0}
    """
    totals, per = _norm_entries(
        leaves_with_paths(params), "param_norm", per_param=return_per_param, depth=depth, stacked=stacked
    )
    return {**totals, **per}


def norm_metrics(
    *,
    grads: PyTree = None,
    params: PyTree = None,
    updates: PyTree = None,
    opt_state: PyTree = None,
    per_param: bool = False,
    depth: int | None = None,
    stacked: Stacked = None,
    abs_max: bool = False,
) -> dict[str, jax.Array]:
    """The norm dictionary a trainer logs, in one fused, jit-safe pass: per-layer training health.

    Each array is read once: per-leaf sums of squares are computed once and
    the global and per-module norms are derived from them. Non-finite
    gradients propagate into the norms (NaN/Inf are never hidden) and are
    counted without a second read (see the module doc: on GPU/TPU in the
    same pass as the squares, with no branch; on CPU only on a non-finite step).
    Works under ``jit`` on global arrays (Explicit and Auto mesh axes) and
    inside ``shard_map`` on boxes.

    Stacked (scanned) leaves, which hold L layers on one axis, get one entry
    per layer: the layer index goes into the path where the layer axis is in
    the module path (``decoder/layers/attn/q`` of shape (L, ...) gives
    ``grad_norm/decoder/layers/3/attn/q`` with ``per_param``, and
    ``grad_norm/decoder/layers/3`` with ``depth=3``). ``depth`` counts the
    parts of that path, the layer index being one, as ``inspect --unstack
    --depth`` does (``depth=2`` gives ``grad_norm/decoder/layers``, all layers
    together; ``treetools.pytree.stacked.split_within``). Such a leaf is reduced over
    every axis but the layer axis, in the same read; the global norm is the
    sum of those per-layer squares.

    Optimizer moments (``opt_state=``): every optax state with moment fields,
    wherever it sits in the state (``chain``, ``multi_transform``, ``masked``,
    ``inject_hyperparams``), is matched to its params by the path below the
    field, so ``mu_norm/<module>`` groups exactly as ``grad_norm/<module>``.
    First moments (``mu_norm``): ``mu`` of Adam/AdamW/AMSGrad/Lion (Lion's one
    moment)/Belief/Novograd, and ``trace`` of SGD momentum. Second moments
    (``nu_norm``): ``nu`` of the Adam family and RMSProp; for Adafactor, the
    second-moment estimate optax divides by: ``v`` of an unfactored param,
    and for a factored one the product of its row and column factors (see
    ``_factored_second_moment``; the factors themselves are not a moment of
    the param's shape). A param without a moment (frozen by
    ``multi_transform``) has no ``mu_norm/<module>`` entry; two states holding
    a moment of the same param add up (the norm of both together).

    Args:
      grads: gradient tree; gives ``grad_norm`` and ``nonfinite_grads``
        (the number of NaN/Inf gradient elements, int32).
      params: parameter tree; gives ``param_norm``.
      updates: optimizer updates; gives ``update_norm``, and with ``params``
        also ``update_ratio = update_norm / param_norm``.
      opt_state: an optax state; gives ``mu_norm`` and ``nu_norm`` where it
        holds such moments. Adafactor's factored moments need the params'
        shapes: pass ``params`` (or ``updates``/``grads``) too.
      per_param: add ``<kind>/<path>`` for every leaf (none for a tree that is
        one bare array: its path is empty and its norm is ``<kind>``).
      depth: add ``<kind>/<prefix>`` per module instead (leaves grouped by the
        first ``depth`` path parts; sqrt of summed squares). Overrides
        ``per_param``.
      stacked: which leaves are stacked layers (only used with ``per_param``
        or ``depth``). None (default) or True: those whose box names a
        ``layers`` axis (flax ``nn.scan`` with ``metadata_params={nn.PARTITION_NAME:
        "layers"}``, MaxText's ``layers`` logical axis, nnx Variables whose
        sharding names hold ``layers``), with the unboxed leaves of the same
        scanned module; ``{pattern: axis}``: the leaves whose path matches a
        pattern (``re.search``), stacked on ``axis``, the index placed right
        after the path part where the match ends (``{"layers": 0}`` for an
        nnx model built with ``nnx.vmap``); False: none. The rules in full:
        ``treetools.pytree.stacked``. Moments follow their params' stacks.
      abs_max: also ``grad_abs_max``, the largest ``|g|`` (float32; +inf
        where a gradient is NaN or Inf: a cross-device max drops NaN), global
        and per module: one more reduction of each gradient, a sibling of its
        sum of squares (fused with it on GPU/TPU, a second read on CPU).

    Returns:
      ``{"grad_norm", "nonfinite_grads", "grad_abs_max", "param_norm",
      "update_norm", "update_ratio", "mu_norm", "nu_norm"}`` for the inputs
      given, then with ``per_param``/``depth`` the same kinds per leaf or
      module: ``<kind>/<name>`` (``update_ratio/<name>`` where both the
      params and the updates have that name; ``nonfinite_grads/<name>`` the
      count there). float32 scalars, counts int32. An ``update_ratio`` is a
      plain division: inf or NaN when the param norm is 0.

    Raises:
      ValueError: no tree was given, ``depth`` is not positive, inside
        ``shard_map`` a box's layout cannot be known (see the module doc), a
        ``stacked`` pattern matches no leaf (``PatternError``, naming it and
        nearby paths) or a leaf without that axis; an Adafactor state whose
        params' shapes are not given, or inside ``shard_map``.

    >>> import jax, jax.numpy as jnp
    >>> m = jax.jit(norm_metrics)(grads={"w": jnp.array([3.0, 4.0])}, params={"w": jnp.array([0.0, 10.0])})
    >>> sorted(m), float(m["grad_norm"]), int(m["nonfinite_grads"])
    (['grad_norm', 'nonfinite_grads', 'param_norm'], 5.0, 0)
    >>> g = {"layers": {"q": jnp.array([[3.0, 4.0], [6.0, 8.0]])}}  # 2 layers of a stacked `q`
    >>> m = norm_metrics(grads=g, depth=2, stacked={"layers": 0})  # depth 2: `layers/<i>`
    >>> {k: float(v) for k, v in m.items() if k.startswith("grad_norm/")}
    {'grad_norm/layers/0': 5.0, 'grad_norm/layers/1': 10.0}
    >>> import optax
    >>> p = {"a": jnp.ones(4), "b": jnp.ones(9)}
    >>> u, state = optax.adam(0.1).update(p, optax.adam(0.1).init(p), p)
    >>> m = norm_metrics(params=p, updates=u, opt_state=state, depth=1)
    >>> round(float(m["mu_norm/b"]), 4), round(float(m["update_ratio/a"]), 4)   # (1 - b1) * |9 ones|; lr / 1
    (0.3, 0.1)
    """
    if grads is None and params is None and updates is None and opt_state is None:
        raise ValueError("`norm_metrics` needs at least one of `grads=`, `params=`, `updates=`, `opt_state=`.")
    if depth is not None and depth < 1:
        raise ValueError(f"`depth` must be a positive integer, got {depth}.")
    trees = {kind: leaves_with_paths(tree) for kind, tree in
             (("grad_norm", grads), ("param_norm", params), ("update_norm", updates)) if tree is not None}
    grouped = per_param or depth is not None
    # The params' tree (or the updates', the grads') says where moments go: their shapes and their stacks.
    reference = next((trees[k] for k in ("param_norm", "update_norm", "grad_norm") if k in trees), None)
    if opt_state is not None:
        shapes = {path: shape for path, x in reference or [] if (shape := _global_shape(x)) is not None}
        trees.update({kind: pairs for kind, pairs in _moment_pairs(opt_state, shapes).items() if pairs})
    ref_stacks = None
    if grouped and reference is not None and any(k in trees for k in ("mu_norm", "nu_norm")):
        ref_stacks = dict(zip((p for p, _ in reference), _find_stacks(reference, stacked)))
    out: dict[str, jax.Array] = {}
    per: dict[str, jax.Array] = {}
    for kind in ("grad_norm", "param_norm", "update_norm", "mu_norm", "nu_norm"):
        if kind not in trees:
            continue
        pairs = trees[kind]
        stacks = None
        if kind in ("mu_norm", "nu_norm") and ref_stacks is not None:
            stacks = [ref_stacks.get(path) for path, _ in pairs]
        grad = kind == "grad_norm"
        totals, entries = _norm_entries(
            pairs, kind, per_param=per_param, depth=depth, stacked=stacked, stacks=stacks,
            count_key="nonfinite_grads" if grad else None, max_key="grad_abs_max" if grad and abs_max else None,
        )
        out.update(totals)
        per.update(entries)
        if kind == "update_norm" and "param_norm" in out:
            out["update_ratio"] = out["update_norm"] / out["param_norm"]
            prefix = len("update_norm/")
            per.update({f"update_ratio/{k[prefix:]}": v / per[f"param_norm/{k[prefix:]}"]
                        for k, v in entries.items() if f"param_norm/{k[prefix:]}" in per})
    out.update(per)
    return out


# --------------------------------------------------------------------------- #
# Clipping
# --------------------------------------------------------------------------- #


def clip_by_global_norm(max_norm: float):
    """``optax.clip_by_global_norm`` computed with ``get_sharded_global_norm``.

    Drop-in for optax's transform that is also right inside ``shard_map`` on
    boxed local shards (optax's own norm would sum only the local shard there)
    and that accumulates the norm in float32 (complex leaves: ``|z|^2``, and
    both parts are scaled). If the global norm ``g`` exceeds
    ``max_norm`` every update is scaled by ``max_norm / g`` (in float32, cast
    back to each leaf's dtype), so the clipped tree's norm is ``max_norm`` to
    float32 rounding; otherwise updates pass through unchanged. Boxes are
    kept. A NaN/Inf norm propagates into the updates.

    Args:
      max_norm: the largest global norm an update may have.

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    >>> import optax, jax.numpy as jnp
    >>> tx = clip_by_global_norm(1.0)
    >>> u, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
    >>> [round(float(v), 6) for v in u["w"]]
    [0.6, 0.8]
    """
    import optax  # optional at import time: only the clip needs it

    def update_fn(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        del params
        g, _ = get_sharded_global_norm(updates)
        scale = jnp.where(g < max_norm, jnp.ones((), _F32), jnp.asarray(max_norm, _F32) / g)
        # tree.map without is_leaf descends into boxes and keeps their names.
        return jax.tree.map(lambda t: (t * scale).astype(jnp.result_type(t)), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
