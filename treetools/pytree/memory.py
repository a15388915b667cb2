"""Will it fit? ``memory_plan``: the per-device memory of a train state on any mesh, before anything is allocated.

Every leaf of every part of the state (``params``, ``grads``, ``opt_state``,
``params_ema``...) is laid out on the mesh as a ``NamedSharding`` and counted
by the largest shard one device holds (``treetools.pytree.counting``). Where
a leaf's layout comes from, first that applies:

1. its box names through flax's own rules (``treetools.pytree.partitioning``:
   linen ``Partitioned``, ``LogicallyPartitioned`` with ``rules`` or the
   ``nn.logical_axis_rules`` context, nnx ``Variable``s), or the spec of the
   ``NamedSharding`` its array already carries (a placed array, a struct);
   with ``mesh=`` given, box names first (the layout asked for on that mesh,
   as ``make_abstract(mesh=)``), without it the array's own placement first
   (where it is: an array on one device, from an eager or unsharded init, is
   held whole by the fullest device); a moment carried in its param's box
   with another shape (``jax.tree.map`` keeps boxes) does not take its names;
2. for a leaf of another part (an optimizer moment, an EMA copy), the layout
   of the parameter it mirrors, matched by path: the longest tail of its path
   that is a parameter's path (``0/mu/Dense_0/kernel`` mirrors
   ``Dense_0/kernel``), with the same shape, or that shape less one axis (a
   factored moment: Adafactor's ``v_row``/``v_col``), that axis's entry
   dropped (left replicated where two axes would give that shape);
3. replicated.

A dimension its mesh axes do not divide (GPT-2's vocabulary, 50257, over
``fsdp=8``) is planned unsplit, as jax places it: ``jax.device_put`` and jit's
shardings refuse that layout (``IndivisibleError``), ``with_sharding_constraint``
under jit drops that dimension's entry; ``plan.indivisible`` and the first
lines of the text name each such leaf.

The fullest device's bytes are each leaf's largest shard, summed: exact where
every leaf is laid over every device of the mesh (every placed array of a
mesh), an upper bound otherwise (a leaf on one device counts on each).

Nothing is allocated: the optimizer state comes from
``jax.eval_shape(optimizer.init, params)``, grads are the params' floating
leaves in their own dtype and layout, less those the optimizer never reads (a
param frozen by ``optax.set_to_zero``: ``treetools.pytree.frozen``). The
result is data (``MemoryPlan``), rendered apart (``str(plan)``,
``plan.to_json()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from treetools.pytree.counting import is_array_like, itemsize
from treetools.pytree.partitioning import (
    active_mesh,
    box_spec,
    is_box,
    mesh_axes_of,
    own_sharding,
    rebox,
    resolve_sharding,
    state_parts,
    unbox,
    unmapped_logical_names,
)
from treetools.pytree.paths import is_leaf, path_parts
from treetools.shared.aliases import PyTree
from treetools.pytree.estimates import Estimate, activation_estimate, allocator_estimate, host_estimates
from treetools.pytree.frozen import frozen_grads
from treetools.pytree.plan_text import Indivisible, indivisible_warnings, render_plan, render_summary
from treetools.shared.render import json_object
from treetools.shared.rows import LeafSharding, dtype_name, format_shape, parse_size

SCHEMA = 1
"""The version of ``MemoryPlan.to_json()`` (and ``treetools plan --format json``): docs/json-schema.md."""

TOP = 10
"""Rows (largest leaves per device) a plan keeps by default."""

REPLICATED_THRESHOLD = 2**20
"""A replicated leaf at least this large (bytes) that a mesh axis could split is listed as shardable."""

PART_ORDER = ("params", "grads", "opt_state")


# ---------------------------------------------------------------------------- the plan, as data


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One leaf laid out on the mesh: ``bytes`` is its largest shard (what the fullest device holds of it)."""

    part: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    sharding: LeafSharding
    bytes: int
    global_bytes: int

    @property
    def name(self) -> str:
        """``part/path``: for a checkpoint's item, the path every ``treetools`` command accepts."""
        return f"{self.part}/{self.path}" if self.path else self.part

    def to_json(self) -> dict[str, Any]:
        return {"part": self.part, "path": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "spec": self.sharding.to_json()["spec"], "bytes": self.bytes, "global_bytes": self.global_bytes}


@dataclasses.dataclass(frozen=True)
class Shardable:
    """A replicated leaf one mesh axis could split: dimension ``dim`` over ``axis`` (``size`` devices)."""

    leaf: LeafPlan
    dim: int
    axis: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.leaf.name, "shape": list(self.leaf.shape), "dtype": self.leaf.dtype,
                "bytes": self.leaf.bytes, "dim": self.dim, "axis": self.axis, "axis_size": self.size}


