"""Orbax checkpoints: a manager, saving, restore into abstract targets on any mesh, load_parameters.

Everything here reads checkpoints through the one checkpoint layer
(``treetools.inspect.source``) and the one step rule (``treetools.steps``),
so ``load_parameters``, ``restore_checkpoint``, the manager that
``get_checkpoint_manager`` returns and ``treetools inspect`` agree on which
step is the latest and on the path of every leaf:

* boxes (flax ``Partitioned``, nnx ``Variable``) are never written to disk:
  ``save_checkpoint`` stores the arrays they hold and ``restore_checkpoint``
  puts them back in the target's boxes;
* checkpoints whose leaves end in ``/value`` (older treetools saves, nnx State
  saved by plain Orbax) are read with that suffix dropped, everywhere;
* ``restore_checkpoint`` reads each requested item's metadata once, never
  touches an item it was not asked for, and works with any Orbax
  ``CheckpointManager`` (or a checkpoint root path);
* relative and ``~`` paths work everywhere (Orbax itself needs absolute ones).

This module imports neither jax nor orbax at import time.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from treetools import storage
from treetools.errors import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError, Mismatch
from treetools.steps import (
    COMMIT_SUCCESS_FILE,
    PYTREE_METADATA_FILE,
    STEP_METADATA_FILE,
    TMP_DIR_SUFFIX,
    is_committed,
    latest_step,
    list_incomplete,
    list_steps,
    parse_step_name,
    scan_steps,
)

if TYPE_CHECKING:  # type hints only; jax and orbax are imported inside functions
    import jax
    import orbax.checkpoint as ocp

__all__ = [
    "CheckpointMismatchError",
    "DEFAULT_ITEMS",
    "DEFAULT_JSON_ITEMS",
    "Mismatch",
    "get_checkpoint_manager",
    "is_committed_step_dir",
    "latest_step",
    "list_incomplete",
    "list_steps",
    "load_parameters",
    "parse_step_name",
    "restore_checkpoint",
    "save_checkpoint",
    "scan_steps",
]

DEFAULT_ITEMS = ("params", "params_ema", "opt_state", "data_iter")
"""Items a manager from ``get_checkpoint_manager`` knows unless told otherwise."""
DEFAULT_JSON_ITEMS = ("data_iter",)
"""Items saved as JSON (a dict of numbers, strings, lists): data iterator / trainer state."""

is_committed_step_dir = is_committed  # the name treetools 0.1 exported


def _local(path: Any, name: str = "checkpoint_dir") -> str:
    """An absolute local path from a str/PathLike/epath, ``~`` expanded (Orbax needs absolute paths),
    or a ``gs://`` / ``s3://`` URL as it is."""
    if isinstance(path, (str, os.PathLike)):
        return storage.normalize(os.fspath(path))
    if hasattr(path, "as_posix"):  # etils.epath.Path
        return storage.normalize(str(path) if storage.is_remote(str(path)) else path.as_posix())
    raise TypeError(f"`{name}` must be a path, got {type(path).__name__}.")


def _as_int(value: Any) -> int | None:
    import operator

    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


# --------------------------------------------------------------------------
# Manager and saving
# --------------------------------------------------------------------------

# (item names, JSON item names) of the managers built here; other items are decided by content.
_MANAGER_ITEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _StepNameFormat:
    """Orbax's step ``NameFormat`` with treetools' step rule: Orbax names, treetools' commit rule.

    The manager's ``all_steps()``/``latest_step()`` then list exactly the steps
    ``treetools.steps.scan_steps`` calls committed.
    """

    def __init__(self, step_prefix: str | None, step_format_fixed_length: int | None):
        import orbax.checkpoint as ocp

        self.step_prefix = step_prefix
        self._standard = ocp.step.standard_name_format(
            step_prefix=step_prefix, step_format_fixed_length=step_format_fixed_length
        )

    def __str__(self) -> str:
        return f"treetools step rule over {self._standard}"

    def build_name(self, step: int) -> str:
        return self._standard.build_name(step)

    def find_all(self, base_path: Any) -> Iterable[Any]:
        import orbax.checkpoint as ocp
        from etils import epath

        listing = scan_steps(os.fspath(base_path), step_prefix=self.step_prefix)
        return [ocp.step.Metadata(step=s, path=epath.Path(p)) for s, p in listing.committed.items()]

    def find_step(self, base_path: Any, step: int) -> Any:
        for meta in self.find_all(base_path):
            if meta.step == step:
                return meta
        raise ValueError(f"no committed step {step} under {base_path}.")


