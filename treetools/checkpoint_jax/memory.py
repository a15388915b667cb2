"""Will a checkpoint fit? ``plan_checkpoint``: ``memory_plan`` of a checkpoint's state on a mesh, from its metadata.

The checkpoint is read through the checkpoint layer (``treetools.checkpoint_io``), metadata only: each leaf's shape,
dtype, the sharding it was saved with (``Leaf.row.sharding``) and its stored chunk shape. Each item of the
step is one part of the state (an item holding a whole train state, Orbax's ``default``, is split into its
top-level parts); the part holding the parameters is ``params`` (T5X's ``target``, Levanter's ``model``...:
``treetools.checkpoint_io.source``'s one list). Every leaf is laid out on the mesh by the first of:

1. layout rules (``LayoutRules``, ``treetools plan --rules FILE``): ``(pattern, spec)`` pairs, the first
   pattern that ``re.search`` finds in ``part/path`` giving the leaf's PartitionSpec;
2. the sharding the checkpoint recorded (Orbax's ``_sharding``), its mesh axes taken by name on the mesh;
3. what ``memory_plan`` does with a leaf that says nothing: an optimizer moment like the param it mirrors,
   anything else replicated.

The optimizer state for training is ``memory_plan``'s: ``jax.eval_shape(optimizer.init, params)`` (a stored
``opt_state`` is then left out), and grads like the params.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Mapping, Sequence

from treetools.checkpoint_io.context import ReadContext, ReadOptions, context_of
from treetools.checkpoint_io.items import MODEL_ITEMS, PARAM_SUBTREES, counts_params, part_of, train_state_parts
from treetools.checkpoint_io.leaves import Item
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_io.readers import np_dtype
from treetools.pytree.memory import MAX_DEVICES, TOP, MemoryPlan, memory_plan
from treetools.pytree.partitioning import mesh_axes_of
from treetools.rules.spec import read_rules_file
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError

OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion")
"""Optimizers ``treetools plan --optimizer`` knows by name: optax's, with their default hyperparameters."""


def optimizer_named(name: str) -> Any:
    """The optax optimizer ``name`` stands for (its state's shape does not depend on the learning rate).

    ``sgd`` is plain SGD, without state (with momentum it holds one params-sized trace, as ``lion``).

    >>> type(optimizer_named("adamw").init({})).__name__
    'tuple'
    """
    import optax  # jax side: only when an optimizer is asked for

    makers = {"adamw": lambda: optax.adamw(1e-3), "adam": lambda: optax.adam(1e-3), "sgd": lambda: optax.sgd(1e-3),
              "adafactor": optax.adafactor, "lion": lambda: optax.lion(1e-4)}
    if name not in makers:
        raise ValueError(f"`optimizer` {name!r} is not one of {', '.join(OPTIMIZERS)}; or pass an optax "
                         "GradientTransformation.")
    return makers[name]()


# ---------------------------------------------------------------------------- layout rules


