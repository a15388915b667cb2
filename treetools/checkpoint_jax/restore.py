"""Restore any checkpoint into target trees on any mesh, with rules; and load its parameters as numpy.

Everything here reads checkpoints through the one checkpoint layer
(``treetools.checkpoint_io``), so ``load_parameters``, ``restore_checkpoint`` and
``treetools inspect`` agree on which step is the latest and on the path of
every leaf, for every format the layer reads:

* ``plan_restore`` reads metadata only and says, for every target leaf, where
  its value comes from (a checkpoint leaf after ``Rules``, or ``fill_missing``),
  which checkpoint leaves go unused, and every problem (rules that do not fit
  the checkpoint among them); ``restore_checkpoint`` builds the same plan and
  raises one ``CheckpointMismatchError`` listing every problem before any
  array is read;
* boxes (flax ``Partitioned``, nnx ``Variable``) are never written to disk:
  the stored arrays are put back in the target's boxes; leaves saved as
  ``.../value`` nodes are read with that suffix dropped, everywhere;
* every array is read straight into its target's sharding, for every format
  (Orbax's included) and with or without rules, by the one block engine
  (``placing.place_arrays`` over ``checkpoint_io.stream.read_regions``): each
  addressable device's block read once through the leaves' readers (through
  the rules: an unstacked layer reads its slice), on the engine's threads
  with read-ahead, within the read options' memory budget; a stored leaf no
  target asks for is never read;
* every entry point takes the read options (``read=tt.ReadOptions(...)`` or
  the ``ReadContext`` it builds): block size, threads, memory budget,
  ``follow_links``;
* relative and ``~`` paths work everywhere (Orbax itself needs absolute ones).

This module imports neither jax nor orbax at import time: ``load_parameters``
without a target returns numpy arrays without them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from treetools.checkpoint_io.mapping import map_item
from treetools.checkpoint_io.context import UNBOUNDED, ReadContext, ReadOptions, context_of
from treetools.checkpoint_io.leaves import Item, Leaf, NO_VALUE, value_row
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_io.readers import ArrayReader
from treetools.checkpoint_io.storage import location
from treetools.checkpoint_io.source import Source
from treetools.checkpoint_io.stream import read_arrays
from treetools.checkpoint_jax.placing import is_key as _is_key, key_impl, place_arrays
from treetools.checkpoint_jax.restore_plan import ItemPlan, LeafPlan, RestorePlan
from treetools.shared.errors import CheckpointMismatchError, Mismatch, RulesError
from treetools.shared.rows import Row, dtype_name
from treetools.rules.plan import RulesPlan
from treetools.rules.spec import Rules

_LOG = logging.getLogger("treetools")

if TYPE_CHECKING:  # type hints only
    import orbax.checkpoint as ocp


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{dtype_name(x.dtype)}{list(x.shape)}"
    return type(x).__name__


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


# ---------------------------------------------------------------------------- targets


@dataclasses.dataclass
class _Target:
    """One target tree flattened (boxes as leaves): each leaf's path and unboxed abstract value (a
    ``ShapeDtypeStruct`` with a sharding for arrays; non-arrays as they are), the ``fill_missing`` leaves
    by path, and how to put the tree back together."""

    paths: list[str]
    abstract: list[Any]
    fill: dict[str, Any]
    rebuild: Callable[[Mapping[str, Any]], Any]

    @property
    def by_path(self) -> dict[str, Any]:
        return dict(zip(self.paths, self.abstract))


def _target(target: Any, sharding: Any, fill: Any, *, lone: str | None = None) -> _Target:
    """Flatten ``target`` on ``sharding`` (or its own shardings; arrays without one are replicated), and ``fill``.

    ``lone``: the name of a one-array item's one leaf (its path is the item's name, as ``inspect`` and
    ``load_parameters`` show it); a target that is one bare leaf (``jax.random.key(0)`` for an item Orbax's
    ``JaxRandomKeySave`` wrote, as Orbax restores it) is that leaf, and so is a bare ``fill``.
    """
    # The jax side, imported here only: load_parameters(path) without a target stays numpy-only.
    import jax

    from treetools.pytree.abstract import make_abstract
    from treetools.pytree.counting import is_array_like
    from treetools.pytree.partitioning import rebox, unbox
    from treetools.pytree.paths import is_leaf, leaves_with_paths, path_str

    pairs, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_leaf)
    leaves = [x for _, x in pairs]
    paths = [path_str(p) for p, _ in pairs]
    bare = lone if lone is not None and [p for p, _ in pairs] == [()] else None  # the bare leaf's path
    if bare is not None:
        paths = [bare]
    replicated = None
    abstract = []
    for leaf in jax.tree_util.tree_leaves(make_abstract(target, sharding), is_leaf=is_leaf):
        value = unbox(leaf)
        if is_array_like(value) and getattr(value, "sharding", None) is None:
            if replicated is None:  # over every device of every process: valid single- and multi-process
                mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("devices",))
                replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            value = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=replicated)
        abstract.append(value)
    filled = {p: unbox(x) for p, x in leaves_with_paths(fill)} if fill is not None else {}
    if bare is not None and set(filled) == {""}:
        filled = {bare: filled[""]}

    def rebuild(values: Mapping[str, Any]) -> Any:
        """The target's structure with each leaf's restored value, inside the leaf's box."""
        return jax.tree_util.tree_unflatten(
            treedef, [rebox(leaf, values[p]) if p in values else leaf for leaf, p in zip(leaves, paths)])

    return _Target(paths, abstract, filled, rebuild)