def _positive_int(value: Any, name: str, *, optional: bool = False) -> int | None:
    if optional and value is None:
        return None
    number = _as_int(value)
    if number is None or number < 1:
        raise ValueError(f"`{name}` must be a positive integer{' or None' if optional else ''}, got {value!r}.")
    return number


def get_checkpoint_manager(
    ckpt_frequency: int,
    max_to_keep: int | None = None,
    save_frequency: int | None = None,
    checkpoint_dir: Any = None,
    *,
    item_names: Iterable[str] = DEFAULT_ITEMS,
    json_items: Iterable[str] = DEFAULT_JSON_ITEMS,
    async_save: bool = True,
    step_prefix: str | None = None,
    step_format_fixed_length: int | None = None,
    read_only: bool = False,
    **options: Any,
) -> "ocp.CheckpointManager":
    """An Orbax ``CheckpointManager`` for params, EMA params, optimizer state and JSON state.

    Saves happen at every multiple of ``ckpt_frequency`` (``manager.save`` on
    other steps is a no-op unless forced); the newest ``max_to_keep`` steps are
    kept, and, with ``save_frequency``, every multiple of it is kept for good
    (Orbax's ``LatestN`` + ``EveryNSteps`` preservation).

    Args:
      ckpt_frequency: save every this many steps.
      max_to_keep: keep this many of the newest steps (None: keep all).
      save_frequency: also keep every step that is a multiple of this, forever;
        must be a multiple of ``ckpt_frequency`` so that such steps get saved.
      checkpoint_dir: the root folder; required (a run's own folder, e.g.
        ``workdir / "checkpoints"``; no shared default that runs could clobber).
      item_names: items the manager saves and restores.
      json_items: those of ``item_names`` stored as JSON (``ocp.args.JsonSave``);
        the others are pytrees (``ocp.args.StandardSave``).
      async_save: write in a background thread (Orbax async checkpointing);
        ``manager.wait_until_finished()`` blocks until the save is committed.
      step_prefix: step folders named ``<prefix>_<step>``.
      step_format_fixed_length: zero-pad step numbers to this many digits.
      read_only: never save or delete (for readers of someone else's run).
      **options: further ``ocp.CheckpointManagerOptions`` fields.

    Returns:
      the manager; use it with ``save_checkpoint`` and ``restore_checkpoint``.

    Raises:
      ValueError: a bad frequency, a ``save_frequency`` that is not a multiple of
        ``ckpt_frequency``, no ``checkpoint_dir``, or a JSON item not in ``item_names``.

    >>> import tempfile
    >>> mngr = get_checkpoint_manager(100, max_to_keep=3, save_frequency=1000, checkpoint_dir=tempfile.mkdtemp())
    >>> mngr.should_save(200), mngr.should_save(250)
    (True, False)
    >>> mngr.close()
    """
    ckpt_frequency = _positive_int(ckpt_frequency, "ckpt_frequency")
    max_to_keep = _positive_int(max_to_keep, "max_to_keep", optional=True)
    save_frequency = _positive_int(save_frequency, "save_frequency", optional=True)
    if save_frequency is not None and save_frequency % ckpt_frequency:
        raise ValueError(
            f"`save_frequency` ({save_frequency}) must be a multiple of `ckpt_frequency` ({ckpt_frequency}); "
            f"steps kept for good must be steps that get saved, e.g. save_frequency={ckpt_frequency * max(1, round(save_frequency / ckpt_frequency))}."
        )
    if checkpoint_dir is None:
        raise ValueError("`checkpoint_dir` is required; pass the run's checkpoint folder, e.g. workdir / 'checkpoints'.")
    item_names, json_items = tuple(item_names), frozenset(json_items)
    if not json_items <= set(item_names):
        raise ValueError(f"`json_items` {sorted(json_items - set(item_names))} are not in `item_names` {list(item_names)}.")

    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_managers as cm

    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for name in item_names:
        if name in json_items:
            handler, save, restore = ocp.JsonCheckpointHandler(), ocp.args.JsonSave, ocp.args.JsonRestore
        else:
            handler, save, restore = ocp.StandardCheckpointHandler(), ocp.args.StandardSave, ocp.args.StandardRestore
        registry.add(name, save, handler)
        registry.add(name, restore, handler)

    keep = [cm.LatestN(n=max_to_keep)]
    if save_frequency is not None:
        keep.append(cm.EveryNSteps(interval_steps=save_frequency))
    options.setdefault(
        # Orbax's default also saves the first step it sees; a trainer expects multiples only.
        "save_decision_policy",
        cm.AnySavePolicy([cm.FixedIntervalPolicy(ckpt_frequency), cm.PreemptionCheckpointingPolicy()]),
    )
    options.setdefault("preservation_policy", cm.AnyPreservationPolicy(keep))
    options.setdefault("step_name_format", _StepNameFormat(step_prefix, step_format_fixed_length))
    manager_options = ocp.CheckpointManagerOptions(
        save_interval_steps=ckpt_frequency,
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
        **options,
    )
    directory = _local(checkpoint_dir)
    manager = ocp.CheckpointManager(directory, options=manager_options, handler_registry=registry)
    _MANAGER_ITEMS[manager] = (frozenset(item_names), json_items)
    return manager