@dataclasses.dataclass(frozen=True)
class Compiled:
    """``jax.jit(step_fn).lower(...).compile().memory_analysis()`` of the step, per device, in bytes.

    ``platform`` and ``devices`` say what it was compiled for; ``cpu`` means XLA:CPU's figures (the fake CPU
    devices of a machine without an accelerator), whose temporaries are not a GPU's or TPU's. A figure jax
    did not give (None, or negative as on some TPU runtimes) is None.
    """

    argument_bytes: int | None
    output_bytes: int | None
    temp_bytes: int | None
    generated_code_bytes: int | None
    alias_bytes: int | None
    platform: str
    devices: int

    @property
    def total_bytes(self) -> int | None:
        """Arguments + outputs - aliased (donated) + temporaries + generated code: the step's peak as XLA plans it."""
        parts = [self.argument_bytes, self.output_bytes, self.temp_bytes, self.generated_code_bytes]
        known = [p for p in parts if p is not None]
        if len(known) < len(parts):
            return None
        return sum(known) - (self.alias_bytes or 0)

    def to_json(self) -> dict[str, Any]:
        return {"argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
                "temp_bytes": self.temp_bytes, "generated_code_bytes": self.generated_code_bytes,
                "alias_bytes": self.alias_bytes, "total_bytes": self.total_bytes, "platform": self.platform,
                "devices": self.devices}


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """Host memory a save or a restore of the state needs on one host.

    ``largest_block``: the largest piece of one array one device holds, what ``restore_checkpoint`` reads and
    places at a time (and what a save writes per shard); ``largest_array``: the largest whole array (what
    ``load_parameters``, which returns whole arrays, holds); ``restore_peak_bytes``: the most
    ``restore_checkpoint`` holds at once, one device block plus the stored chunk being decoded for it (a chunk
    is one device block of the mesh that saved it, Orbax's default, unless the checkpoint says otherwise);
    ``over_budget``: leaves whose stored chunk is larger than ``memory_budget``, which a restore refuses to
    decode until the budget is raised.
    """

    largest_block: LeafPlan | None
    largest_array: LeafPlan | None
    restore_peak_bytes: int
    memory_budget: float | None
    over_budget: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        def leaf(x: LeafPlan | None, key: str) -> dict[str, Any] | None:
            return None if x is None else {"path": x.name, "bytes": getattr(x, key)}

        budget = self.memory_budget
        return {"largest_block": leaf(self.largest_block, "bytes"),
                "largest_array": leaf(self.largest_array, "global_bytes"),
                "restore_peak_bytes": self.restore_peak_bytes,
                "memory_budget": int(budget) if budget is not None and math.isfinite(budget) else None,
                "over_budget": list(self.over_budget)}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What ``memory_plan`` found: data first, ``str(plan)`` and ``plan.to_json()`` render it.

    Attributes:
      mesh: ``{axis: size}`` of the mesh the state is laid out on (``{}``: one device).
      leaves: every array leaf of every part, laid out (``LeafPlan``), parts in ``by_part`` order.
      by_part: bytes the fullest device holds of each part (``params``, ``grads``, ``opt_state``, others).
      per_device_bytes: their sum: the fullest device's memory for the state.
      device_memory: the memory of one device asked about (bytes), or None.
      compiled: the compiled step's own figures (``step_fn=``), or None.
      host: the host memory a save or a restore needs (``HostMemory``).
      shardings: ``{part: tree of NamedSharding}``, the layout planned (on the concrete mesh when one was
        given, else on an ``AbstractMesh``): ``jax.jit(init, out_shardings=plan.shardings["params"])``.
      warnings: what changes the figures against what was asked, printed first (a layout jax cannot place, a
        mesh no leaf is split over).
      estimates: figures not counted but estimated, each with its formula (``treetools.pytree.estimates``):
        the host RAM of a restore, jax's GPU allocator pool and what it leaves (with ``device_memory``), a
        transformer step's activations (with ``activations=``).
      indivisible: each dimension its mesh axes do not divide (``Indivisible``), planned unsplit as jit does.
      notes: what a reader of the figures should know (where the optimizer state came from, the devices the
        step was compiled for).
      top, replicated_threshold: how many rows ``rows`` keeps; the size from which a replicated leaf is listed.
    """

    mesh: dict[str, int]
    leaves: list[LeafPlan]
    by_part: dict[str, int]
    per_device_bytes: int
    device_memory: int | None = None
    compiled: Compiled | None = None
    host: HostMemory | None = None
    shardings: dict[str, PyTree] = dataclasses.field(default_factory=dict, repr=False)
    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    indivisible: list[Indivisible] = dataclasses.field(default_factory=list)
    estimates: list[Estimate] = dataclasses.field(default_factory=list)
    top: int = TOP
    replicated_threshold: int = REPLICATED_THRESHOLD

    @property
    def devices(self) -> int:
        """The number of devices of the mesh."""
        return math.prod(self.mesh.values())

    @property
    def rows(self) -> list[LeafPlan]:
        """The ``top`` largest leaves per device, largest first (ties in tree order)."""
        order = sorted(range(len(self.leaves)), key=lambda i: -self.leaves[i].bytes)
        return [self.leaves[i] for i in order[: self.top]]

    @property
    def global_bytes(self) -> dict[str, int]:
        """Each part's bytes counted once (one copy of every leaf, whatever the mesh)."""
        out = dict.fromkeys(self.by_part, 0)
        for leaf in self.leaves:
            out[leaf.part] += leaf.global_bytes
        return out

    @property
    def fits(self) -> bool | None:
        """Whether ``per_device_bytes`` fits in ``device_memory`` (None when it was not given).

        The state only: activations and the step's temporaries are in ``compiled`` (``step_fn=``), not here.
        """
        return None if self.device_memory is None else self.per_device_bytes <= self.device_memory

    @property
    def headroom_bytes(self) -> int | None:
        """``device_memory - per_device_bytes``: negative is the shortfall (None without ``device_memory``)."""
        return None if self.device_memory is None else self.device_memory - self.per_device_bytes

    @property
    def replicated(self) -> list[Shardable]:
        """Leaves held whole by every device, at least ``replicated_threshold`` bytes, that a mesh axis could
        split evenly (grads left out: they follow their params), largest first."""
        if self.devices <= 1:
            return []
        axes = sorted(((a, s) for a, s in self.mesh.items() if s > 1), key=lambda kv: -kv[1])
        out = []
        for leaf in sorted(self.leaves, key=lambda x: -x.bytes):
            if leaf.part == "grads" or leaf.bytes < self.replicated_threshold or leaf.bytes < leaf.global_bytes:
                continue
            split = next(((d, a, s) for a, s in axes for d, n in enumerate(leaf.shape) if n >= s and n % s == 0),
                         None)
            if split is not None:
                out.append(Shardable(leaf, *split))
        return out

    def to_json(self) -> dict[str, Any]:
        """One object, ``"schema"`` first (docs/json-schema.md); what ``treetools plan --format json`` prints."""
        return json_object(SCHEMA, {
            "mesh": dict(self.mesh),
            "devices": self.devices,
            "per_device_bytes": self.per_device_bytes,
            "by_part": dict(self.by_part),
            "global_bytes": self.global_bytes,
            "device_memory": self.device_memory,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "rows": [leaf.to_json() for leaf in self.rows],
            "replicated": [r.to_json() for r in self.replicated],
            "compiled": self.compiled.to_json() if self.compiled is not None else None,
            "host": self.host.to_json() if self.host is not None else None,
            "warnings": list(self.warnings),
            "indivisible": [x.to_json() for x in self.indivisible],
            "estimates": [x.to_json() for x in self.estimates],
            "notes": list(self.notes),
        })

    def summary(self) -> str:
        """The fullest device's bytes, one line per part, then the total: what the reference trainer prints."""
        return render_summary(self)

    def __str__(self) -> str:
        return render_plan(self)