@dataclasses.dataclass
class _Work:
    """One pytree item's plan: the item as stored, as the rules map it, the target, and where each leaf comes from."""

    stored: Item
    mapped: Item
    rules: RulesPlan | None
    target: _Target
    from_checkpoint: list[str]
    from_fill: list[str]


def _shown(label: str, path: str) -> str:
    """A target leaf's path as the user's ``items`` spell it: ``label`` (``params/``, or ``""`` for
    ``load_parameters``' own target) then the path; a bare-leaf target is named by the label alone."""
    return label + path if path else label.rstrip("/") or "target"


def _key_data(x: Any) -> Any:
    """A typed PRNG key (or its abstract value) as the abstract key data it is stored as; anything else as it is."""
    if not _is_key(x):
        return x
    import jax  # a typed key: jax is loaded already

    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))


def _check_leaf(where: str, x: Any, shape: Any, dtype: Any, allow_dtype_cast: bool, *,
                what: str = "") -> list[Mismatch]:
    """A target leaf against what will fill it (a checkpoint leaf after the rules, or a fill value)."""
    if not _is_array(x) or shape is None:
        return []
    x = _key_data(x)  # typed keys are stored as their key data
    if tuple(x.shape) != tuple(shape):
        return [Mismatch(where, "shape", str(tuple(x.shape)), f"{what}{tuple(shape)}")]
    if np.dtype(x.dtype) != np.dtype(dtype) and not allow_dtype_cast:
        return [Mismatch(where, "dtype", dtype_name(x.dtype), f"{what}{dtype_name(np.dtype(dtype))}")]
    return []


def _lone(item: Item) -> str | None:
    """The one leaf's name of a one-array item (an array, a PRNG key, a step number saved alone), whose path is
    the item's name; None for any other item."""
    return item.name if [leaf.name for leaf in item.leaves] == [item.name] else None


def _plan_item(name: str, stored: Item, target: Any, sharding: Any, rules: Rules | None, fill: Any,
               allow_unused: bool, allow_dtype_cast: bool, *,
               label: str | None = None) -> tuple[_Work, ItemPlan, list[Mismatch]]:
    """Plan one pytree item against its target: nothing is read.

    ``label``: what problems put before a leaf's path (``name/`` by default: ``items`` are keyed by item).
    """
    label = f"{name}/" if label is None else label
    tgt = _target(target, sharding, fill, lone=_lone(stored))
    if stored.positional:
        stored = _by_position(stored, tgt)
    plan = None
    mapped = stored
    layer_problems: list[str] = []
    if rules is not None and not rules.empty:
        try:
            mapped, plan = map_item(stored, rules, targets=tgt.paths)
        except RulesError as e:  # rules that do not fit this checkpoint: problems of the plan, not an exception
            try:  # only the target's layer counts? The leaves as the checkpoint's layers make them, checked too
                mapped, plan = map_item(stored, rules)
            except RulesError:
                return _unresolved(name, stored, tgt, e.problems, label)
            layer_problems = list(e.problems)
    found = {leaf.name: leaf for leaf in mapped.leaves}
    problems: list[Mismatch] = []
    item_plan = ItemPlan(name, "pytree", dropped=list(plan.dropped) if plan is not None else [])
    from_ckpt, from_fill = [], []
    for path, x in zip(tgt.paths, tgt.abstract):
        leaf = found.get(path)
        if leaf is not None:
            shape = tuple(leaf.reader.shape) if leaf.reader is not None else None
            dtype = leaf.reader.dtype if leaf.reader is not None else None
            problems += _check_leaf(_shown(label, path), x, shape, dtype, allow_dtype_cast)
            ops = _ops(plan, path, x, dtype)
            source = str(plan[path].row().source) if plan is not None else path
            item_plan.leaves.append(LeafPlan(path, "checkpoint", source, shape and tuple(shape),
                                             dtype_name(dtype) if dtype is not None else None, ops))
            from_ckpt.append(path)
        elif path in tgt.fill:
            value = tgt.fill[path]
            if _is_array(x):
                value_data = _key_data(value)
                problems += _check_leaf(_shown(label, path), x, getattr(value_data, "shape", None),
                                        getattr(value_data, "dtype", None), allow_dtype_cast, what="fill_missing ")
            shape = tuple(value.shape) if _is_array(value) else None
            item_plan.leaves.append(LeafPlan(path, "fill_missing", None, shape,
                                             dtype_name(value.dtype) if _is_array(value) else None))
            from_fill.append(path)
        elif layer_problems and _beyond_layers(path, found):  # a layer the checkpoint lacks: said by the rules
            item_plan.leaves.append(_target_leaf(path, "unresolved", x))
        else:
            problems.append(Mismatch(_shown(label, path), "missing", _describe(x), "nothing"))
            item_plan.leaves.append(_target_leaf(path, "missing", x))
    wanted = set(tgt.paths)
    for path, leaf in found.items():
        if path in wanted:
            continue
        item_plan.unused.append(path)
        if not allow_unused:
            shown = f"{leaf.row.dtype}{list(leaf.row.shape)}" if leaf.row.shape is not None else "a value"
            problems.append(Mismatch(_shown(label, path), "unexpected", "nothing", shown))
    work = _Work(stored, mapped, plan, tgt, from_ckpt, from_fill)
    where = label.rstrip("/") or "rules"
    first = [Mismatch(where, "rules", "rules that fit the checkpoint", problem) for problem in layer_problems]
    return work, item_plan, first + sorted(problems, key=lambda p: (p.kind != "missing", p.path))


