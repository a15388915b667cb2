"""Restore any checkpoint into target trees on any mesh, and load its parameters as numpy.

Everything here reads checkpoints through the one checkpoint layer
(``treetools.ckpt``), so ``load_parameters``, ``restore_checkpoint`` and
``treetools inspect`` agree on which step is the latest and on the path of
every leaf, for every format the layer reads:

* boxes (flax ``Partitioned``, nnx ``Variable``) are never written to disk:
  ``restore_checkpoint`` puts the stored arrays back in the target's boxes;
* checkpoints whose leaves end in ``/value`` (older treetools saves, nnx State
  saved by plain Orbax) are read with that suffix dropped, everywhere;
* each requested item's metadata is read once, and an item not asked for is
  never touched; the whole target is checked before any array is read;
* every array is read straight into its target's sharding: a format's own
  restore where it has one (Orbax's, through ``Source.restore_arrays``), else
  each addressable device's block through the leaves' readers;
* relative and ``~`` paths work everywhere (Orbax itself needs absolute ones).

This module imports neither jax nor orbax at import time: ``load_parameters``
without a target returns numpy arrays without them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from treetools.ckpt import storage
from treetools.ckpt.readers import UNBOUNDED
from treetools.ckpt.source import NO_VALUE, Item, Leaf, Source, open_source, params_of_step
from treetools.errors import CheckpointMismatchError, Mismatch
from treetools.rows import Row, dtype_name

if TYPE_CHECKING:  # type hints only
    import orbax.checkpoint as ocp


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{dtype_name(np.dtype(x.dtype))}{list(x.shape)}"
    return type(x).__name__


@dataclasses.dataclass
class _Target:
    """One target tree flattened (boxes as leaves): each leaf's path string and its unboxed abstract value
    (a ``ShapeDtypeStruct`` with a sharding for arrays; non-arrays as they are), and how to put it back."""

    paths: list[str]
    abstract: list[Any]
    rebuild: Callable[[Mapping[str, Any]], Any]


def _target(target: Any, sharding: Any) -> _Target:
    """Flatten ``target`` on ``sharding`` (or its own shardings; arrays without one are replicated)."""
    # The jax side, imported here only: load_parameters(path) without a target stays numpy-only.
    import jax

    from treetools.abstract import make_abstract
    from treetools.counting import is_array_like
    from treetools.partitioning import rebox, unbox
    from treetools.paths import is_leaf, path_str

    pairs, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_leaf)
    leaves = [x for _, x in pairs]
    paths = [path_str(p) for p, _ in pairs]
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

    def rebuild(values: Mapping[str, Any]) -> Any:
        """The target's structure with each leaf's restored value, inside the leaf's box."""
        return jax.tree_util.tree_unflatten(
            treedef, [rebox(leaf, values[p]) if p in values else leaf for leaf, p in zip(leaves, paths)])

    return _Target(paths, abstract, rebuild)


def _is_key(x: Any) -> bool:
    """A typed PRNG key target (stored as its key data)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and "key<" in str(dtype)


def _compare(name: str, target: _Target, item: Item, *, allow_dtype_cast: bool) -> list[Mismatch]:
    """Every leaf where the target and the checkpoint's leaves disagree."""
    found = {leaf.name: leaf for leaf in item.leaves}
    problems = []
    for path, x in zip(target.paths, target.abstract):
        leaf = found.get(path)
        if leaf is None:
            problems.append(Mismatch(f"{name}/{path}", "missing", _describe(x), "nothing"))
            continue
        if not (hasattr(x, "shape") and hasattr(x, "dtype")) or leaf.reader is None:
            continue
        if _is_key(x):  # typed keys are stored as their key data
            import jax  # a typed key target: jax is loaded already

            x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        shape = tuple(leaf.reader.shape)
        if tuple(x.shape) != shape:
            problems.append(Mismatch(f"{name}/{path}", "shape", str(tuple(x.shape)), str(shape)))
        elif np.dtype(x.dtype) != leaf.reader.dtype and not allow_dtype_cast:
            problems.append(Mismatch(f"{name}/{path}", "dtype", dtype_name(np.dtype(x.dtype)),
                                     dtype_name(leaf.reader.dtype)))
    for path in found.keys() - set(target.paths):
        leaf = found[path]
        shown = f"{leaf.row.dtype}{list(leaf.row.shape)}" if leaf.row.shape is not None else "a value"
        problems.append(Mismatch(f"{name}/{path}", "unexpected", "nothing", shown))
    return sorted(problems, key=lambda p: (p.kind != "missing", p.path))


def _host_value(leaf: Leaf) -> Any:
    """A leaf as host data: an array read whole, a scalar as a Python number, a value as stored."""
    if leaf.reader is not None:
        value = leaf.reader.read_all()
        return value.item() if leaf.row.shape is None and np.ndim(value) == 0 else value
    return None if leaf.value is NO_VALUE else leaf.value