# ---------------------------------------------------------------------------- the mesh


MAX_DEVICES = 2**24
"""The most devices a mesh planned for may have (16,777,216, beyond any machine): jax's meshes count them in 32
bits, and a recorded mesh of 65536 x 65536 devices ended in a ``std::bad_cast`` traceback."""


def _mesh_of(mesh: Any) -> tuple[dict[str, int], Mesh | AbstractMesh | None]:
    """``({axis: size}, a Mesh or AbstractMesh to lay shardings on)`` from what ``mesh=`` accepts."""
    if mesh is None:
        return {}, None
    if isinstance(mesh, (Mesh, AbstractMesh)):
        return {str(k): int(v) for k, v in mesh.shape.items()}, mesh
    if isinstance(mesh, Mapping):
        bad = {k: v for k, v in mesh.items() if not isinstance(k, str) or isinstance(v, bool)
               or not isinstance(v, (int, np.integer)) or v < 1}
        if bad:
            raise ValueError(f"`mesh` must map axis names to positive sizes ({{'data': 8, 'fsdp': 16}}); got {bad}.")
        sizes = {k: int(v) for k, v in mesh.items()}
        if not sizes:
            return {}, None
        if math.prod(sizes.values()) > MAX_DEVICES:
            raise ValueError(f"`mesh` {sizes} has {math.prod(sizes.values()):,} devices, more than {MAX_DEVICES:,}.")
        return sizes, AbstractMesh(tuple(sizes.values()), tuple(sizes))
    raise TypeError(f"`mesh` must be a jax Mesh, an AbstractMesh or {{axis: size}}, got {type(mesh).__name__}.")


def _found_mesh(parts: Mapping[str, Any]) -> Mesh | AbstractMesh | None:
    """The mesh a state without ``mesh=`` is laid out on: its first placed leaf's, else the ``jax.set_mesh`` one."""
    for tree in parts.values():
        for leaf in jax.tree.leaves(tree, is_leaf=is_leaf):
            own = own_sharding(leaf)
            if isinstance(own, NamedSharding) and not own.mesh.empty:
                return own.mesh
    concrete = active_mesh()
    if concrete is not None:
        return concrete
    try:
        ambient = jax.sharding.get_abstract_mesh()
    except Exception:  # older jax: no ambient mesh API
        return None
    return ambient if ambient is not None and not ambient.empty else None


# ---------------------------------------------------------------------------- laying leaves out


def _padded(spec: Any, ndim: int) -> tuple:
    entries = tuple(spec)
    return entries + (None,) * (ndim - len(entries))