def _beyond_layers(path: str, found: Mapping[str, Any]) -> bool:
    """Whether target ``path`` is a layer past those the checkpoint has (``layers/3/w`` where the unstacked
    ``layers/0/w`` exists): the rules' layer-count problem names it, so it is not also a missing leaf."""
    parts = path.split("/")
    return any(part.isdigit() and "/".join([*parts[:i], "0", *parts[i + 1:]]) in found
               for i, part in enumerate(parts))


def _target_leaf(path: str, origin: str, x: Any) -> LeafPlan:
    """A target leaf no checkpoint leaf fills, with the target's shape and dtype."""
    return LeafPlan(path, origin, None, getattr(x, "shape", None) and tuple(x.shape),
                    dtype_name(x.dtype) if _is_array(x) else None)


def _unresolved(name: str, stored: Item, tgt: _Target, problems: Sequence[str],
                label: str) -> tuple[_Work, ItemPlan, list[Mismatch]]:
    """The plan of an item whose rules do not fit the checkpoint: the rules' problems, one each, and every target
    leaf unresolved (which checkpoint leaf would fill it is not known, so none is called missing or unused)."""
    leaves = [_target_leaf(path, "unresolved", x) for path, x in zip(tgt.paths, tgt.abstract)]
    item_plan = ItemPlan(name, "pytree", leaves)
    where = label.rstrip("/") or "rules"
    found = [Mismatch(where, "rules", "rules that fit the checkpoint", problem) for problem in problems]
    return _Work(stored, stored, None, tgt, [], []), item_plan, found


def _stored_by_position(x: Any) -> bool:
    """A target leaf that a positional file (Equinox's) stores: an array, or a Python number (saved as a 0-d array)."""
    return _is_array(x) or isinstance(x, (bool, int, float, complex))


def _by_position(item: Item, target: _Target) -> Item:
    """A positional item's leaves (``0``, ``1``, ...: no stored names) named by the target's stored leaves, in order.

    As ``eqx.tree_deserialise_leaves(path, like)`` does: the target's arrays and
    Python numbers, in jax's flatten order, are the file's leaves in its order;
    its other leaves (functions, strings) are not stored and keep the target's
    value. Leaves left over on either side keep their names, so the plan
    reports them as missing or unexpected.
    """
    names = [p for p, x in zip(target.paths, target.abstract) if _stored_by_position(x)]
    leaves = list(item.leaves)
    for i, name in enumerate(names[: len(leaves)]):
        leaves[i] = dataclasses.replace(leaves[i], row=dataclasses.replace(leaves[i].row, path=tuple(name.split("/"))))
    kept = [Leaf(value_row(tuple(p.split("/"))), value=x) for p, x in zip(target.paths, target.abstract)
            if not _stored_by_position(x)]
    return dataclasses.replace(item, leaves=leaves + kept, positional=False)


