"""Sums of squares of many leaves in one pass, sharded: the engine under every norm of ``treetools.pytree.norms``.

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
"""

from __future__ import annotations

import functools
from numbers import Number
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from treetools.shared.aliases import PathStr
from treetools.pytree.counting import is_array_like
from treetools.pytree.partitioning import is_partitioned, leaf_sharding, mesh_axes_of, unbox, unmapped_logical_names
from treetools.pytree.stacked import Stack, Stacked, find_stacks


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
            "trace the shard_map'd function inside `with nn.logical_axis_rules(rules):` (or build the box with "
            "`rules=`)"
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
EVERY_LAYER = "every"  # a group member asking for the leaf's per-layer norms as one vector


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
# of a stacked leaf, EVERY_LAYER (alone in its group) the leaf's per-layer norms as a vector.
_Group = tuple[tuple[int, Any], ...]


class _Reduced(NamedTuple):
    """What ``reduce_norms`` computed: the global norm and each group's; the non-finite counts and largest ``|x|``
    (global and per group) where asked, else None."""

    norm: jax.Array
    groups: list[jax.Array]
    nonfinite: jax.Array | None = None
    group_nonfinite: list[jax.Array] | None = None
    abs_max: jax.Array | None = None
    group_abs_max: list[jax.Array] | None = None


def reduce_norms(
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
    options: dict[str, Any] = {"groups": groups, "count_nonfinite": count_nonfinite, "stacks": leaf_stacks,
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


def global_shape(x: Any) -> tuple[int, ...] | None:
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
    def body(values: Any) -> _Reduced:
        return _norms_body(values, axes=axes, stacks=stacks, **options)

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
    parts: list[jax.Array], whole: list[jax.Array], groups: tuple[_Group, ...], combine: str = "add"
) -> list[jax.Array]:
    """Each group's total (``combine``: "add" for squares and counts, "max" for maxima; see ``_fold``).

    ``parts[i]`` is leaf i's value (a scalar, or one per layer of a stacked
    leaf), ``whole[i]`` its total. Norms are the sqrt of a group's summed
    squares, never a sum of norms. Groups of one layer across the same stacked
    leaves (``decoder/layers/0`` ... ``decoder/layers/23``) share one combined
    per-layer vector.
    """
    combined: dict[tuple[int, ...], jax.Array] = {}
    out = []
    for group in groups:
        if len(group) == 1 and group[0][1] == EVERY_LAYER:
            out.append(parts[group[0][0]])
            continue
        terms = [whole[i] for i, layer in group if layer is None]
        layered = [(i, layer) for i, layer in group if layer is not None]
        leaves = tuple(sorted({i for i, _ in layered}))
        if len({layer for _, layer in layered}) == 1 and len({parts[i].shape for i in leaves}) == 1:
            if leaves not in combined:
                combined[leaves] = _fold([parts[i] for i in leaves], combine)
            terms.append(combined[leaves][layered[0][1]])
        else:
            terms += [parts[i][layer] for i, layer in layered]
        out.append(_fold(terms, combine) if terms else jnp.zeros((), parts[0].dtype if parts else _F32))
    return out


# Up to this many values are combined by a chain of adds (maxima); more, on CPU, by halving a stack of them.
_CHAIN = 8
_COMBINE = {"add": jax.lax.add, "max": jax.lax.max}


def _fold(values: list[jax.Array], combine: str = "add", initial: jax.Array | None = None) -> jax.Array:
    """The sum (``combine="max"``: the largest) of same-shaped values, starting from ``initial`` if given.

    A chain of scalar adds fed by reductions is what XLA:CPU compiles in time
    growing faster than the square of its length: its fusion pass grows one
    fusion along the chain and, at every step, counts the reductions fused so far
    for each reduction feeding it (``CpuInstructionFusion::ShouldFuse``);
    ``optax.tree.norm`` has the same chain (issue 48: 98 CPU s of compile at
    3,000 leaves). A ``reduce`` of the stacked values is no way out: XLA
    rewrites a reduce of a concatenate back into the chain. On CPU, more than
    ``_CHAIN`` values are stacked (a concatenate XLA:CPU does not fuse) and
    the stack halved, ``v[0::2] + v[1::2]``, until one row is left: log2(n)
    vector adds, a pairwise sum. Other backends keep the chain.
    """
    op = _COMBINE[combine]
    if initial is not None:
        values = [initial, *values]
    if len(values) <= _CHAIN:
        return functools.reduce(op, values)

    def chain(*vs: jax.Array) -> jax.Array:
        return functools.reduce(op, vs)

    def halving(*vs: jax.Array) -> jax.Array:
        stacked = jnp.stack(vs)
        identity = jnp.full((1, *stacked.shape[1:]), 0 if combine == "add" else -jnp.inf, stacked.dtype)
        while stacked.shape[0] > 1:
            if stacked.shape[0] % 2:
                stacked = jnp.concatenate([stacked, identity])
            stacked = op(stacked[0::2], stacked[1::2])
        return stacked[0]

    # jax.lax.reduce_window would do as well for XLA, but is not differentiable inside this cond under jit.
    return jax.lax.platform_dependent(*values, cpu=halving, default=chain)


def _norms_body(values: Any, *, axes: Any, stacks: Any, groups: Any, count_nonfinite: bool, group_counts: bool = False,
                abs_max: bool = False) -> _Reduced:
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
        out = out._replace(abs_max=_fold(peak, "max", jnp.zeros((), _F32)),
                           group_abs_max=_group_totals(peaks, peak, groups, "max"))
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
            shapes = [(stacks[g[0][0]][1],) if g[0][1] == EVERY_LAYER else () for g in groups] if group_counts else []
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


def _tree_total(leaves: list[jax.Array], dtype: Any = _F32) -> jax.Array:
    return _fold(leaves, initial=jnp.zeros((), dtype))


def find_leaf_stacks(pairs: list[tuple[PathStr, Any]], stacked: Stacked) -> list[Stack | None]:
    # Inside shard_map a box is its local shard: layer counts come from global shapes, and a
    # box whose layout cannot be known is reported first (as the norms would report it).
    if stacked is not False:
        _check_layouts(pairs)
    return find_stacks(pairs, stacked, shape_of=global_shape, warn_unmarked=True)