def _own_spec(leaf: Any, *, asked: bool, trust_names: bool = True) -> PartitionSpec | None:
    """The spec a leaf carries itself: box names and its array's ``NamedSharding``, in the order of the module
    docstring (``asked``: a mesh was given); None when it says nothing. ``trust_names=False`` ignores the box
    names (a moment whose shape is not its param's, in the param's box: ``jax.tree.map`` carries boxes blindly)."""
    own = own_sharding(leaf)
    placed = own.spec if isinstance(own, NamedSharding) else None
    if placed is None and own is not None and not asked and (own.is_fully_replicated or len(own.device_set) == 1):
        placed = PartitionSpec()  # on one device (eager init, a jit output that depends on no input): held whole
    names = box_spec(leaf) if trust_names else None
    return (names if names is not None else placed) if asked else (placed if placed is not None else names)


class _Mirrors:
    """The params' layouts by path, for the leaves of other parts that mirror them (optimizer moments)."""

    def __init__(self) -> None:
        self._by_path: dict[tuple[str, ...], tuple[tuple[int, ...], tuple]] = {}
        self.found: set[tuple[str, ...]] = set()  # the params some leaf of another part mirrors

    def add(self, parts: tuple[str, ...], shape: tuple[int, ...], spec: Any) -> None:
        self._by_path[parts] = (shape, _padded(spec, len(shape)))

    def find(self, parts: tuple[str, ...]) -> tuple[tuple[int, ...], tuple] | None:
        """``(shape, spec entries)`` of the param whose path is the longest tail of ``parts``, or None."""
        for k in range(len(parts)):
            hit = self._by_path.get(parts[k:])
            if hit is not None:
                self.found.add(parts[k:])
                return hit
        return None

    def unmirrored(self) -> bool:
        """Whether some param has no leaf of another part mirroring it (no moment: frozen, or a stateless
        optimizer)."""
        return len(self.found) < len(self._by_path)

    def spec_for(self, parts: tuple[str, ...], shape: tuple[int, ...], hit: Any = None) -> PartitionSpec | None:
        """The layout of the param that the leaf at ``parts`` mirrors: the longest tail of its path that is a
        param's, with the param's shape (that spec) or that shape less one axis (that axis's entry dropped).
        ``hit``: ``find(parts)``, where the caller has it."""
        hit = hit if hit is not None else self.find(parts)
        if hit is None:
            return None
        p_shape, p_spec = hit
        if shape == p_shape:
            return PartitionSpec(*p_spec)
        dropped = {p_spec[:a] + p_spec[a + 1:] for a in range(len(p_shape)) if p_shape[:a] + p_shape[a + 1:] == shape}
        if len(dropped) > 1 and len(p_shape) >= 2 and {"v_row", "v_col"} & set(parts):
            # A square kernel's Adafactor factors: optax drops d0 for v_row and d1 for v_col, its two largest axes
            # by np.argsort, and a step's update leaves each factor split like the axis it keeps.
            d1, d0 = (int(d) for d in np.argsort(p_shape)[-2:])
            axis = d0 if "v_row" in parts else d1
            return PartitionSpec(*(p_spec[:axis] + p_spec[axis + 1:]))
        # Two axes of one size give the same shape otherwise: unless both choices say the same, the vector is left
        # replicated rather than guessed.
        return PartitionSpec(*dropped.pop()) if len(dropped) == 1 else None


@dataclasses.dataclass
class _Laid:
    """One part laid out: its leaves' plans, the abstract tree (structs on ``mesh``; None unless asked for), and
    its shardings tree."""

    leaves: list[LeafPlan]
    abstract: PyTree | None
    shardings: PyTree