def _ops(plan: RulesPlan | None, path: str, x: Any, dtype: Any) -> tuple[str, ...]:
    ops: list[str] = []
    if plan is not None:
        row = plan[path].row()
        ops = list(row.ops)
        if row.source.split("[")[0] != path and not plan[path].stacked:
            ops.insert(0, "renamed")
    if dtype is not None and _is_array(x) and not _is_key(x) and np.dtype(x.dtype) != np.dtype(dtype):
        ops.append(f"cast {dtype_name(x.dtype)} on read")
    return tuple(ops)


# ---------------------------------------------------------------------------- reading


def _host_value(leaf: Leaf, array: Any = None) -> Any:
    """A leaf as host data: an array read whole (or ``array``, already read), a scalar as a Python number,
    a value as stored."""
    if leaf.reader is not None:
        value = leaf.reader.read_all() if array is None else array
        return value.item() if leaf.row.shape is None and np.ndim(value) == 0 else value
    return None if leaf.value is NO_VALUE else leaf.value


def _host_values(leaves: Sequence[Leaf]) -> list[Any]:
    """``_host_value`` of every leaf; the arrays read whole by the block engine, several at once (all cores)."""
    arrays = read_arrays([leaf.reader for leaf in leaves if leaf.reader is not None])
    return [_host_value(leaf, next(arrays)) if leaf.reader is not None else _host_value(leaf) for leaf in leaves]


def _reader_values(leaves: Mapping[str, Leaf], targets: Mapping[str, Any], context: ReadContext, *,
                   label: str = "") -> dict[str, Any]:
    """``{leaf path: value}`` read through the checkpoint layer's readers.

    An array target with a sharding becomes a ``jax.Array`` placed by the
    block engine (``place_arrays``): each distinct block of this process's
    devices read once, on the engine's threads, straight onto its device(s).
    Other targets get host values.
    """
    values: dict[str, Any] = {}
    arrays: dict[str, Any] = {}
    readers: dict[str, ArrayReader] = {}
    for path, x in targets.items():
        leaf = leaves[path]
        if leaf.reader is None or not (hasattr(x, "sharding") and hasattr(x, "shape")):
            value = _host_value(leaf)
            if isinstance(x, (bool, int, float, complex)) and np.ndim(value) == 0:  # a Python number stays one
                value = type(x)(np.asarray(value).item())
            values[path] = value
            continue
        arrays[path], readers[path] = x, leaf.reader
    if arrays:
        values.update(place_arrays(readers, arrays, context, label=label))
    return values


def _keyed(value: Any, target: Any) -> Any:
    """A fill value for a typed-key target (the key, or its key data) as the key on the target's sharding."""
    import jax  # a typed key target: jax is loaded already

    if _is_key(value):
        return jax.device_put(value, target.sharding)
    return jax.device_put(jax.random.wrap_key_data(value, impl=key_impl(target)), target.sharding)


def _fill_values(fill: Mapping[str, Any], targets: Mapping[str, Any]) -> dict[str, Any]:
    """``fill_missing`` values placed like the checkpoint's: an array on its target's sharding and dtype."""
    import jax  # placing arrays is the jax side

    out = {}
    for path, value in fill.items():
        x = targets[path]
        if _is_array(x) and hasattr(x, "sharding") and _is_array(value):
            if _is_key(value) and not _is_key(x):  # a typed key offered for a raw key target: its key data
                value = jax.random.key_data(value)
            if _is_key(x):  # a typed key target: the key (given, or wrapped from its key data), as stored keys are
                value = _keyed(value, x)
            else:
                value = jax.device_put(jax.numpy.asarray(value, dtype=x.dtype), x.sharding)
        out[path] = value
    return out


def _read(source: Source, work: _Work, *, label: str = "") -> Any:
    """Every target leaf's value, then the target tree: the readers (through the rules) for the leaves from the
    checkpoint, placed by the block engine; ``fill_missing`` for the missing ones."""
    abstract = work.target.by_path
    values = _fill_values({p: work.target.fill[p] for p in work.from_fill}, abstract)
    mapped = {leaf.name: leaf for leaf in work.mapped.leaves}
    values.update(_reader_values(mapped, {p: abstract[p] for p in work.from_checkpoint}, source.context,
                                 label=label))
    return work.target.rebuild(values)


# ---------------------------------------------------------------------------- restore


def _open(manager: Any, context: ReadContext) -> tuple[Source, Any]:
    """The source a manager (its pending save waited for) or a path names, and how to name it in errors."""
    if hasattr(manager, "directory") and hasattr(manager, "wait_until_finished"):
        manager.wait_until_finished()  # a pending async save may be the latest step
        return open_source(location(manager.directory, name="manager"), context), manager.directory
    typed = os.fspath(manager) if isinstance(manager, (str, os.PathLike)) else location(manager, name="manager")
    return open_source(typed, context), manager  # errors name it as typed