def _reader_values(item: Item, target: _Target) -> dict[str, Any]:
    """``{leaf path: value}`` read through the checkpoint layer's readers.

    An array target with a sharding becomes a ``jax.Array`` assembled shard by
    shard: each addressable device's block is read alone (a replicated block
    once), so a process reads only what its devices hold. Other targets get
    host values.
    """
    import jax  # placing arrays is the jax side

    by_name = {leaf.name: leaf for leaf in item.leaves}
    values = {}
    for path, x in zip(target.paths, target.abstract):
        leaf = by_name[path]
        if leaf.reader is None or not (hasattr(x, "sharding") and hasattr(x, "shape")):
            values[path] = _host_value(leaf)
            continue
        if _is_key(x):  # stored as key data; whole, then wrapped
            data = np.asarray(leaf.reader.read_all())
            # key_impl takes arrays only; an abstract key's dtype carries its impl
            impl = jax.random.key_impl(x) if isinstance(x, jax.Array) else x.dtype._impl
            values[path] = jax.device_put(jax.random.wrap_key_data(data, impl=impl), x.sharding)
            continue
        reader, dtype, blocks = leaf.reader, np.dtype(x.dtype), {}

        def block(index: Any, reader: Any = reader, dtype: Any = dtype, blocks: dict = blocks) -> np.ndarray:
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in blocks:
                blocks[key] = np.asarray(reader.read(tuple(index))).astype(dtype, copy=False)
            return blocks[key]

        values[path] = jax.make_array_from_callback(tuple(x.shape), x.sharding, block)
    return values


def _place(source: Source, step: int | None, item: Item, target: Any, sharding: Any, allow_dtype_cast: bool,
           problems: list[Mismatch]) -> Callable[[], Any] | None:
    """Check ``target`` against one pytree item (adding to ``problems``); return what reads it, later.

    Nothing is read here: the caller raises every problem of every item at
    once, before any array is read.
    """
    plan = _target(target, sharding)
    found = _compare(item.name, plan, item, allow_dtype_cast=allow_dtype_cast)
    problems += found
    if found:
        return None

    def read() -> Any:
        own = source.restore_arrays(item, dict(zip(plan.paths, plan.abstract)))
        return plan.rebuild(own if own is not None else _reader_values(item, plan))

    return read


def _open(manager: Any) -> tuple[Source, Any]:
    """The source a manager (its pending save waited for) or a path names, and how to name it in errors."""
    if hasattr(manager, "directory") and hasattr(manager, "wait_until_finished"):
        manager.wait_until_finished()  # a pending async save may be the latest step
        return open_source(storage.location(manager.directory, name="manager")), manager.directory
    return open_source(storage.location(manager, name="manager")), manager


def restore_checkpoint(
    manager: "ocp.CheckpointManager | str | os.PathLike",
    step: int | str | None,
    items: Mapping[str, Any],
    *,
    sharding: Any = None,
    allow_dtype_cast: bool = False,
) -> dict[str, Any]:
    """Restore named items of a step into their targets' structure, dtypes and shardings.

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

    Before reading any array, every target is checked against the checkpoint's
    metadata; all missing, unexpected, mis-shaped and (unless
    ``allow_dtype_cast``) mis-typed leaves are reported in one error. Only the
    requested items are read, each item's metadata once.

    Args:
      manager: from ``get_checkpoint_manager``, any Orbax ``CheckpointManager``
        (a pending async save is waited for), or any checkpoint path or URL.
      step: a committed step; None, -1 or ``"latest"`` for the latest committed
        one (incomplete saves are never picked).
      items: name -> target tree; JSON items (``data_iter``) may map to None and
        come back as dicts.
      sharding: one ``Sharding`` for every array, or ``{name: Sharding or tree
        of Shardings}``; overrides the targets' own shardings.
      allow_dtype_cast: let a target dtype differ from the stored one (e.g. bf16
        params from an fp32 checkpoint); values are converted on read.

    Returns:
      name -> restored tree (JSON items as dicts).

    Raises:
      CheckpointNotFoundError: (a ``FileNotFoundError``) no such committed step (the message lists them).
      CheckpointMismatchError: (a ``ValueError``) targets do not match.
      ValueError: ``sharding`` is a dict whose keys are not item names, or a pytree target is None.

    >>> import tempfile, jax
    >>> from treetools.manager import get_checkpoint_manager, save_checkpoint
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=tempfile.mkdtemp())
    >>> _ = save_checkpoint(mngr, 1, {"params": {"w": jax.numpy.arange(4.0)}, "data_iter": {"epoch": 2}})
    >>> out = restore_checkpoint(mngr, "latest", {"params": {"w": jax.numpy.zeros(4)}, "data_iter": None})
    >>> out["params"]["w"].tolist(), out["data_iter"]
    ([0.0, 1.0, 2.0, 3.0], {'epoch': 2})
    >>> mngr.close()
    """
    if not isinstance(items, Mapping) or not items:
        raise ValueError("`items` must be a non-empty dict of item name -> target tree (or None for JSON items).")
    if isinstance(sharding, Mapping) and not set(sharding) <= set(items):
        raise ValueError(
            f"`sharding` keys {sorted(set(sharding) - set(items))} are not in `items` {list(items)}; "
            "pass one Sharding, or {item name: Sharding or tree of Shardings}."
        )
    source, display = _open(manager)
    resolved = source.resolve(step)
    with source.reading(resolved):  # a step pruned while it is read: StepDeletedError naming it
        present = source.item_names(resolved)
        problems = [Mismatch(name, "missing", f"item {name!r}", f"items {present}")
                    for name in items if name not in present]
        snap = source.snapshot(resolved, [name for name in items if name in present])
        out: dict[str, Any] = {}
        reads = {}
        for name, target in items.items():
            item = snap.items.get(name)
            if item is None:
                continue
            if item.kind == "json":
                out[name] = item.value
                continue
            if target is None:
                raise ValueError(
                    f"`items[{name!r}]` is None, but {name!r} is a pytree item; pass the live tree or "
                    "make_abstract(...) to restore into, or use load_parameters() for host numpy arrays."
                )
            item_sharding = sharding.get(name) if isinstance(sharding, Mapping) else sharding
            reads[name] = _place(source, resolved, item, target, item_sharding, allow_dtype_cast, problems)
        if problems:
            raise CheckpointMismatchError(resolved, display, problems)
        for name, read in reads.items():
            out[name] = read()
    return {name: out[name] for name in items}


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

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = {k: lists(v) for k, v in node.items()}
        if node and list(node) == [str(i) for i in range(len(node))]:
            return list(node.values())
        return node

    return lists(out)