class _Layout:
    """Lays parts out on one mesh; shardings are made once per spec."""

    def __init__(self, sizes: dict[str, int], mesh: Mesh | AbstractMesh | None, asked: bool, abstract: bool):
        self.sizes, self.mesh, self.asked, self.abstract = sizes, mesh, asked, abstract
        self._shardings: dict[tuple, NamedSharding] = {}
        self.indivisible: list[Indivisible] = []
        self._cache: dict[tuple, tuple] = {}

    def sharding(self, spec: tuple) -> NamedSharding | None:
        if self.mesh is None:
            return None
        found = self._shardings.get(spec)
        if found is None:
            found = self._shardings[spec] = NamedSharding(self.mesh, PartitionSpec(*spec))
        return found

    def _check(self, name: str, shape: tuple[int, ...], spec: Any) -> tuple:
        entries = tuple(spec)
        if len(entries) > len(shape):
            raise ValueError(f"leaf `{name}` {format_shape(shape)} is laid out as {PartitionSpec(*entries)}, which "
                             f"has more entries than the leaf has dimensions; fix its names or sharding.")
        used = [a for e in entries for a in mesh_axes_of(e)]
        missing = [a for a in used if a not in self.sizes]
        if missing:
            have = f"the mesh {self.sizes} does not have" if self.sizes else "no mesh gives (one device)"
            raise ValueError(
                f"leaf `{name}` is laid out as {PartitionSpec(*entries)}, over mesh axes {missing} that {have}; pass "
                "`mesh=` with those axes (a Mesh or {axis: size}), or `rules=` mapping its logical names onto the "
                "mesh's axes.")
        if len(set(used)) != len(used):
            raise ValueError(f"leaf `{name}` is laid out as {PartitionSpec(*entries)}, which uses a mesh axis twice.")
        return _padded(entries, len(shape))

    def _laid(self, part: str, path: str, shape: tuple[int, ...], spec: Any) -> tuple[tuple, int, LeafSharding]:
        """``(spec entries as jax places them, elements the fullest device holds, LeafSharding)`` of a leaf,
        worked out once per (shape, spec); each leaf's indivisible dimensions recorded under its own name."""
        key = (shape, tuple(spec) if spec is not None else ())
        found = self._cache.get(key)
        if found is None:
            before = len(self.indivisible)
            entries = self._divisible(part, path, shape, self._check(f"{part}/{path}", shape, key[1]))
            sharding = self.sharding(entries)
            per_device = math.prod(sharding.shard_shape(shape)) if sharding is not None else math.prod(shape)
            found = self._cache[key] = (entries, per_device, LeafSharding(PartitionSpec(*entries), dict(self.sizes)),
                                        self.indivisible[before:])
        else:
            self.indivisible += [dataclasses.replace(x, part=part, path=path) for x in found[3]]
        return found[:3]

    def _divisible(self, part: str, path: str, shape: tuple[int, ...], entries: tuple) -> tuple:
        """``entries`` as jax places them: a dimension its mesh axes do not divide is left unsplit, as
        ``with_sharding_constraint`` does under ``jit`` (``device_put`` and jit's shardings refuse the layout with
        ``IndivisibleError``); each such dimension recorded in ``indivisible``."""
        out = list(entries)
        for dim, (n, entry) in enumerate(zip(shape, entries)):
            axes = mesh_axes_of(entry)
            size = math.prod(self.sizes[a] for a in axes)
            if axes and n % size:
                out[dim] = None
                self.indivisible.append(Indivisible(part, path, shape, dim, tuple(axes), size,
                                                    PartitionSpec(*entries)))
        return tuple(out)

    def part(self, part: str, tree: PyTree, *, mirrors: _Mirrors | None = None,
             collect: _Mirrors | None = None) -> _Laid:
        """Lay ``tree`` out: leaves without a layout of their own take the one of the param they ``mirrors``;
        ``collect`` gathers this part's layouts by path (the params', for the parts that mirror them)."""
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
        plans: list[Any] = []
        abstract: list[Any] = []
        shardings: list[Any] = []
        for keypath, leaf in pairs:
            boxed = is_box(leaf)
            if not is_array_like(leaf):
                abstract.append(leaf)
                shardings.append(None)
                continue
            parts = path_parts(keypath)
            path = "/".join(parts)
            logical = unmapped_logical_names(leaf) if boxed else ()
            if logical:
                raise ValueError(
                    f"leaf `{part}/{path}` carries the logical names {logical} and no rules map them onto mesh axes; "
                    "pass `rules=` (your model's logical_axis_rules) or call inside `nn.logical_axis_rules(...)`.")
            value = unbox(leaf)
            shape, dtype = tuple(int(d) for d in value.shape), value.dtype
            trust, hit = True, None
            if mirrors is not None:  # a box carried onto a moment of another shape names the param's layout
                hit = mirrors.find(parts)
                names = box_spec(leaf) if boxed else None
                trust = (hit is None or hit[0] == shape) and (names is None or len(tuple(names)) <= len(shape))
            spec = _own_spec(leaf, asked=self.asked, trust_names=trust)
            if spec is None and hit is not None and mirrors is not None:  # a hit comes from mirrors
                spec = mirrors.spec_for(parts, shape, hit)
            entries, per_device, leaf_sharding = self._laid(part, path, shape, spec)
            if collect is not None:
                collect.add(parts, shape, entries)
            sharding = self.sharding(entries)
            size = itemsize(dtype)
            plans.append(LeafPlan(part, path, shape, dtype_name(dtype), leaf_sharding, per_device * size,
                                  math.prod(shape) * size))
            if self.abstract:  # only a compiled step needs the state as boxed structs
                abstract.append(rebox(leaf, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)))
            shardings.append(sharding)
        return _Laid(plans, jax.tree_util.tree_unflatten(treedef, abstract) if self.abstract else None,
                     jax.tree_util.tree_unflatten(treedef, shardings))

    def params(self, tree: PyTree) -> tuple[_Laid, _Mirrors]:
        """The params part, and their layouts by path for the parts that mirror them."""
        mirrors = _Mirrors()
        return self.part("params", tree, collect=mirrors), mirrors


def _is_float(dtype: str) -> bool:
    """Whether a leaf of this dtype (by name) has a gradient: floating and complex ones (bfloat16 too)."""
    try:
        return bool(jax.dtypes.issubdtype(jax.numpy.dtype(dtype), np.inexact))
    except TypeError:  # typed PRNG keys and other extended dtypes have no gradient
        return False


def _grads(params: _Laid) -> _Laid:
    """Grads: the params' floating leaves, in their dtype and layout (an integer leaf's gradient is float0)."""
    leaves = [dataclasses.replace(p, part="grads") for p in params.leaves if _is_float(p.dtype)]
    return _Laid(leaves, params.abstract, params.shardings)