def _per_item(value: Any, names: Sequence[str], what: str, *, is_one: Callable[[Any], bool]) -> dict[str, Any]:
    """A per-item argument (``sharding``, ``rules``, ``fill_missing``): one value for every item, or a dict by item.

    ``sharding`` and ``rules`` may be a dict by item name whatever the items;
    ``fill_missing`` is one tree for the one pytree item, or a dict by item name when there are several.
    """
    if value is None:
        return {}
    if is_one(value):
        return dict.fromkeys(names, value)
    if not isinstance(value, Mapping) or not set(value) <= set(names):
        extra = sorted(set(value) - set(names)) if isinstance(value, Mapping) else []
        raise ValueError(
            f"`{what}` keys {extra} are not in `items` {list(names)}; pass one value for every item, or "
            f"{{item name: value}}."
        )
    return dict(value)


def _prepare(manager: Any, step: Any, items: Mapping[str, Any], *, sharding: Any, rules: Any, fill_missing: Any,
             allow_unused: bool, allow_dtype_cast: bool, context: ReadContext
             ) -> tuple[Source, int | None, Any, RestorePlan, dict, dict]:
    if not isinstance(items, Mapping) or not items:
        raise ValueError("`items` must be a non-empty dict of item name -> target tree (or None for JSON items).")
    names = list(items)
    pytree_names = [n for n, t in items.items() if t is not None]
    shardings = _per_item(sharding, names, "sharding",
                          is_one=lambda v: not isinstance(v, Mapping) or not set(v) <= set(names) or not v)
    if isinstance(sharding, Mapping) and sharding and not set(sharding) <= set(names):
        raise ValueError(
            f"`sharding` keys {sorted(set(sharding) - set(names))} are not in `items` {names}; "
            "pass one Sharding, or {item name: Sharding or tree of Shardings}."
        )
    rules_by = _per_item(rules, names, "rules", is_one=lambda v: isinstance(v, Rules))
    fills = _per_item(fill_missing, pytree_names, "fill_missing", is_one=lambda v: len(pytree_names) == 1)
    source, display = _open(manager, context)
    resolved = source.resolve(step)
    with source.reading(resolved):  # a step pruned while it is read: StepDeletedError naming it
        present = source.item_names(resolved)
        problems = [Mismatch(name, "missing", f"item {name!r}", f"items {present}") for name in names
                    if name not in present and not (name in fills and items[name] is not None)]
        plans: dict[str, ItemPlan] = {}
        work: dict[str, _Work] = {}
        json_values: dict[str, Any] = {}
        snap = source.snapshot(resolved, [n for n in names if n in present])
        for name, target in items.items():
            item = snap.items.get(name)
            if item is None:
                if name not in fills or target is None:
                    continue  # a problem above
                item = Item(name, "pytree", [])  # the whole item from fill_missing
            if item.kind == "json":
                json_values[name] = item.value
                plans[name] = ItemPlan(name, "json")
                continue
            if target is None:
                raise ValueError(
                    f"`items[{name!r}]` is None, but {name!r} is a pytree item; pass the live tree or "
                    "make_abstract(...) to restore into, or use load_parameters() for host numpy arrays."
                )
            work[name], plans[name], found = _plan_item(name, item, target, shardings.get(name), rules_by.get(name),
                                                        fills.get(name), allow_unused, allow_dtype_cast)
            problems += found
    plan = RestorePlan(os.fspath(display) if isinstance(display, (str, os.PathLike)) else str(display),
                       source.format, resolved, plans, problems)
    return source, resolved, display, plan, work, json_values


