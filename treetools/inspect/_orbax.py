"""Orbax checkpoints: CheckpointManager roots, step folders and item folders.

Shapes, dtypes and shardings come from Orbax's own metadata API
(``PyTreeCheckpointHandler().metadata``), which reads ``_METADATA``,
``_sharding`` and each array's zarr header, never array data, and needs none
of the devices the checkpoint was saved from: a ``NamedSharding`` comes back
as ``NamedShardingMetadata`` (mesh axis names, sizes and PartitionSpec).
JSON items (``JsonCheckpointHandler``) have no metadata API; their one file
is parsed directly. Array data is read only for ``--stats``/``--values``,
through TensorStore, one block at a time.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from treetools.inspect._base import (
    ArrayReader,
    CheckpointError,
    Index,
    Leaf,
    Snapshot,
    array_row,
    check_name,
    require_regular_tree,
    tree_leaves,
    value_row,
)
from treetools.inspect._scan import (
    COMMIT_FILE,
    JSON_ITEM_FILE,
    PYTREE_METADATA,
    STEP_METADATA,
    has_array_data,
    has_entry,
    is_committed,
    is_tmp,
    looks_like_item,
    looks_like_step,
    read_json,
    scan_root,
    step_of,
)

__all__ = ["open_orbax"]


class TensorStoreReader(ArrayReader):
    """One Orbax array, read through TensorStore a block at a time.

    The store is opened read-only with TensorStore's cache disabled, so a
    block's memory is freed once the block is consumed. A storage chunk is
    decompressed whole: the peak per block is the larger of the block and the
    chunks it touches (Orbax writes one chunk per device shard unless
    ``SaveArgs(chunk_byte_size=...)`` asked for smaller ones).
    """

    def __init__(self, spec: dict[str, Any], shape: tuple[int, ...], dtype: np.dtype,
                 chunk_shape: tuple[int, ...] | None, *, where: str):
        self._spec = spec
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.chunk_shape = chunk_shape
        self._where = where
        self._store: Any = None

    def _open(self) -> Any:
        import tensorstore as ts

        try:
            return ts.open(self._spec, read=True, open=True, context=ts.Context()).result()
        except Exception as e:  # tensorstore raises ValueError with a long status text
            raise CheckpointError(f"{self._where}: cannot open array data ({_first_line(e)}).") from None

    def _result(self, future: Any) -> np.ndarray:
        try:
            return np.asarray(future.result())
        except Exception as e:
            raise CheckpointError(f"{self._where}: cannot read array data ({_first_line(e)}).") from None

    def read(self, index: Index) -> np.ndarray:
        store = self._store if self._store is not None else self._open()
        return self._result(store[index].read())

    def blocks(self, plan):
        """Blocks in plan order; the next block's read is in flight while the caller uses this one.

        At most two blocks are alive at once, so memory stays bounded while
        TensorStore's decoding overlaps the caller's arithmetic.
        """
        self._store = store = self._open()
        try:
            pending = None
            for index in plan:
                nxt = store[index].read()
                if pending is not None:
                    yield self._result(pending)
                pending = nxt
            if pending is not None:
                yield self._result(pending)
        finally:
            self._store = None


def _first_line(e: BaseException) -> str:
    """The gist of an error: its first line, without TensorStore's appended spec dump."""
    text = str(e).strip().splitlines()
    return text[0].split(" [tensorstore_spec=", 1)[0] if text else type(e).__name__


def _ts_spec(item_dir: str, name: str, *, use_ocdbt: bool, use_zarr3: bool) -> dict[str, Any]:
    """The TensorStore spec of one saved array, as Orbax's ``ArrayReadSpec`` builds it."""
    item_dir = os.path.abspath(item_dir)
    if use_ocdbt:
        kvstore: dict[str, Any] = {"driver": "ocdbt", "base": {"driver": "file", "path": item_dir + "/"}, "path": name}
    else:
        kvstore = {"driver": "file", "path": os.path.join(item_dir, name) + "/"}
    return {
        "driver": "zarr3" if use_zarr3 else "zarr",
        "kvstore": kvstore,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "fill_missing_data_reads": False,  # a missing chunk is an error, not zeros
    }


def _leaf_sharding(meta: Any) -> Any:
    """``LeafSharding`` from Orbax's ``NamedShardingMetadata``; None for any other sharding."""
    names = getattr(meta, "axis_names", None)
    spec = getattr(meta, "partition_spec", None)
    sizes = getattr(meta, "shape", None)
    if names is None or spec is None or sizes is None:
        return None
    from jax.sharding import PartitionSpec

    from treetools.partitioning import LeafSharding

    entries = [tuple(e) if isinstance(e, (list, tuple)) else e for e in spec]
    return LeafSharding(PartitionSpec(*entries), {str(a): int(s) for a, s in zip(names, np.asarray(sizes).tolist())})