def _spec_entry(value: Any, where: str) -> Any:
    if value is None or value in ("", "None", "none"):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ValueError(f"{where}: a spec entry is a mesh axis name, a list of them, or null (\"\" or \"None\" in "
                     f"TOML), got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LayoutRules:
    """Where leaves go on the mesh: ``(pattern, spec)`` pairs, the first whose pattern ``re.search`` finds in a
    leaf's ``part/path`` giving its PartitionSpec entries (``("fsdp", None)``; ``()`` is replicated).

    >>> rules = LayoutRules.from_dict({"partition": [["embedding$", ["tensor", "fsdp"]], ["kernel$", [None, "fsdp"]]]})
    >>> rules.spec_for("params/layers_0/mlp/kernel"), rules.spec_for("params/norm/scale") is None
    ((None, 'fsdp'), True)
    """

    partition: tuple[tuple[str, tuple], ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "layout rules") -> "LayoutRules":
        """From ``{"partition": [[pattern, spec], ...]}`` (or ``{pattern: spec}`` in order).

        Raises:
          ValueError: another key, a pattern that does not compile, a spec that is no list of entries.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected an object with a `partition` list of [pattern, spec] pairs.")
        extra = sorted(set(data) - {"partition"})
        if extra:
            raise ValueError(f"{where}: unknown key(s) {extra}; the layout rules of `treetools plan` hold one key, "
                             "`partition`: [[pattern, spec], ...].")
        raw = data.get("partition", [])
        pairs = list(raw.items()) if isinstance(raw, Mapping) else raw
        out = []
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str):
                raise ValueError(f"{where}: each partition rule is [pattern, spec], got {pair!r}.")
            pattern, spec = pair
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{where}: {pattern!r} is not a valid regex ({e}).") from None
            entries = spec if isinstance(spec, (list, tuple)) else [spec]
            out.append((pattern, tuple(_spec_entry(e, f"{where}: {pattern!r}") for e in entries)))
        return cls(tuple(out))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "LayoutRules":
        """From a ``.json`` or ``.toml`` file holding ``partition`` (``from_dict``).

        Raises:
          ValueError: an unknown suffix, a file that does not parse (naming it), or ``from_dict``'s errors.
          OSError: the file cannot be read.
        """
        path = os.path.expanduser(os.fspath(path))
        data = read_rules_file(path, what="layout rules")
        return cls.from_dict(data, where=f"layout rules {path}")

    def spec_for(self, name: str) -> tuple | None:
        """The spec entries of the first rule that matches ``name``; None when none does."""
        return next((spec for pattern, spec in self.partition if re.search(pattern, name)), None)


# ---------------------------------------------------------------------------- the checkpoint as parts


def _parts(snap_items: Mapping[str, Item], present: Sequence[str]) -> dict[str, Item]:
    """Every pytree item as a part; an item holding a whole train state split into its top-level parts."""
    out: dict[str, Item] = {}
    for name, item in snap_items.items():
        if item.kind != "pytree":
            continue  # JSON items (a data iterator's state) hold no arrays
        keys = train_state_parts(name, item, present)
        if keys is None:
            out[name] = item
            continue
        for key in keys:
            below = part_of(item, key)
            if below is None:  # a top-level array (a TrainState's `step`) is a part of its own, path ()
                below = Item(key, "pytree", [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=()))
                                             for leaf in item.leaves if leaf.path == (key,)])
            out[key] = below
    return out


def _params_name(parts: Sequence[str], *, asked: bool) -> str | None:
    """The part holding the parameters: ``params``, T5X's ``target``, Levanter's ``model``...; else the one part,
    unless it was asked for by a name that holds no parameters (``--item opt_state``)."""
    for name in ("params", *PARAM_SUBTREES[False], *MODEL_ITEMS):
        if name in parts:
            return name
    lone = parts[0] if len(parts) == 1 else None
    return lone if lone is not None and (not asked or counts_params(lone)) else None


def largest_split(shape: Sequence[int], axis: str, size: int) -> tuple | None:
    """The spec that splits the largest dimension ``size`` divides over ``axis`` (the first of equals), FSDP's
    default layout; None when no dimension of a leaf is divisible (it stays replicated).

    >>> largest_split((50257, 768), "fsdp", 8), largest_split((3,), "fsdp", 8)
    ((None, 'fsdp'), None)
    """
    dims = [d for d, n in enumerate(shape) if n >= size and n % size == 0]
    if not dims:
        return None
    best = max(dims, key=lambda d: (shape[d], -d))
    return tuple(axis if d == best else None for d in range(len(shape)))


def _tree(part: str, item: Item, sizes: Mapping[str, int], rules: LayoutRules | None,
          counts: dict[str, int], shard_largest: str | None = None) -> tuple[Any, dict[str, int]]:
    """``{leaf name: ShapeDtypeStruct}`` of a part (the struct alone for a part that is one array), each laid out
    by the rules or its recorded sharding (a ``NamedSharding`` on an ``AbstractMesh`` with the mesh's axes), and
    each leaf's stored chunk in bytes."""
    import jax
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    tree, chunks = {}, {}
    for leaf in item.leaves:
        row = leaf.row
        if row.shape is None or row.dtype is None:
            continue  # no array: nothing on a device
        dtype = np_dtype(str(row.dtype))
        shape = tuple(int(d) for d in row.shape)
        full = f"{part}/{row.name}" if row.path else part
        spec = rules.spec_for(full) if rules is not None else None
        how = "rules"
        if spec is None and row.sharding is not None and not row.sharding.replicated:
            spec, how = tuple(row.sharding.spec), "recorded"
            missing = [a for e in spec for a in mesh_axes_of(e) if a not in sizes]
            if missing:
                raise ValueError(
                    f"leaf `{full}` was saved laid out as {PartitionSpec(*spec)}, over mesh axes {missing} that the "
                    f"mesh {dict(sizes) or '(one device)'} lacks: give the mesh those axes (--mesh "
                    f"{','.join(f'{a}=N' for a in missing)}), or lay the leaves out with layout rules (--rules FILE).")
        if spec is None and shard_largest is not None and not _is_moment(part):
            spec, how = largest_split(shape, shard_largest, sizes[shard_largest]), "largest"
        if spec is None:
            tree[row.name] = jax.ShapeDtypeStruct(shape, dtype)
            how = "none"
        else:
            axes = dict(sizes)
            axes.update({a: 1 for e in spec for a in mesh_axes_of(e) if a not in axes})  # named: memory_plan says
            mesh = AbstractMesh(tuple(axes.values()), tuple(axes))
            tree[row.name] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))
        counts[how] += 1
        reader = leaf.reader
        if reader is not None and reader.chunk_shape:
            chunks[full] = math.prod(int(c) for c in reader.chunk_shape) * dtype.itemsize
    if list(tree) == [""]:  # a part that is one array
        return tree[""], chunks
    return tree, chunks