def plan_restore(
    manager: "ocp.CheckpointManager | str | os.PathLike",
    step: int | str | None,
    items: Mapping[str, Any],
    *,
    sharding: Any = None,
    rules: Rules | Mapping[str, Rules] | None = None,
    fill_missing: Any = None,
    allow_unused: bool = False,
    allow_dtype_cast: bool = False,
    prefix: str | None = None,
    follow_links: bool | None = None,
    read: ReadOptions | ReadContext | None = None,
) -> RestorePlan:
    """What ``restore_checkpoint`` would do with the same arguments, from metadata alone.

    For every target leaf: the checkpoint leaf it comes from (after ``rules``)
    or ``fill_missing``, its shape and dtype; every checkpoint leaf left
    unused; every problem (missing, unexpected, shape, dtype, and ``rules``:
    an item's rules that do not fit the checkpoint, one problem per line of
    the ``RulesError`` they would raise, that item's leaves then
    ``unresolved``). Nothing is read but metadata; nothing is raised for a
    mismatch: ``plan.problems`` lists them.

    Args: as ``restore_checkpoint``.

    Returns:
      a ``RestorePlan``; ``print(plan)`` gives the summary, ``plan.describe()`` every leaf.

    Raises:
      What is usage, not a mismatch, still raises at once: a malformed rule is
      refused when the ``Rules`` is made (a bad regex is a ``PatternError``, an
      unknown dtype a ``ValueError``), ``rules``/``sharding``/``fill_missing``
      keyed by names that are not items is a ``ValueError``, a pytree target
      None a ``ValueError``; and a checkpoint that cannot be read raises its
      ``CheckpointError``/``CheckpointNotFoundError``.

    >>> import tempfile, jax, numpy as np
    >>> from treetools.checkpoint_jax.manager import get_checkpoint_manager, save_checkpoint
    >>> root = tempfile.mkdtemp()
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=root)
    >>> _ = save_checkpoint(mngr, 1, {"params": {"body": np.ones(3, np.float32)}}, wait=True); mngr.close()
    >>> target = {"body": jax.ShapeDtypeStruct((3,), np.float32), "head": jax.ShapeDtypeStruct((2,), np.float32)}
    >>> print(plan_restore(root, -1, {"params": target},
    ...                    fill_missing={"head": np.zeros(2, np.float32)}))  # doctest: +ELLIPSIS
    /... (step 1): 1/2 target leaves from the checkpoint, 1 from fill_missing (params/head), 0 checkpoint leaves
    unused, 0 problems
    """
    return _prepare(manager, step, items, sharding=sharding, rules=rules, fill_missing=fill_missing,
                    allow_unused=allow_unused, allow_dtype_cast=allow_dtype_cast,
                    context=context_of(read, prefix=prefix, follow_links=follow_links))[3]


def restore_checkpoint(
    manager: "ocp.CheckpointManager | str | os.PathLike",
    step: int | str | None,
    items: Mapping[str, Any],
    *,
    sharding: Any = None,
    rules: Rules | Mapping[str, Rules] | None = None,
    fill_missing: Any = None,
    allow_unused: bool = False,
    allow_dtype_cast: bool = False,
    prefix: str | None = None,
    follow_links: bool | None = None,
    read: ReadOptions | ReadContext | None = None,
) -> dict[str, Any]:
    """Restore named items of a step into their targets' structure, dtypes and shardings, with rules.

    Reads every checkpoint format treetools reads (Orbax of every version,
    T5X, Flax msgpack, safetensors, Hugging Face sharded, npz; local or in a
    bucket). Each pytree target may be the live tree (arrays), an abstract one
    (``make_abstract``), boxed (flax ``nn.Partitioned``, nnx State: boxes come
    back as boxes) or any custom pytree (a ``TrainState``, optax states).
    Every array is read straight into its target sharding, so each process
    reads only the shards its devices hold, on any mesh or device count: a
    checkpoint saved from 8 devices restores onto 1, 2 or 4, or from fsdp onto
    tensor-parallel specs. Arrays whose target has no sharding are replicated
    over all devices.

    Before reading any array, the plan (``plan_restore``) is made: every
    target leaf is matched with a checkpoint leaf (after ``rules``) or
    ``fill_missing``, and all missing, unexpected, mis-shaped and (unless
    ``allow_dtype_cast``) mis-typed leaves are reported in one error. Only the
    requested items are read, each item's metadata once.

    Args:
      manager: from ``get_checkpoint_manager``, any Orbax ``CheckpointManager``
        (a pending async save is waited for), or any checkpoint path or URL.
      step: a committed step; None, -1 or ``"latest"`` for the latest committed
        one (incomplete saves are never picked).
      items: name -> target tree; JSON items (``data_iter``) may map to None and
        come back as dicts. A one-array item (Orbax's ``ArraySave``,
        ``JaxRandomKeySave``: one leaf named like the item) takes a bare leaf,
        as Orbax restores it: ``{"rng": jax.random.key(0)}`` gives the typed
        key, a raw ``PRNGKey`` target the ``uint32`` key data.
      sharding: one ``Sharding`` for every array, or ``{name: Sharding or tree
        of Shardings}``; overrides the targets' own shardings.
      rules: a ``tt.Rules`` applied to every pytree item (paths inside the
        item), or ``{name: Rules}``: rename (T5X's ``assignment_map``), drop,
        keep, cast, transpose, unstack/stack the checkpoint's leaves onto the target's.
      fill_missing: a tree whose leaves fill the target leaves the checkpoint
        lacks (T5X's ``fallback_state``: a fresh init for a new head); one tree
        when ``items`` has one pytree item, else ``{name: tree}``. An item the
        checkpoint does not have at all is filled whole.
      allow_unused: let checkpoint leaves go unused (a params-only target from a
        whole train state); otherwise each is a problem.
      allow_dtype_cast: let a target dtype differ from the stored one (e.g. bf16
        params from an fp32 checkpoint); values are converted on read.
      prefix: in a folder holding several series of steps (flax's
        ``save_checkpoint(prefix=...)``), the series to read (default ``checkpoint_``).
      follow_links: follow symlinks that lead out of the checkpoint (step folders kept on another volume); off
        by default (None: ``read``'s), for checkpoints you trust (docs/untrusted.md says what it gives up).
      read: how to read (``tt.ReadOptions`` or a ``ReadContext``; None: the environment's defaults): each
        device's block is read in blocks of ``block_bytes`` on ``workers`` threads, and the device blocks held
        on the host at once stay within ``memory_budget`` (one device's block over it is refused before any
        read: ``MemoryBudgetError``); ``follow_links`` as above.

    Returns:
      name -> restored tree (JSON items as dicts).

    Raises:
      CheckpointNotFoundError: (a ``FileNotFoundError``) no such committed step (the message lists them).
      CheckpointMismatchError: (a ``ValueError``) targets do not match; every problem is listed, the rules'
        among them (a pattern that matches nothing, two leaves renamed onto one path, an unstack whose
        leading axis is not the layer count: ``Mismatch`` of kind ``"rules"``).
      MemoryBudgetError: (a ``CheckpointError``) one device's block, or one stored chunk, over ``read``'s
        memory budget (the message names the leaf and the fix).
      ValueError: ``sharding`` is a dict whose keys are not item names, or a pytree target is None; a
        malformed rule when the ``Rules`` is made (``PatternError`` for a bad regex).

    >>> import tempfile, jax
    >>> from treetools.checkpoint_jax.manager import get_checkpoint_manager, save_checkpoint
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=tempfile.mkdtemp())
    >>> _ = save_checkpoint(mngr, 1, {"params": {"w": jax.numpy.arange(4.0)}, "data_iter": {"epoch": 2}})
    >>> out = restore_checkpoint(mngr, "latest", {"params": {"w": jax.numpy.zeros(4)}, "data_iter": None})
    >>> out["params"]["w"].tolist(), out["data_iter"]
    ([0.0, 1.0, 2.0, 3.0], {'epoch': 2})
    >>> mngr.close()
    """
    source, resolved, display, plan, work, out = _prepare(
        manager, step, items, sharding=sharding, rules=rules, fill_missing=fill_missing, allow_unused=allow_unused,
        allow_dtype_cast=allow_dtype_cast, context=context_of(read, prefix=prefix, follow_links=follow_links))
    if plan.problems:
        raise CheckpointMismatchError(resolved, display, plan.problems)
    with source.reading(resolved):
        for name, item_work in work.items():
            out[name] = _read(source, item_work, label=f"{name}/")
    return {name: out[name] for name in items}