def _as_json(name: str, tree: Any) -> Any:
    """``tree`` as it will read back from JSON: numpy / jax numbers and arrays become Python ones.

    Checked here, before Orbax starts: its JSON writer runs in a background
    thread, where a ``np.int64`` epoch counter fails late and leaves a tmp folder.
    """
    import numpy as np

    from treetools.counting import is_array_like

    def plain(x: Any) -> Any:
        if is_array_like(x):
            return np.asarray(x).tolist()
        raise TypeError(f"`{type(x).__name__}` values are not JSON")

    try:
        return json.loads(json.dumps(tree, default=plain))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`items[{name!r}]` is saved as JSON, but {e}; keep it to numbers, strings, lists and dicts, "
            "or save it as a pytree item."
        ) from None


def _check_savable(name: str, tree: Any) -> None:
    """Raise before Orbax starts (and leaves a tmp folder behind) on leaves it cannot save."""
    from treetools.counting import is_array_like
    from treetools.partitioning import unbox
    from treetools.paths import leaves_with_paths

    empty = [p for p, x in leaves_with_paths(tree) if is_array_like(x) and 0 in unbox(x).shape]
    if empty:
        raise ValueError(
            f"`items[{name!r}]` has zero-size arrays, which Orbax cannot save: {empty[:5]}; "
            "drop those leaves or replace them with None."
        )


def _is_json_item(manager: Any, name: str, tree: Any) -> bool:
    """JSON when the manager registered ``name`` as JSON; else a dict without arrays."""
    names, json_names = _MANAGER_ITEMS.get(manager, ((), ()))
    if name in names:
        return name in json_names
    import jax

    from treetools.counting import is_array_like

    return isinstance(tree, Mapping) and not any(is_array_like(x) for x in jax.tree.leaves(tree))