def load_parameters(
    checkpoint_dir: Any,
    step: int | str | None = -1,
    *,
    use_ema_params: bool = False,
    target: Any = None,
    item: str | None = None,
    sharding: Any = None,
    allow_dtype_cast: bool = False,
) -> Any:
    """The params (or EMA params) of one step, without a manager or model code.

    Reads any checkpoint ``treetools inspect`` reads, through the same layer,
    so the keys of ``flatten(load_parameters(...))`` are exactly the paths
    ``treetools inspect --format json`` lists. With ``target=None`` the result
    is the stored tree as nested dicts/lists of host ``numpy`` arrays (boxes
    dropped: ``Dense_0/kernel`` is an array; flat-key files such as
    safetensors give a flat dict of their stored names), readable on any
    machine, whatever devices or topology saved it. With a ``target`` (live or
    ``make_abstract`` tree, boxes allowed) it is restored like
    ``restore_checkpoint``: checked, then placed per the target's shardings
    (or ``sharding``). Nothing under ``checkpoint_dir`` is written. Whole
    arrays are what it returns: no memory budget applies, the machine's memory does.

    Args:
      checkpoint_dir: a checkpoint root, one committed step folder, or any
        checkpoint file treetools reads (relative and ``~`` paths work).
      step: a committed step; -1 (or None / "latest") for the latest one.
      use_ema_params: read ``params_ema`` instead of ``params``.
      target: optional tree to restore into.
      item: read this item instead (overrides ``use_ema_params``).
      sharding: with ``target``: one ``Sharding`` for every array, or a tree.
      allow_dtype_cast: with ``target``: allow a dtype change on read.

    Raises:
      CheckpointNotFoundError: (a ``FileNotFoundError``) no such path, no
        committed step, an unknown step (the message lists the available
        steps), or the step has no such item (the message lists the items).
      CheckpointError: not a checkpoint, corrupt, or a single step folder with another ``step`` asked.
      CheckpointMismatchError: ``target`` does not match the checkpoint.

    >>> import tempfile, numpy as np
    >>> from treetools.manager import get_checkpoint_manager, save_checkpoint
    >>> root = tempfile.mkdtemp()
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=root)
    >>> _ = save_checkpoint(mngr, 5, {"params": {"w": np.arange(3.0)}}, wait=True); mngr.close()
    >>> load_parameters(root)["w"]
    array([0., 1., 2.])
    """
    source = open_source(storage.location(checkpoint_dir, name="checkpoint_dir"), memory_budget=UNBOUNDED)
    if isinstance(checkpoint_dir, (str, os.PathLike)):
        source.path = os.fspath(checkpoint_dir)
    resolved = source.resolve(step)
    with source.reading(resolved):  # a step pruned while it is read: StepDeletedError naming it
        found = params_of_step(source, resolved, item=item, use_ema=use_ema_params)
        if target is None:
            return _nest([(leaf.row, _host_value(leaf)) for leaf in found.leaves])
        problems: list[Mismatch] = []
        read = _place(source, resolved, found, target, sharding, allow_dtype_cast, problems)
        if problems or read is None:
            raise CheckpointMismatchError(resolved, source.path, problems)
        return read()