def _no_metadata(item_dir: str) -> CheckpointError:
    return CheckpointError(
        f"{item_dir}: no {PYTREE_METADATA} file, which Orbax's metadata API needs "
        "(saved by an Orbax older than 0.5, or copied without it)."
    )


def _value_types(item_dir: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Param name -> value type from ``_METADATA``, after refusing escaping keys."""
    path = os.path.join(item_dir, PYTREE_METADATA)
    if not has_entry(item_dir, PYTREE_METADATA):
        raise _no_metadata(item_dir)
    raw = read_json(path, what="Orbax _METADATA")
    tree = raw.get("tree_metadata") if isinstance(raw, dict) else None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: corrupt Orbax _METADATA (no `tree_metadata` object).")
    types: dict[str, str] = {}
    for key, entry in tree.items():
        try:
            keys = [str(k["key"]) for k in entry["key_metadata"]]
            value_type = str(entry["value_metadata"]["value_type"])
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}: corrupt Orbax _METADATA (entry {key!r} lacks key or value metadata).") from None
        for k in keys:
            check_name(k, where=path)
        name = ".".join(keys)
        check_name(name, where=path)
        types[name] = value_type
    return types, raw


def _ignore_late_callbacks() -> None:
    """Drop the "Event loop is closed" errors of TensorStore callbacks that outlive a failed Orbax read.

    When one of Orbax's concurrent metadata reads fails, its event loop closes
    while TensorStore still completes the others; each late completion would
    print a traceback after our one-line error. Other unraisable errors pass.
    """
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "_treetools", False):
        return

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
            previous(unraisable)

    hook._treetools = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _quiet_absl() -> Callable[[], None]:
    """Silence Orbax's absl warnings (diagnostics, not data) until the returned undo is called."""
    import logging

    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    return lambda: logger.setLevel(level)


def _box_paths(metadata: Any) -> dict[str, str]:
    """``{"Dense_0/kernel/value": "Dense_0/kernel"}`` for boxes that ``treetools.checkpoint`` recorded.

    Orbax stores a flax box as a node holding its array; ``save_checkpoint``
    records which nodes were boxes, so paths keep the one-leaf-per-box rule.
    """
    from treetools.checkpoint import _recorded_boxes

    return {f"{box}/{inner}": box for box, inner in _recorded_boxes(metadata).items()}


def _pytree_leaves(item_dir: str) -> list[Leaf]:
    types, raw = _value_types(item_dir)
    require_regular_tree(item_dir)
    use_zarr3 = bool(raw.get("use_zarr3", False))
    use_ocdbt = bool(raw.get("use_ocdbt", os.path.exists(os.path.join(item_dir, "manifest.ocdbt"))))
    undo = _quiet_absl()
    # Before the read, not in the except: late callbacks can fire while the
    # failed read is still unwinding, before any handler of ours runs.
    _ignore_late_callbacks()
    try:
        from etils import epath
        import orbax.checkpoint as ocp

        metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(os.path.abspath(item_dir)))
        tree = metadata.tree
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{item_dir}: Orbax's metadata API cannot read this item ({type(e).__name__}: {_first_line(e)})."
        ) from None
    finally:
        undo()
    from treetools.paths import leaves_with_paths

    unboxed = _box_paths(metadata)
    leaves = []
    for path, meta in leaves_with_paths(tree):
        path = unboxed.get(path, path)
        name = getattr(meta, "name", None)
        value_type = types.get(name, "")
        is_array = (
            name is not None
            and value_type not in ("scalar", "string")
            and getattr(meta, "shape", None) is not None
            and getattr(meta, "dtype", None) is not None
        )
        if not is_array:
            leaves.append(Leaf(value_row(path)))
            continue
        row = array_row(path, meta.shape, meta.dtype, sharding=_leaf_sharding(getattr(meta, "sharding", None)))
        shape, dtype = row.shape, np.dtype(meta.dtype)
        storage = getattr(meta, "storage", None)
        chunk = getattr(storage, "chunk_shape", None)
        spec = _ts_spec(item_dir, name, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
        reader = TensorStoreReader(spec, shape, dtype, tuple(chunk) if chunk else None,
                                   where=f"{item_dir}: `{path}`")
        leaves.append(Leaf(row, reader))
    return leaves


def _json_leaves(item_dir: str) -> list[Leaf]:
    path = os.path.join(item_dir, JSON_ITEM_FILE)
    return tree_leaves(read_json(path, what="Orbax JSON item"), where=path)


def _item_kind(item_dir: str, handler: str | None) -> str:
    if handler and "Json" in handler:
        return "json"
    if has_entry(item_dir, PYTREE_METADATA):
        return "pytree"
    if has_entry(item_dir, JSON_ITEM_FILE) and not handler:
        return "json"
    if handler is None or "PyTree" in handler or "Standard" in handler:
        raise _no_metadata(item_dir)
    return "unsupported"


def _load_item(item_dir: str, handler: str | None, notes: list[str]) -> list[Leaf]:
    kind = _item_kind(item_dir, handler)
    if kind == "json":
        return _json_leaves(item_dir)
    if kind == "pytree":
        return _pytree_leaves(item_dir)
    notes.append(f"item `{os.path.basename(item_dir)}` was saved by {handler.rsplit('.', 1)[-1]}, "
                 "which the inspector does not read; skipped.")
    return []


def _load_step(step_dir: str, step: int | None) -> Snapshot:
    meta_path = os.path.join(step_dir, STEP_METADATA)
    meta = read_json(meta_path, what="Orbax _CHECKPOINT_METADATA") if has_entry(step_dir, STEP_METADATA) else {}
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    notes: list[str] = []
    if isinstance(handlers, dict):
        names = sorted(str(n) for n in handlers)
    else:
        with os.scandir(step_dir) as it:
            names = sorted(e.name for e in it if e.is_dir() and not is_tmp(e.name) and looks_like_item(e.path))
        handlers = {}
    items: dict[str, list[Leaf]] = {}
    for name in names:
        check_name(name, where=meta_path)
        item_dir = os.path.join(step_dir, name)
        if not os.path.isdir(item_dir):
            notes.append(f"item `{name}` is listed in {STEP_METADATA} but has no folder; skipped.")
            continue
        items[name] = _load_item(item_dir, handlers.get(name), notes)
    if not items and not notes:
        raise CheckpointError(f"{step_dir}: step folder holds no Orbax item.")
    return Snapshot(step, items, record_sharding=True, notes=notes)


def _single_item_name(item_dir: str) -> str:
    """Orbax's name for an item: ``default`` for a standalone Checkpointer save, else the folder name."""
    meta_path = os.path.join(item_dir, STEP_METADATA)
    if has_entry(item_dir, STEP_METADATA):
        meta = read_json(meta_path, what="Orbax _CHECKPOINT_METADATA")
        if not isinstance(meta, dict) or not isinstance(meta.get("item_handlers"), dict):
            return "default"
    return _name(item_dir) or "default"


def _name(path: str) -> str:
    """The folder's own name, also for ``.`` or a trailing slash."""
    return os.path.basename(os.path.abspath(path))


def _refuse_incomplete(path: str) -> None:
    if not is_committed(path):
        marker = "an Orbax tmp folder" if is_tmp(_name(path)) else f"no {COMMIT_FILE}"
        raise CheckpointError(f"{path}: incomplete save ({marker}); it is never read.")


def open_orbax(path: str) -> tuple[list[int] | None, list[str], Callable[[int | None], Snapshot]]:
    """Classify an Orbax folder; return (steps, incomplete, loader).

    ``steps`` is None unless ``path`` is a CheckpointManager root; the loader
    reads one step's metadata (None: the latest, or the only one).
    """
    if is_tmp(_name(path)):
        _refuse_incomplete(path)
    if has_entry(path, PYTREE_METADATA) or has_array_data(path):
        name = _single_item_name(path)
        if name == "default":
            _refuse_incomplete(path)
        return None, [], lambda _step: Snapshot(None, {name: _pytree_leaves(path)}, record_sharding=True)
    if has_entry(path, STEP_METADATA) or (not has_entry(path, JSON_ITEM_FILE) and looks_like_step(path)):
        _refuse_incomplete(path)
        step = step_of(_name(path))
        return None, [], lambda _step: _load_step(path, step)
    if has_entry(path, JSON_ITEM_FILE):
        name = _name(path)
        return None, [], lambda _step: Snapshot(None, {name: _json_leaves(path)})
    listing = scan_root(path)
    if listing.steps or listing.incomplete:
        def load(step: int | None) -> Snapshot:
            return _load_step(listing.steps[step], step)

        return list(listing.steps), listing.incomplete, load
    with os.scandir(path) as it:
        empty = not any(True for _ in it)
    if empty:
        raise CheckpointError(f"{path}: empty folder, not a checkpoint.")
    raise CheckpointError(
        f"{path}: not a checkpoint (no Orbax step folders, {STEP_METADATA} or {PYTREE_METADATA}); "
        "point at a CheckpointManager root, a step folder, an item folder, or a .msgpack/.safetensors/.npz file."
    )