def save_checkpoint(
    manager: "ocp.CheckpointManager",
    step: int,
    items: Mapping[str, Any],
    *,
    force: bool = False,
    wait: bool = False,
    metrics: Mapping[str, Any] | None = None,
) -> bool:
    """Save named items at ``step`` through ``manager``; returns whether it saved.

    Pytrees (params, EMA, optimizer state; arrays may be sharded across
    processes) go through ``ocp.args.StandardSave`` with every box replaced by
    the array it holds (boxes are never written to disk; ``restore_checkpoint``
    puts them back); JSON items through ``ocp.args.JsonSave``, numpy / jax
    numbers in them stored as Python ones. Which is which: the manager's
    ``json_items`` when it came from ``get_checkpoint_manager``, otherwise a
    dict with no array leaves is JSON. ``None`` items are skipped. Every
    process must call this (Orbax coordinates multi-process saves).

    What happens, and what it returns:

    * ``True``: the step was saved (or, with an async manager, the save started;
      ``wait=True`` blocks until it is committed).
    * ``False``, silently: ``step`` is not a save step of the manager's policy
      (not a multiple of ``ckpt_frequency``), which a training loop that calls
      this every step relies on. ``force=True`` saves anyway.
    * ``False`` with a warning: the step is already saved (e.g. after a resume).

    Args:
      manager: from ``get_checkpoint_manager`` (or any Orbax ``CheckpointManager``).
      step: the training step.
      items: name -> pytree or JSON dict.
      force: save even when ``step`` is not a multiple of ``ckpt_frequency``.
      wait: block until the save is committed.
      metrics: numbers stored with the step (in its ``_CHECKPOINT_METADATA``),
        shown by ``treetools inspect``; stored whether or not the manager has a ``best_fn``.

    Raises:
      ValueError: a pytree item holds zero-size arrays (Orbax cannot save them).
      TypeError: a JSON item holds something JSON cannot store.
      Both are raised before anything is written.

    >>> import tempfile, numpy as np
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=tempfile.mkdtemp())
    >>> save_checkpoint(mngr, 1, {"params": {"w": np.ones(2)}, "data_iter": {"epoch": 0}}, wait=True)
    True
    >>> mngr.close()
    """
    import orbax.checkpoint as ocp

    from treetools.partitioning import unbox_tree

    number = _as_int(step)
    if number is None or number < 0:
        raise TypeError(f"`step` must be a non-negative integer, got {step!r}.")
    args = {}
    for name, tree in items.items():
        if tree is None:
            continue
        if _is_json_item(manager, name, tree):
            args[name] = ocp.args.JsonSave(_as_json(name, tree))
        else:
            _check_savable(name, tree)
            args[name] = ocp.args.StandardSave(unbox_tree(tree))
    stored_metrics = _as_json("metrics", dict(metrics)) if metrics is not None else None
    if number in (manager.all_steps() or ()):
        warnings.warn(f"step {number} is already saved under {manager.directory}; not saved again "
                      "(restore it, or save at a later step).", stacklevel=2)
        return False
    saved = manager.save(number, args=ocp.args.Composite(**args), force=force, metrics=stored_metrics,
                         custom_metadata={"metrics": stored_metrics} if stored_metrics else None)
    if wait:
        manager.wait_until_finished()
    return bool(saved)


# --------------------------------------------------------------------------
# Restoring
# --------------------------------------------------------------------------


def _describe(x: Any) -> str:
    import numpy as np

    from treetools.rows import dtype_name

    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{dtype_name(np.dtype(x.dtype))}{list(x.shape)}"
    return type(x).__name__


def _default_sharding() -> "jax.sharding.Sharding":
    """Replicated over every device of every process: valid single- and multi-process."""
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("devices",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _target_leaves(name: str, target: Any, sharding: Any) -> tuple[Any, list[Any], list[str], list[Any]]:
    """``(treedef, leaves, paths, abstract)``: the target flattened with boxes as leaves, each leaf's
    path string, and its unboxed ``ShapeDtypeStruct`` with a sharding (non-arrays kept as they are)."""
    import jax

    from treetools.abstract import make_abstract
    from treetools.counting import is_array_like
    from treetools.partitioning import unbox
    from treetools.paths import is_leaf, path_str

    if isinstance(sharding, Mapping):
        sharding = sharding.get(name)
    abstract_tree = make_abstract(target, sharding)
    pairs, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_leaf)
    abstract_leaves = jax.tree_util.tree_leaves(abstract_tree, is_leaf=is_leaf)
    default = None
    abstract = []
    for leaf in abstract_leaves:
        value = unbox(leaf)
        if is_array_like(value) and getattr(value, "sharding", None) is None:
            default = default or _default_sharding()
            value = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=default)
        abstract.append(value)
    return treedef, [x for _, x in pairs], [path_str(p) for p, _ in pairs], abstract


def _compare(name: str, paths: Sequence[str], abstract: Sequence[Any], item: Any, *, allow_dtype_cast: bool
             ) -> list[Mismatch]:
    """Every leaf where the target and the checkpoint's leaves disagree."""
    import jax
    import numpy as np

    from treetools.counting import is_array_like

    found = {leaf.name: leaf for leaf in item.leaves}
    problems = []
    for path, x in zip(paths, abstract):
        leaf = found.get(path)
        if leaf is None:
            problems.append(Mismatch(f"{name}/{path}", "missing", _describe(x), "nothing"))
            continue
        if not is_array_like(x) or leaf.reader is None:
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys are stored as their key data
            x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        shape = tuple(leaf.reader.shape)
        if tuple(x.shape) != shape:
            problems.append(Mismatch(f"{name}/{path}", "shape", str(tuple(x.shape)), str(shape)))
        elif np.dtype(x.dtype) != leaf.reader.dtype and not allow_dtype_cast:
            problems.append(Mismatch(f"{name}/{path}", "dtype", _describe(x).split("[")[0],
                                     _describe(np.empty(0, leaf.reader.dtype)).split("[")[0]))
    for path in found.keys() - set(paths):
        leaf = found[path]
        shown = f"{leaf.row.dtype}{list(leaf.row.shape)}" if leaf.row.shape is not None else "a value"
        problems.append(Mismatch(f"{name}/{path}", "unexpected", "nothing", shown))
    return sorted(problems, key=lambda p: (p.kind != "missing", p.path))