def _unfrozen(grads: _Laid, frozen: set[str] | None) -> tuple[_Laid, str | None]:
    """Grads less those no output of the optimizer's update reads (``treetools.pytree.frozen``)."""
    if not frozen:
        return grads, None
    kept = [leaf for leaf in grads.leaves if leaf.path not in frozen]
    dropped = len(grads.leaves) - len(kept)
    return _Laid(kept, grads.abstract, grads.shardings), (
        f"grads: {dropped} frozen param(s) left out (optimizer.update reads nothing of their gradient, as "
        "optax.set_to_zero: a compiled step drops it)")


def _structs(tree: PyTree) -> PyTree:
    """Every array leaf as a plain ``ShapeDtypeStruct`` (no sharding) inside its box: what ``optimizer.init``
    is traced on, so a mask or label function that expects boxes still finds them."""

    def struct(leaf: Any) -> Any:
        if not is_array_like(leaf):
            return leaf
        value = unbox(leaf)
        return rebox(leaf, jax.ShapeDtypeStruct(tuple(value.shape), value.dtype))

    return jax.tree.map(struct, tree, is_leaf=is_leaf)


@contextlib.contextmanager
def _rules(rules: Any) -> Iterator[None]:
    """Inside ``nn.logical_axis_rules(rules)`` when ``rules`` is given (flax's context, read by linen and nnx)."""
    if rules is None:
        yield
        return
    from flax.core import spmd  # heavy; only when logical rules are given

    with spmd.logical_axis_rules(rules):
        yield


# ---------------------------------------------------------------------------- the compiled step


def _compile_mesh(sizes: dict[str, int], mesh: Any) -> Mesh:
    """A concrete mesh of ``sizes``' shape: the one given, else the first devices of this process that suffice
    (the default backend's, else the CPU's: fake devices from ``--xla_force_host_platform_device_count``)."""
    if isinstance(mesh, Mesh):
        return mesh
    n = math.prod(sizes.values()) if sizes else 1
    for backend in (None, "cpu"):
        try:
            devices = jax.devices(backend)
        except RuntimeError:  # JAX_PLATFORMS leaves the CPU backend out
            continue
        if len(devices) >= n:
            types = getattr(mesh, "axis_types", None) or (jax.sharding.AxisType.Auto,) * len(sizes)
            return jax.make_mesh(tuple(sizes.values()) or (1,), tuple(sizes) or ("devices",), axis_types=types,
                                 devices=devices[:n])
    have = len(jax.devices())
    raise ValueError(
        f"`step_fn`: compiling for the mesh {sizes} needs {n} devices and this process has {have} "
        f"({jax.default_backend()}); start Python with XLA_FLAGS=--xla_force_host_platform_device_count={n} "
        "(fake CPU devices, set before jax starts), or plan the compiled step on a smaller mesh.")


def _on(tree: PyTree, mesh: Mesh) -> PyTree:
    """``tree``'s structs with their shardings on ``mesh`` (an AbstractMesh's spec laid on it)."""

    def move(x: Any) -> Any:
        value = unbox(x)
        if not isinstance(value, jax.ShapeDtypeStruct) or value.sharding is None:
            return x
        sharding = value.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh != mesh:
            sharding = resolve_sharding(sharding, mesh) if isinstance(sharding.mesh, AbstractMesh) else \
                NamedSharding(mesh, sharding.spec)
        return rebox(x, jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))

    return jax.tree.map(move, tree, is_leaf=is_leaf)


def _bytes(stats: Any, name: str) -> int | None:
    value = getattr(stats, name, None)
    return int(value) if value is not None and value >= 0 else None


def _compiled(step_fn: Callable, state: PyTree, step_args: Sequence[Any], sizes: dict[str, int],
              mesh: Any) -> tuple[Compiled, str]:
    concrete = _compile_mesh(sizes, mesh)
    fn = step_fn if hasattr(step_fn, "lower") else jax.jit(step_fn)
    # Lowered as the caller would: the state as given (boxes kept), the shardings in the arguments, and whatever
    # mesh context the caller is in (no other).
    compiled = fn.lower(_on(state, concrete), *_on(tuple(step_args), concrete)).compile()
    stats = compiled.memory_analysis()
    platform = concrete.devices.flat[0].platform
    out = Compiled(_bytes(stats, "argument_size_in_bytes"), _bytes(stats, "output_size_in_bytes"),
                   _bytes(stats, "temp_size_in_bytes"), _bytes(stats, "generated_code_size_in_bytes"),
                   _bytes(stats, "alias_size_in_bytes"), platform, concrete.size)
    note = f"compiled step: jax's memory_analysis() on {concrete.size} {platform} device(s)"
    if platform == "cpu":
        why = ("no accelerator in this process" if jax.default_backend() == "cpu" else
               f"this process has fewer {jax.default_backend()} devices than the mesh")
        note += (f" ({why}: CPU devices stand in); its temporaries are XLA:CPU's, which fuses and rematerialises "
                 "differently from a GPU or TPU compiler: a rough guide there")
    if stats is None or out.total_bytes is None:
        note += "; jax gave no figure for some of it on this backend (None)"
    return out, note