# ---------------------------------------------------------------------------- load_parameters


def _nest(pairs: Sequence[tuple[Row, Any]]) -> Any:
    """A tree of dicts (lists where the keys are 0..n-1) from ``(row, value)`` pairs.

    Rows of flat-key formats (``model.layers.0.weight``) stay flat, keyed by
    their stored name, so every leaf keeps its one path string.
    """
    out: dict[str, Any] = {}
    for row, value in pairs:
        parts = row.path if row.sep == "/" else (row.name,)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1] if parts else ""] = value

    # Dicts keyed 0..n-1 become lists, children before parents; iterative (a name of 3,000 parts nests 3,000 dicts).
    order: list[tuple[Any, Any, dict]] = []
    stack: list[tuple[Any, Any, Any]] = [(None, None, out)]
    while stack:
        parent, key, node = stack.pop()
        if isinstance(node, dict):
            order.append((parent, key, node))
            stack.extend((node, k, v) for k, v in node.items())
    top: Any = out
    for parent, key, node in reversed(order):
        built: Any = node
        if node and list(node) == [str(i) for i in range(len(node))]:
            built = list(node.values())
        if parent is None:
            top = built
        else:
            parent[key] = built
    return top


def load_parameters(
    checkpoint_dir: Any,
    step: int | str | None = -1,
    *,
    use_ema_params: bool = False,
    target: Any = None,
    item: str | None = None,
    sharding: Any = None,
    rules: Rules | None = None,
    fill_missing: Any = None,
    allow_unused: bool = False,
    allow_dtype_cast: bool = False,
    prefix: str | None = None,
    follow_links: bool | None = None,
    read: ReadOptions | ReadContext | None = None,
) -> Any:
    """The params (or EMA params) of one step, without a manager or model code.

    Reads any checkpoint ``treetools inspect`` reads, through the same layer,
    so the keys of ``flatten(load_parameters(...))`` are exactly the paths
    ``treetools inspect --format json`` lists. With ``target=None`` the result
    is the stored tree as nested dicts/lists of host ``numpy`` arrays (boxes
    dropped: ``Dense_0/kernel`` is an array; flat-key files such as
    safetensors give a flat dict of their stored names), readable on any
    machine, whatever devices or topology saved it; with ``rules`` the tree
    the rules make (a renamed leaf keyed by its new path). With a ``target``
    (live or ``make_abstract`` tree, boxes allowed) it is restored like
    ``restore_checkpoint`` (rules, ``fill_missing``, ``allow_unused``,
    ``allow_dtype_cast`` as there): checked, then placed per the target's
    shardings (or ``sharding``). Nothing under ``checkpoint_dir`` is written.
    Whole arrays are what it returns: no memory budget applies unless
    ``read`` gives one, the machine's memory does.

    Args:
      checkpoint_dir: a checkpoint root, one committed step folder, or any
        checkpoint file treetools reads (relative and ``~`` paths work).
      step: a committed step; -1 (or None / "latest") for the latest one.
      use_ema_params: read ``params_ema`` instead of ``params``.
      target: optional tree to restore into.
      item: read this item instead (overrides ``use_ema_params``).
      sharding: with ``target``: one ``Sharding`` for every array, or a tree.
      rules: a ``tt.Rules`` mapping the stored leaves onto the ones returned.
      fill_missing, allow_unused, allow_dtype_cast: with ``target``, as ``restore_checkpoint``.
      prefix: in a folder holding several series of steps (flax's
        ``save_checkpoint(prefix=...)``: ``checkpoint_6`` and ``eval_6``), the
        series to read (default ``checkpoint_``, else the steps named by number alone).
      follow_links: follow symlinks that lead out of the checkpoint (step folders kept on another volume); off
        by default (None: ``read``'s), for checkpoints you trust (docs/untrusted.md says what it gives up).
      read: how to read (``tt.ReadOptions`` or a ``ReadContext``; None: the environment's defaults): threads
        and block size; ``memory_budget`` only when given (whole arrays are the result; with a ``target`` it
        bounds the device blocks held on the host, as in ``restore_checkpoint``).

    Raises:
      CheckpointNotFoundError: (a ``FileNotFoundError``) no such path, no
        committed step, an unknown step (the message lists the available
        steps), or the step has no such item (the message lists the items).
      CheckpointError: not a checkpoint, corrupt, or a single step folder with another ``step`` asked.
      CheckpointMismatchError: ``target`` does not match the checkpoint (the rules' problems among them);
        each leaf is named by its path in ``target``.
      RulesError: without a ``target``, the rules do not fit the checkpoint (there is no plan to report them in).

    >>> import tempfile, numpy as np
    >>> from treetools.checkpoint_jax.manager import get_checkpoint_manager, save_checkpoint
    >>> root = tempfile.mkdtemp()
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=root)
    >>> _ = save_checkpoint(mngr, 5, {"params": {"w": np.arange(3.0)}}, wait=True); mngr.close()
    >>> load_parameters(root)["w"]
    array([0., 1., 2.])
    >>> load_parameters(root, rules=Rules(rename=[("^w$", "dense/kernel")], dtype="float16"))["dense"]["kernel"]
    array([0., 1., 2.], dtype=float16)
    """
    # A path is shown as the user typed it (relative, `~`); anything else path-like (etils.epath) as its location.
    shown = (os.fspath(checkpoint_dir) if isinstance(checkpoint_dir, (str, os.PathLike))
             else location(checkpoint_dir, name="checkpoint_dir"))
    context = context_of(read, prefix=prefix, follow_links=follow_links)
    if read is None or (isinstance(read, ReadOptions) and read.memory_budget is None):
        context = context.replace(memory_budget=UNBOUNDED)  # whole arrays are the result: the machine's memory
    source = open_source(shown, context)
    resolved = source.resolve(step)
    with source.reading(resolved):  # a step pruned while it is read: StepDeletedError naming it
        found, found_at = source.find_params(resolved, item=item, use_ema=use_ema_params)
        if found_at is not None:  # which path of a whole train state the parameters are: said, not guessed silently
            _LOG.info("%s", found_at)
        if target is None:
            if rules is not None and not rules.empty:
                found = map_item(found, rules)[0]
            return _nest(list(zip((leaf.row for leaf in found.leaves), _host_values(found.leaves))))
        # The target is the params tree itself: problems name its paths as the user's target spells them.
        work, plan, problems = _plan_item(found.name, found, target, sharding, rules, fill_missing, allow_unused,
                                          allow_dtype_cast, label="")
        if problems:
            raise CheckpointMismatchError(resolved, source.path, problems)
        return _read(source, work)