def _orbax_restore(item: Any, by_path: dict[str, Any]) -> dict[str, Any]:
    """Read one Orbax pytree item into ``{leaf path: array}``, each array per its abstract target.

    Orbax restores the tree as it is stored (its own structure, ``kernel/value``
    nodes of older saves included); treetools maps stored names to leaf paths.
    The ``_METADATA`` that the checkpoint layer already parsed is handed to
    Orbax, so the file is read once.
    """
    import jax
    import orbax.checkpoint as ocp
    from etils import epath
    from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as base
    from orbax.checkpoint._src.metadata import tree as tree_metadata

    from treetools.counting import is_array_like
    from treetools.paths import path_parts

    handle = item.handle

    class _ParsedMetadata(base.BasePyTreeCheckpointHandler):
        async def _read_metadata_file(self, directory: Any) -> Any:
            return tree_metadata.InternalTreeMetadata.from_json(
                handle.metadata, pytree_metadata_options=self._pytree_metadata_options
            )

    handler = _ParsedMetadata()
    stored = tree_metadata.InternalTreeMetadata.from_json(
        handle.metadata, pytree_metadata_options=handler._pytree_metadata_options
    ).as_nested_tree()

    def leaf_path(keypath: Any) -> str | None:
        logical = handle.logical.get(".".join(path_parts(keypath)))
        return "/".join(logical) if logical is not None else None

    def restore_arg(keypath: Any, _meta: Any) -> Any:
        target = by_path.get(leaf_path(keypath) or "")
        if is_array_like(target):
            return ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=target.sharding,
                                        global_shape=tuple(target.shape), dtype=target.dtype)
        return ocp.RestoreArgs()

    restore_args = jax.tree_util.tree_map_with_path(restore_arg, stored)
    try:
        restored = handler.restore(epath.Path(handle.folder),
                                   args=base.BasePyTreeRestoreArgs(item=None, restore_args=restore_args))
    finally:
        handler.close()
    out = {}
    for keypath, value in jax.tree_util.tree_flatten_with_path(restored)[0]:
        path = leaf_path(keypath)
        if path is not None:
            out[path] = value
    return out


def _open_orbax(root: str, display: Any) -> Any:
    from treetools.inspect.source import open_source

    source = open_source(root)
    if source.format != "orbax":
        raise CheckpointError(
            f"{display}: a {source.format} checkpoint, not an Orbax one; restore_checkpoint reads Orbax checkpoints "
            "(use load_parameters(path, target=...) for other formats)."
        )
    return source