def _with_parts(tree: Any, parts: Mapping[str, Any], laid: Mapping[str, PyTree], added: bool) -> Any:
    """The state ``step_fn`` gets: ``tree`` with each part's abstract (laid-out) tree in place."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, (type, Mapping)):  # an instance: a TrainState
        if added:
            raise ValueError("`optimizer=` with a dataclass state (a TrainState) that `step_fn` takes: the state "
                             "holds its own opt_state; drop `optimizer=`.")
        return dataclasses.replace(tree, **{k: laid[k] for k in parts})
    if isinstance(tree, Mapping) and all(k in tree and tree[k] is v for k, v in parts.items()):
        return {**tree, **laid}  # a dict of parts
    if list(parts) == ["params"]:
        return laid["params"] if not added else dict(laid)
    raise ValueError("`step_fn` with an nnx Module (or an nnx State beyond its Params): pass "
                     "nnx.state(model, nnx.Param) as `tree`, or a dict of parts, and a step_fn over it.")


# ---------------------------------------------------------------------------- host memory


def _host(leaves: Sequence[LeafPlan], chunk_bytes: Mapping[str, int] | None, budget: float | None) -> HostMemory:
    saved = [leaf for leaf in leaves if leaf.part != "grads"]  # grads live in a step, never in a checkpoint
    chunks = {leaf.name: (chunk_bytes or {}).get(leaf.name, leaf.bytes) for leaf in saved}
    over = tuple(name for name, c in chunks.items() if budget is not None and c > budget)
    return HostMemory(
        largest_block=max(saved, key=lambda x: x.bytes, default=None),
        largest_array=max(saved, key=lambda x: x.global_bytes, default=None),
        restore_peak_bytes=max((leaf.bytes + chunks[leaf.name] for leaf in saved), default=0),
        memory_budget=budget, over_budget=over)


def _estimates(plan: MemoryPlan, activations: Mapping[str, Any] | None, parts_global: int) -> list[Estimate]:
    out = []
    act = activation_estimate(activations, batch_shards=plan.devices) if activations is not None else None
    if act is not None:
        out.append(act)
    if plan.device_memory is not None:
        out += allocator_estimate(plan.device_memory, plan.per_device_bytes, act.bytes if act else None)
    if plan.host is not None:
        out += host_estimates(plan.host.restore_peak_bytes, parts_global)
    return out


# ---------------------------------------------------------------------------- memory_plan


def memory_plan(
    tree: Any,
    *,
    mesh: Any = None,
    optimizer: Any = None,
    grads: bool = True,
    step_fn: Callable | None = None,
    step_args: Sequence[Any] = (),
    rules: Any = None,
    device_memory: int | str | None = None,
    memory_budget: float | None = None,
    chunk_bytes: Mapping[str, int] | None = None,
    top: int = TOP,
    replicated_threshold: int = REPLICATED_THRESHOLD,
    activations: Mapping[str, Any] | None = None,
) -> MemoryPlan:
    """The memory each device needs for a train state on a mesh, before anything is allocated.

    Args:
      tree: arrays, ``ShapeDtypeStruct``s or flax boxes (linen ``Partitioned``/``LogicallyPartitioned``, nnx
        Variables): the params; an nnx State (its ``nnx.Param``s are the params, any other variable part
        ``state``); or a dict of parts (a key ``params`` beside ``opt_state``, ``params_ema``...; linen
        ``variables``), a ``TrainState`` (its ``params``, ``opt_state``, ``step``), or an nnx Module (its
        ``nnx.Param``s, and its other variables as part ``state``).
      mesh: a ``jax.sharding.Mesh``, an ``AbstractMesh`` or ``{"data": 64, "fsdp": 16}`` (no devices needed:
        a 1,024-device plan on a laptop). Default: the mesh the leaves are placed on, else ``jax.set_mesh``'s,
        else one device.
      optimizer: an ``optax.GradientTransformation``: part ``opt_state`` is ``jax.eval_shape(optimizer.init,
        params)``, each moment laid out like the param it mirrors (matched by path), scalars replicated.
        ``tree`` must not hold an ``opt_state`` already.
      grads: count a gradient per floating param, in its dtype and layout (part ``grads``).
      step_fn: a function of the state and ``*step_args`` (or one already ``jax.jit``-wrapped, its
        ``donate_argnums`` kept): compiled for a device set of the mesh's shape (this process's devices, fake CPU
        devices where there is no accelerator; ``notes`` says which) and ``memory_analysis()`` reported in
        ``compiled``. The state it gets is ``tree`` laid out as planned, as abstract structs; a derived optimizer
        state is added as key ``opt_state`` (a params tree becomes ``{"params": ..., "opt_state": ...}``).
      step_args: the other arguments of ``step_fn``: ``ShapeDtypeStruct``s (their shardings on an
        ``AbstractMesh`` are laid on the compile mesh), or arrays.
      rules: flax logical axis rules (``(("embed", "fsdp"), ("mlp", "tensor"))``) for boxes whose logical names
        carry none of their own, as ``nn.logical_axis_rules(rules)``; default: the active context's.
      device_memory: one device's memory (bytes, or ``"80GiB"``, ``"40GB"``): sets ``fits`` and
        ``headroom_bytes``.
      memory_budget: the memory budget a ``restore_checkpoint`` of the state reads under (bytes): leaves whose
        stored chunk exceeds it are listed in ``host.over_budget``. None: not checked.
      chunk_bytes: ``{"part/path": bytes of one stored chunk}`` where a checkpoint says (``treetools plan``
        passes its metadata's); a leaf not named is assumed saved by this layout (a chunk is one device block).
      top: rows kept (largest leaves per device).
      replicated_threshold: bytes from which a replicated leaf that a mesh axis could split is listed.
      activations: a transformer's ``{"batch", "seq", "hidden", "layers", "heads"}`` (optional ``itemsize``,
        default 2, ``remat``, ``batch_shards``, default the mesh's devices): adds an estimate of the activations
        a step keeps, by formula (``treetools.pytree.estimates``), to ``estimates`` and the allocator's headroom.

    Returns:
      a ``MemoryPlan``: ``per_device_bytes`` (the fullest device), ``by_part``, ``rows``, ``replicated``,
      ``fits`` and ``headroom_bytes``, ``compiled``, ``host``, ``shardings``; ``print(plan)`` is a table within
      100 columns, ``plan.to_json()`` its JSON.

    Raises:
      ValueError: a leaf names mesh axes the mesh lacks, carries logical names no rules map, or has more spec
        entries than dimensions (the message names the leaf and the fix); ``tree`` holds an ``opt_state`` and
        ``optimizer`` is given; ``step_fn``'s mesh needs more devices than this process has.
      TypeError: ``mesh`` is none of the accepted kinds.

    >>> import flax.linen as nn, jax, jax.numpy as jnp, optax
    >>> params = {"w": nn.Partitioned(jax.ShapeDtypeStruct((4096, 1024), jnp.float32), names=("fsdp", None)),
    ...           "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
    >>> plan = memory_plan(params, mesh={"data": 4, "fsdp": 8}, optimizer=optax.adam(1e-3), device_memory="16GiB")
    >>> plan.by_part   # w split 8 ways (2 MiB) + b (4 KiB); grads alike; Adam's mu and nu alike, + its count
    {'params': 2101248, 'grads': 2101248, 'opt_state': 4202500}
    >>> plan.per_device_bytes, plan.fits, plan.rows[0].name
    (8404996, True, 'params/w')
    """
    if top < 0:
        raise ValueError(f"`top` must be >= 0, got {top}.")
    memory = parse_size(device_memory, what="device_memory") if device_memory is not None else None
    parts = state_parts(tree)
    if optimizer is not None and "opt_state" in parts:
        raise ValueError("`tree` holds an `opt_state` already and `optimizer=` would derive another; drop "
                         "`optimizer=` to plan the one it holds, or pass the params (or parts without opt_state).")
    if optimizer is not None and not hasattr(optimizer, "init"):
        raise TypeError(f"`optimizer` must be an optax GradientTransformation (with `init`), got "
                        f"{type(optimizer).__name__}.")
    sizes, mesh_obj = _mesh_of(mesh)
    notes: list[str] = []
    with _rules(rules):
        if mesh_obj is None and mesh is None:
            mesh_obj = _found_mesh(parts)
            sizes = {str(k): int(v) for k, v in mesh_obj.shape.items()} if mesh_obj is not None else {}
        layout = _Layout(sizes, mesh_obj, asked=mesh is not None, abstract=step_fn is not None)
        params, mirrors = layout.params(parts["params"])
        laid = {"params": params}
        if grads:
            laid["grads"] = _grads(params)
        if optimizer is not None:
            structs = _structs(parts["params"])
            opt_state = jax.eval_shape(optimizer.init, structs)
            parts = {**parts, "opt_state": opt_state}
            notes.append("opt_state: jax.eval_shape(optimizer.init, params), each moment laid out like its param")
        unmirrored = False
        for name in sorted((n for n in parts if n != "params"),
                           key=lambda n: (PART_ORDER.index(n) if n in PART_ORDER else len(PART_ORDER))):
            mirrors.found.clear()
            laid[name] = layout.part(name, parts[name], mirrors=mirrors)
            unmirrored = unmirrored or (name == "opt_state" and mirrors.unmirrored())
        if grads and optimizer is not None and unmirrored:  # a param without a moment may be frozen
            laid["grads"], note = _unfrozen(laid["grads"], frozen_grads(optimizer, structs, opt_state))
            notes += [note] if note else []
    leaves = [leaf for part in laid.values() for leaf in part.leaves]
    by_part = {name: sum(leaf.bytes for leaf in part.leaves) for name, part in laid.items()}
    plan = MemoryPlan(dict(sizes), leaves, by_part, sum(by_part.values()), device_memory=memory,
                      host=_host(leaves, chunk_bytes, memory_budget),
                      shardings={name: part.shardings for name, part in laid.items()}, notes=notes,
                      warnings=indivisible_warnings(layout.indivisible), indivisible=layout.indivisible, top=top,
                      replicated_threshold=replicated_threshold)
    plan = dataclasses.replace(plan, estimates=_estimates(plan, activations,
                                                          parts_global=plan.global_bytes.get("params", 0)))
    if step_fn is not None:
        abstract = {name: part.abstract for name, part in laid.items() if name != "grads"}
        state = _with_parts(tree, state_parts(tree), abstract, added=optimizer is not None)
        compiled, note = _compiled(step_fn, state, step_args, sizes, mesh_obj)
        plan = dataclasses.replace(plan, compiled=compiled, notes=[*plan.notes, note])
    return plan