def _is_moment(part: str) -> bool:
    """A stored optimizer state: its moments follow their params (``memory_plan``), not ``--shard-largest``."""
    return part == "opt_state"


def _recorded_mesh(parts: Mapping[str, Item], where: str) -> dict[str, int]:
    """The mesh the checkpoint records with its shardings (the first leaf's that has one), else ``{}``.

    Raises:
      CheckpointError: it has more than ``MAX_DEVICES`` devices (the message names the leaf and ``--mesh``)."""
    for name, item in parts.items():
        for leaf in item.leaves:
            sharding = leaf.row.sharding
            if sharding is not None and sharding.mesh:
                sizes = {str(k): int(v) for k, v in sharding.mesh.items()}
                if math.prod(sizes.values()) > MAX_DEVICES:
                    raise CheckpointError(
                        f"{where}: `{name}/{leaf.name}` records a mesh of {' x '.join(map(str, sizes.values()))} "
                        f"devices ({math.prod(sizes.values()):,}), more than {MAX_DEVICES:,}: no machine has it; "
                        "plan for a mesh of your own with --mesh AXIS=SIZE,... (mesh= in the library).")
                return sizes
    return {}


def plan_checkpoint(
    path: str | os.PathLike,
    *,
    step: int | str | None = None,
    item: str | None = None,
    mesh: Mapping[str, int] | Any = None,
    rules: LayoutRules | str | os.PathLike | None = None,
    optimizer: str | Any = None,
    grads: bool = True,
    device_memory: int | str | None = None,
    memory_budget: float | str | None = None,
    prefix: str | None = None,
    top: int = TOP,
    shard_largest: str | None = None,
    read: ReadOptions | ReadContext | None = None,
) -> MemoryPlan:
    """The per-device memory to restore a checkpoint onto a mesh and train it: ``memory_plan`` from metadata.

    Args:
      path: any checkpoint ``treetools inspect`` reads (local, ``gs://``, ``s3://``).
      step: a committed step (default the latest).
      item: only this item (or top-level part of a whole train state); default every pytree item.
      mesh: ``{axis: size}`` (or a ``Mesh``/``AbstractMesh``); default the mesh the checkpoint recorded, else one
        device.
      rules: ``LayoutRules``, ``{"partition": [[regex, spec], ...]}`` or the path of a ``.json``/``.toml`` file
        of them: leaves they match are laid out by them, before the sharding the checkpoint recorded.
      optimizer: ``adamw``, ``adam``, ``sgd``, ``adafactor``, ``lion`` or an optax ``GradientTransformation``:
        its state replaces a stored ``opt_state`` (``notes`` says so).
      grads: count the gradients a training step holds (the params' floating leaves).
      device_memory: one device's memory (bytes or ``"80GiB"``): ``plan.fits``.
      memory_budget: the restore's memory budget in bytes or a size (``"4GiB"``), over ``read``'s (None:
        ``read``'s, else ``TREETOOLS_MEMORY_BUDGET_MB``, else 2 GiB).
      prefix: the series of steps to read in a folder holding several.
      top: rows kept.
      shard_largest: a mesh axis: every leaf neither the rules nor a recorded sharding lay out (a Hugging Face
        checkpoint's, all of them) splits its largest dimension that axis divides over it (FSDP's default
        layout); one no dimension of which it divides stays replicated. Without it such leaves are replicated,
        and a plan where no leaf is split over a mesh of several devices says so first (``plan.warnings``).
      read: how the checkpoint's metadata is read (``tt.ReadOptions`` or a ``ReadContext``: ``follow_links``,
        ``memory_budget``; None: the environment's). Only metadata is read: its block size and threads are
        carried, not used.

    Raises:
      CheckpointNotFoundError, CheckpointError: as ``treetools inspect`` (no such path, step or item).
      ValueError: a recorded sharding names an axis the mesh lacks (the message names the leaf and the fix),
        bad rules, an unknown optimizer name.

    >>> import tempfile, numpy as np, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, w=np.ones((1024, 256), np.float32))
    >>> plan = plan_checkpoint(f, mesh={"fsdp": 8}, rules={"partition": [["w$", ["fsdp", None]]]}, optimizer="adam")
    >>> plan.by_part   # 1 MiB of w split 8 ways; its grad; Adam's mu and nu, and the step count
    {'params': 131072, 'grads': 131072, 'opt_state': 262148}
    """
    if isinstance(rules, (str, os.PathLike)):
        rules = LayoutRules.from_file(rules)
    elif isinstance(rules, Mapping):
        rules = LayoutRules.from_dict(rules)
    tx = optimizer_named(optimizer) if isinstance(optimizer, str) else optimizer
    source = open_source(path, context_of(read, memory_budget=memory_budget, prefix=prefix))  # the edge, once
    budget = source.context.memory_budget
    resolved = source.resolve(step)
    with source.reading(resolved):
        present = source.item_names(resolved)
        snap = source.snapshot(resolved, [item] if item is not None else None)
    parts = _parts(snap.items, present)
    where = f"{source.path}" + (f" (step {resolved})" if resolved is not None else "")
    notes = [f"read: {where}, {source.format}, metadata only: {', '.join(parts) or 'no arrays'}"]
    params = _params_name(list(parts), asked=item is not None)
    if params is None and tx is not None:
        raise CheckpointNotFoundError(f"{where}: no item holds the parameters (parts: {', '.join(parts)}), so no "
                                      "optimizer state can be derived; pick one with --item, or drop --optimizer.")
    if tx is not None and "opt_state" in parts:
        del parts["opt_state"]
        notes.append("opt_state: the stored one left out; the optimizer's own state is planned instead")
    if params is not None and params != "params":
        notes.append(f"params: the parameters are `{params}`")
    sizes = dict(getattr(mesh, "shape", mesh) or {}) if mesh is not None else _recorded_mesh(parts, where)
    if mesh is not None and math.prod(int(v) for v in sizes.values()) > MAX_DEVICES:
        raise ValueError(f"`mesh` {dict(sizes)} has {math.prod(int(v) for v in sizes.values()):,} devices, more than "
                         f"{MAX_DEVICES:,}.")
    if shard_largest is not None and shard_largest not in sizes:
        raise ValueError(f"--shard-largest {shard_largest}: the mesh {dict(sizes) or '(one device)'} has no axis "
                         f"`{shard_largest}`; name one of its axes, or give the mesh one (--mesh {shard_largest}=N).")
    counts = {"rules": 0, "recorded": 0, "largest": 0, "none": 0}
    trees, chunks = {}, {}
    for name, part in parts.items():
        trees["params" if name == params else name], found = _tree(name, part, sizes, rules, counts, shard_largest)
        chunks.update({"params" + k[len(name):] if name == params else k: v for k, v in found.items()})
    if "params" not in trees:
        trees = {"params": {}, **trees}
        grads = False
    largest = f", {counts['largest']} by --shard-largest {shard_largest}" if shard_largest is not None else ""
    notes.append(f"layout: {counts['rules']} leaves by the rules, {counts['recorded']} by the sharding recorded"
                 f"{largest}, {counts['none']} with none (optimizer moments follow their param, the rest replicated)")
    plan = memory_plan(trees, mesh=sizes, optimizer=tx, grads=grads, device_memory=device_memory,
                       memory_budget=budget, chunk_bytes=chunks, top=top)
    plan.notes[:0] = notes
    devices = math.prod(sizes.values()) if sizes else 1
    if devices > 1 and plan.leaves and all(leaf.bytes == leaf.global_bytes for leaf in plan.leaves):
        axis = max(sizes, key=lambda a: sizes[a])
        plan.warnings.insert(0, (
            f"every leaf is replicated on all {devices} devices: the checkpoint records no sharding and no rule "
            f"lays its leaves out, so each device holds the whole state; pass --shard-largest {axis} "
            f"(shard_largest=\"{axis}\": each leaf's largest dimension split over {axis}) or --rules FILE"))
    return plan