def restore_checkpoint(
    manager: "ocp.CheckpointManager | str | os.PathLike",
    step: int | str | None,
    items: Mapping[str, Any],
    *,
    sharding: Any = None,
    allow_dtype_cast: bool = False,
) -> dict[str, Any]:
    """Restore named items of a step into their targets' structure, dtypes and shardings.

    Each pytree target may be the live tree (arrays), an abstract one
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
        (a pending async save is waited for), or a checkpoint root / step folder path.
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

    >>> import tempfile, numpy as np, jax
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
    if hasattr(manager, "directory") and hasattr(manager, "wait_until_finished"):
        manager.wait_until_finished()  # a pending async save may be the latest step
        display: Any = manager.directory
        root = _local(manager.directory, "manager")
    else:
        display, root = manager, _local(manager, "manager")
    source = _open_orbax(root, display)
    resolved = source.resolve(step)
    with source.reading(resolved):  # a step pruned while it is read: StepDeletedError naming it
        present = source.item_names(resolved)
        problems = [Mismatch(name, "missing", f"item {name!r}", f"items {present}")
                    for name in items if name not in present]
        snap = source.snapshot(resolved, [name for name in items if name in present])
        out: dict[str, Any] = {}
        plans = {}
        for name, target in items.items():
            item = snap.items.get(name)
            if item is None:
                continue
            if item.kind == "json":
                out[name] = item.handle
                continue
            plans[name], item_problems = _plan(name, item, target, sharding, allow_dtype_cast)
            problems += item_problems
        if problems:
            raise CheckpointMismatchError(resolved, display, problems)
        for name, plan in plans.items():
            out[name] = _restore_plan(*plan)
    return {name: out[name] for name in items}


def _plan(name: str, item: Any, target: Any, sharding: Any, allow_dtype_cast: bool) -> tuple[tuple, list[Mismatch]]:
    """What restoring ``target`` from one pytree item needs, and every mismatch (nothing is read yet)."""
    if target is None:
        raise ValueError(
            f"`items[{name!r}]` is None, but {name!r} is a pytree item; pass the live tree or make_abstract(...) "
            "to restore into, or use load_parameters() for host numpy arrays."
        )
    treedef, leaves, paths, abstract = _target_leaves(name, target, sharding)
    problems = _compare(name, paths, abstract, item, allow_dtype_cast=allow_dtype_cast)
    return (item, treedef, leaves, paths, abstract), problems


def _restore_plan(item: Any, treedef: Any, leaves: Sequence[Any], paths: Sequence[str], abstract: Sequence[Any]) -> Any:
    if storage.is_remote(getattr(item.handle, "folder", "")):
        # Orbax reads gs:// only, and not through the emulator and endpoint variables: a bucket is read
        # through treetools' own readers (TensorStore's gcs/s3 stores), each device's shard alone.
        return _rebuild(treedef, leaves, paths, _reader_values(item, paths, abstract))
    return _rebuild(treedef, leaves, paths, _orbax_restore(item, dict(zip(paths, abstract))))


def _reader_values(item: Any, paths: Sequence[str], abstract: Sequence[Any]) -> dict[str, Any]:
    """``{leaf path: value}`` read through the checkpoint layer's readers.

    An array target with a sharding becomes a ``jax.Array`` assembled shard by
    shard: each addressable device's block is read alone (a replicated block
    once), so a process reads only what its devices hold. Other targets get
    host values.
    """
    import jax
    import numpy as np

    by_name = {leaf.name: leaf for leaf in item.leaves}
    values = {}
    for path, x in zip(paths, abstract):
        leaf = by_name[path]
        if leaf.reader is None or not (hasattr(x, "sharding") and hasattr(x, "shape")):
            values[path] = _host_value(leaf)
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # stored as key data; whole, then wrapped
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


def _rebuild(treedef: Any, leaves: Sequence[Any], paths: Sequence[str], values: Mapping[str, Any]) -> Any:
    """The target's structure with each leaf's restored value, inside the leaf's box."""
    import jax

    from treetools.partitioning import rebox

    return jax.tree_util.tree_unflatten(
        treedef, [rebox(leaf, values[p]) if p in values else leaf for leaf, p in zip(leaves, paths)]
    )


# --------------------------------------------------------------------------
# load_parameters
# --------------------------------------------------------------------------


_STATE_ITEMS = ("state", "default", "train_state")
"""Item names that hold a whole train state (Orbax's legacy and v1 training APIs, a single-item manager)."""


def _params_item(source: Any, step: int | None, item: str | None, use_ema_params: bool) -> str:
    """Which item holds the parameters: ``item`` if given; else ``params`` / ``params_ema`` (T5X: ``target``);
    else a lone item."""
    names = source.item_names(step)
    if item is not None:
        if item not in names:
            raise source.missing_item(item, names, step)
        return item
    wanted = "params_ema" if use_ema_params else "params"
    if wanted in names:
        return wanted
    if not use_ema_params and "target" in names:  # T5X: the model parameters are the item `target`
        return "target"
    if len(names) == 1:  # a single-tree file, or a standalone Orbax save (item `default`)
        return names[0]
    whole = [n for n in names if n in _STATE_ITEMS]
    if len(whole) == 1:  # one item holds the whole train state, beside others (a best_fn manager's `metrics`)
        return whole[0]
    where = f"{source.path} (step {step})" if step is not None else source.path
    raise CheckpointNotFoundError(
        f"{where} has no item {wanted!r}; items present: {', '.join(names) or 'none'}; pass item=NAME."
    )


def _host_value(leaf: Any) -> Any:
    import numpy as np

    from treetools.inspect.source import NO_VALUE

    if leaf.reader is not None:
        value = leaf.reader.read_all()
        return value.item() if leaf.row.shape is None and np.ndim(value) == 0 else value
    return None if leaf.value is NO_VALUE else leaf.value


def _nest(pairs: Sequence[tuple[Any, Any]]) -> Any:
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
    (or ``sharding``). Nothing under ``checkpoint_dir`` is written.

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
    >>> root = tempfile.mkdtemp()
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=root)
    >>> _ = save_checkpoint(mngr, 5, {"params": {"w": np.arange(3.0)}}, wait=True); mngr.close()
    >>> load_parameters(root)["w"]
    array([0., 1., 2.])
    """
    from treetools.inspect.arrays import whole_reads

    with whole_reads():  # whole arrays are what it returns: held to the machine's memory, not the block budget
        return _load_parameters(checkpoint_dir, step, use_ema_params, target, item, sharding, allow_dtype_cast)


def _load_parameters(checkpoint_dir: Any, step: Any, use_ema_params: bool, target: Any, item: str | None,
                     sharding: Any, allow_dtype_cast: bool) -> Any:
    from treetools.inspect.source import open_source

    source = open_source(_local(checkpoint_dir))
    source.path = os.fspath(checkpoint_dir) if isinstance(checkpoint_dir, (str, os.PathLike)) else source.path
    resolved = source.resolve(step)
    with source.reading(resolved):  # a step pruned while it is read: StepDeletedError naming it
        name = _params_item(source, resolved, item, use_ema_params)
        found = source.snapshot(resolved, [name]).items[name]
        if item is None and name not in ("params", "params_ema"):
            found = _params_subtree(found, use_ema_params)
        if target is None:
            return _nest([(leaf.row, _host_value(leaf)) for leaf in found.leaves])
        if source.format == "orbax":
            plan = _plan(name, found, target, {name: sharding} if sharding is not None else None, allow_dtype_cast)
            if plan[1]:
                raise CheckpointMismatchError(resolved, source.path, plan[1])
            return _restore_plan(*plan[0])
        return _place(source, resolved, name, found, target, sharding, allow_dtype_cast)


_PARAM_SUBTREES = {False: ("params", "target"), True: ("params_ema", "ema_params", "ema")}
"""Where real layouts keep the parameters inside one item holding a whole train state (T5X: ``target``)."""


def _params_subtree(item: Any, use_ema_params: bool) -> Any:
    """The ``params`` (or EMA) subtree of an item holding a whole train state; the item itself when it has none."""
    import dataclasses

    if any(leaf.row.sep != "/" for leaf in item.leaves):  # flat stored names (safetensors): never split
        return item
    tops = [leaf.path[0] for leaf in item.leaves if len(leaf.path) > 1]
    for key in _PARAM_SUBTREES[use_ema_params]:
        if key in tops:
            leaves = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[1:]))
                      for leaf in item.leaves if len(leaf.path) > 1 and leaf.path[0] == key]
            handle = item.handle
            if hasattr(handle, "logical"):  # an Orbax item: its stored names now map to paths below `key`
                handle = dataclasses.replace(handle, logical={p: path[1:] for p, path in handle.logical.items()
                                                              if len(path) > 1 and path[0] == key})
            return dataclasses.replace(item, leaves=leaves, handle=handle)
    if use_ema_params:
        raise CheckpointNotFoundError(
            f"item `{item.name}` holds no EMA parameters (looked for {', '.join(_PARAM_SUBTREES[True])}); "
            f"its top-level keys: {', '.join(dict.fromkeys(leaf.path[0] for leaf in item.leaves if leaf.path))}."
        )
    return item


def _place(source: Any, step: int | None, name: str, item: Any, target: Any, sharding: Any,
           allow_dtype_cast: bool) -> Any:
    """A non-Orbax item checked against ``target`` and read onto its shardings, shard by shard."""
    treedef, leaves, paths, abstract = _target_leaves(name, target, {name: sharding})
    problems = _compare(name, paths, abstract, item, allow_dtype_cast=allow_dtype_cast)
    if problems:
        raise CheckpointMismatchError(step, source.path, problems)
    return _rebuild(treedef, leaves, paths, _reader_values(item, paths, abstract))
