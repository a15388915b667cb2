"""T5X checkpoints, and Orbax saves from before 0.5 (the same files), read without jax, flax or T5X.

T5X (``t5x.checkpoints.Checkpointer``) saves step ``N`` of a model dir into
``checkpoint_N.tmp-<unix time>/`` and renames it ``checkpoint_N/`` when done:

* every partitioned array is a zarr folder written through TensorStore, named
  by its state-dict key path joined with ``.`` (``target.encoder.layers_0.
  attention.query.kernel``), bfloat16 stored as bfloat16 (checkpoint version 3);
* ``checkpoint``, written last, is a Flax msgpack of ``{"version": 3,
  "optimizer": state_dict}``: each leaf is either its value inline (msgpack
  ext arrays: unpartitioned arrays, the step) or the TensorStore spec of its
  zarr folder, ``{"driver": "zarr", "kvstore": {"driver": "file", "path":
  NAME}, "metadata": {...}}`` with ``NAME`` relative to the step folder.

Orbax before 0.5 (T5X's Orbax-era ``checkpoint_N/state/``, any
``CheckpointManager`` root ``N/<item>/``) wrote the same zarr folders per
leaf and an item-level ``checkpoint`` msgpack whose leaves are inline values
or ``"PLACEHOLDER://NAME"``, and no ``_METADATA``.

A spec or placeholder is one leaf; its shape and dtype come from the zarr
folder's ``.zarray`` (checked against the spec), its data is read only on
request, through TensorStore, rooted in the step (or item) folder: a name
that is absolute, has ``..`` or resolves outside that folder is refused.
Steps follow ``treetools.steps``: unfinished ``*.tmp-<ts>`` and
``*.orbax-checkpoint-tmp-<ts>`` folders are listed, never read. The state
dict's top-level keys are the items: ``target`` (T5X's model parameters, what
``load_parameters`` returns) and ``state`` (``step``, the optimizer's
``param_states``); an Orbax (< 0.5) item file is one item.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import Any, Sequence

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._msgpack import MsgpackError, walk
from treetools.checkpoint_io.formats._tensorstore import TensorStoreReader, item_stores, open_all, ts_spec
from treetools.checkpoint_io.formats.msgpack import is_msgpack_map
from treetools.checkpoint_io.readers import checked_shape, np_dtype, read_metadata
from treetools.checkpoint_io.storage import Storage
from treetools.shared.errors import CheckpointError
from treetools.checkpoint_io.formats._orbax_items import (  # a T5X root may hold later Orbax saves; boxes as nodes are Orbax's rule
    is_json_item,
    logical_paths,
    read_json_item,
    read_pytree_item,
)
from treetools.checkpoint_io.leaves import DEFAULT_ITEM, Item, Leaf, Snapshot, array_row, check_name, tree_leaves
from treetools.checkpoint_io.source import Format, ItemLayout, Layout, RootLayout, Source, StepLayout
from treetools.checkpoint_io.steps import (
    PYTREE_METADATA_FILE,
    TMP_DIR_SUFFIX,
    is_committed,
    parse_step_name,
    read_file,
    tmp_step,
)


CHECKPOINT_FILE = "checkpoint"
"""The msgpack file of a T5X step folder (and of an Orbax item folder before 0.5)."""

ZARRAY_FILE = ".zarray"
OCDBT_MANIFEST = "manifest.ocdbt"
_PLACEHOLDER_PREFIXES = ("PLACEHOLDER://", "AGGREGATED://")  # Orbax's names for "stored in its own folder"
_TS_DRIVERS = ("zarr",)
_KVSTORE_DRIVERS = ("file", "gfile", "gcs")  # T5X's spec is relative whatever the store: only the path is used


# ---------------------------------------------------------------------------- the `checkpoint` msgpack


class _StoredSpec:
    """A TensorStore spec found in the msgpack: one leaf, never its driver/kvstore/metadata keys."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec


def _spec_hook(node: dict[Any, Any]) -> Any:
    """Each map as it is decoded: a TensorStore spec becomes one leaf."""
    if "driver" in node and "kvstore" in node:
        return _StoredSpec(node)
    return node


def _load_msgpack(context: ReadContext, path: str) -> dict[str, Any]:
    """The state dict in a ``checkpoint`` file, walked once (Flax's encoding): inline arrays stay in the file,
    read from their offsets on request."""
    try:
        mode = context.storage.stat(path).st_mode
    except OSError:
        mode = None
    if mode is None or not stat.S_ISREG(mode):
        # says what is there instead (nothing, a FIFO, a folder)
        read_file(context.storage, path, what="T5X `checkpoint` msgpack")
    try:
        tree = walk(context, path, object_hook=_spec_hook)
    except MsgpackError as e:
        raise CheckpointError(
            f"{path}: corrupt or truncated `checkpoint` msgpack (at byte {e.offset:,}: {e.reason}); "
            "the save did not finish or the file was cut short: copy the step folder again."
        ) from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: not a T5X `checkpoint` (its msgpack holds a {type(tree).__name__}, not a state dict).")
    return tree


def _state_dict(tree: dict[str, Any]) -> tuple[Any, int | None]:
    """T5X wraps the state dict as ``{"version": V, "optimizer": ...}`` (version 0 files are the state dict)."""
    version = tree.get("version")
    if set(tree) == {"version", "optimizer"} and isinstance(version, int) and not isinstance(version, bool):
        return tree["optimizer"], version
    return tree, None


# ---------------------------------------------------------------------------- arrays in zarr folders


def _zarray(context: ReadContext, path: str) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...]]:
    """``(shape, dtype, chunks)`` from a zarr v2 ``.zarray`` (no array data)."""
    meta = read_metadata(context, path, what="zarr .zarray")
    try:
        if meta.get("zarr_format") != 2:
            raise ValueError(f"zarr_format {meta.get('zarr_format')!r}, not 2")
        dtype = np_dtype(meta["dtype"])
        shape_json, chunks_json = meta["shape"], meta["chunks"]
        if dtype.hasobject:
            raise ValueError("an object dtype")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt zarr .zarray ({e}); the array folder is damaged.") from None
    shape = checked_shape(shape_json, where=path, itemsize=dtype.itemsize)
    chunks = checked_shape(chunks_json, where=path, itemsize=dtype.itemsize, what="chunk shape")
    if len(chunks) != len(shape) or 0 in chunks:
        raise CheckpointError(f"{path}: corrupt zarr .zarray (chunks {list(chunks)} do not fit the shape "
                              f"{list(shape)}); the array folder is damaged.")
    return shape, dtype, chunks


def _spec_name(spec: dict[str, Any], *, where: str, leaf: str) -> str:
    """The zarr folder a T5X spec names, relative to the step folder; anything else is refused."""
    kvstore = spec.get("kvstore")
    if spec.get("driver") not in _TS_DRIVERS or not isinstance(kvstore, dict) or kvstore.get("driver") not in _KVSTORE_DRIVERS:
        driver = spec.get("driver"), kvstore.get("driver") if isinstance(kvstore, dict) else kvstore
        raise CheckpointError(
            f"{where}: `{leaf}` is stored with TensorStore {driver[0]!r} over {driver[1]!r}; treetools reads T5X's "
            "zarr arrays in the step folder (driver `zarr`, kvstore `file`/`gfile`/`gcs` with a relative path)."
        )
    name = kvstore.get("path") or spec.get("path")  # TensorStore < 0.1.14 specs kept the path at the top level
    if not isinstance(name, str) or not name.strip("/"):
        raise CheckpointError(f"{where}: `{leaf}` has a TensorStore spec without a path; the `checkpoint` file is corrupt.")
    return name.rstrip("/")


def _stored_leaf(context: ReadContext, parts: tuple[str, ...], name: str, base: str, spec: dict[str, Any] | None, *,
                 where: str, shared: Any = None) -> Leaf:
    """One array in its zarr folder ``base/name``: shape and dtype from ``.zarray``, data through TensorStore."""
    leaf = "/".join(parts)
    check_name(name, where=where)
    storage = context.storage
    folder = os.path.join(base, name)
    if not storage.isdir(folder):
        raise CheckpointError(
            f"{where}: `{leaf}` is stored in the zarr folder {name!r}, which is missing from {base}; "
            "the step was copied in part: copy the whole step folder."
        )
    zarray = os.path.join(folder, ZARRAY_FILE)
    if not storage.lexists(zarray):
        raise CheckpointError(
            f"{folder}: zarr folder without .zarray (`{leaf}`); the array was never finished or was copied in part: "
            "copy the whole step folder."
        )
    shape, dtype, chunks = _zarray(context, zarray)
    if spec is not None:
        meta = given if isinstance(given := spec.get("metadata"), dict) else {}
        said_shape = meta.get("shape")
        said_dtype = spec.get("dtype", meta.get("dtype"))
        try:
            same = (said_shape is None or checked_shape(said_shape, where=where) == shape) and (
                said_dtype is None or np_dtype(said_dtype) == dtype)
        except (CheckpointError, TypeError, ValueError, AttributeError):
            same = False
        if not same:
            said = f"{str(said_dtype)[:40]}{str(list(said_shape) if isinstance(said_shape, list) else [])[:80]}"
            raise CheckpointError(
                f"{where}: `{leaf}` is {said} in the `checkpoint` file but "
                f"{dtype}{list(shape)} in {zarray}; the step folder mixes two saves."
            )
    spec_open = ts_spec(storage, base, name, use_ocdbt=False, use_zarr3=False)
    reader = TensorStoreReader(context, spec_open, shape, dtype, chunks, where=f"{base}: `{leaf}`", shared=shared)
    return Leaf(array_row(parts, shape, dtype), reader, key=name)


def read_tree(context: ReadContext, path: str, name: str = DEFAULT_ITEM) -> tuple[Item, int | None]:
    """The leaves of one ``checkpoint`` msgpack and the zarr folders beside it; no array data is read.

    Returns the item and T5X's checkpoint version (None for an Orbax item file).

    >>> import msgpack, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "checkpoint")
    >>> _ = open(f, "wb").write(msgpack.packb({"version": 3, "optimizer": {"state": {"step": 7}}}))
    >>> item, version = read_tree(ReadContext().confined_to(f), f)
    >>> [(leaf.name, leaf.value) for leaf in item.leaves], version
    ([('state/step', 7)], 3)
    """
    storage = context.storage
    base = os.path.dirname(path)
    tree, version = _state_dict(_load_msgpack(context, path))
    leaves = tree_leaves(tree, where=path)
    paths = logical_paths([leaf.path for leaf in leaves])
    ocdbt = storage.isfile(os.path.join(base, OCDBT_MANIFEST))
    out: list[Leaf] = []
    in_ocdbt: list[tuple[int, tuple[str, ...], str]] = []
    shared = item_stores(storage)
    for leaf, parts in zip(leaves, paths):
        value = leaf.value
        if value is None and leaf.reader is None:  # an empty node (an optax EmptyState), as Orbax >= 0.5 skips it
            continue
        spec = value.spec if isinstance(value, _StoredSpec) else None
        if spec is not None:
            stored = _spec_name(spec, where=path, leaf="/".join(parts))
        elif isinstance(value, str) and value.startswith(_PLACEHOLDER_PREFIXES):
            stored = value.split("://", 1)[1]
        else:
            out.append(dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=parts)))
            continue
        if ocdbt and spec is None:  # Orbax's use_ocdbt=True: every array in one OCDBT store in the item folder
            check_name(stored, where=path)
            in_ocdbt.append((len(out), parts, stored))
            out.append(leaf)  # replaced below
        else:
            out.append(_stored_leaf(context, parts, stored, base, spec, where=path, shared=shared))
    if in_ocdbt:
        specs = [ts_spec(storage, base, stored, use_ocdbt=True, use_zarr3=False) for _, _, stored in in_ocdbt]
        wheres = [f"{base}: `{'/'.join(parts)}`" for _, parts, _ in in_ocdbt]
        headers = open_all(context, specs, wheres, stores=shared)
        for (i, parts, stored), spec, where, store in zip(in_ocdbt, specs, wheres, headers):
            if store is None:  # only with problems=, which collects instead of raising
                continue
            shape = tuple(int(d) for d in store.shape)
            dtype = np.dtype(store.dtype.numpy_dtype)
            chunks = tuple(int(c) for c in store.chunk_layout.read_chunk.shape or ()) or None
            reader = TensorStoreReader(context, spec, shape, dtype, chunks, where=where, shared=shared)
            out[i] = Leaf(array_row(parts, shape, dtype), reader, key=stored)
    return Item(name, "pytree", out), version


# ---------------------------------------------------------------------------- folders


def _has_tree(storage: Storage, folder: str) -> bool:
    """A T5X step folder or an Orbax (< 0.5) item folder: a ``checkpoint`` msgpack and no ``_METADATA``."""
    return is_msgpack_map(storage, os.path.join(folder, CHECKPOINT_FILE)) and not storage.lexists(
        os.path.join(folder, PYTREE_METADATA_FILE))


def _subdirs(storage: Storage, folder: str) -> list[str]:
    try:
        with storage.scandir(folder) as it:
            return sorted(e.name for e in it if e.is_dir())
    except OSError:
        return []


def _is_t5x_tmp(name: str) -> bool:
    return TMP_DIR_SUFFIX not in name and tmp_step(name) is not None


def _orbax_step(storage: Storage, folder: str) -> bool:
    """An Orbax (< 0.5) step folder: an item subfolder (not itself a step) with a ``checkpoint`` msgpack."""
    return any(_has_tree(storage, os.path.join(folder, d)) for d in _subdirs(storage, folder)
               if parse_step_name(d) is None and tmp_step(d) is None)


def _committed(step_dir: str, storage: Storage) -> bool:
    """T5X writes ``checkpoint`` last, then renames the tmp folder; Orbax before 0.5 renamed a folder of such items."""
    return _has_tree(storage, step_dir) or _orbax_step(storage, step_dir) or is_committed(step_dir, storage)


def _is_item(storage: Storage, folder: str) -> bool:
    return (_has_tree(storage, folder) or storage.lexists(os.path.join(folder, PYTREE_METADATA_FILE))
            or is_json_item(storage, folder))


class T5XSource(Source):
    """A T5X model dir or Orbax (< 0.5) root (``RootLayout``), one step folder (``StepLayout``) or item folder,
    or the ``checkpoint`` file given directly (``ItemLayout``: read whatever else its folder holds)."""

    format = "t5x"
    layout: Layout

    def __init__(self, display: str, context: ReadContext, layout: Layout):
        self._trees: dict[int | None, tuple[Item, int | None]] = {}
        super().__init__(display, context, layout=layout, commit_rule=_committed)

    def _tree_file(self, step: int | None) -> str | None:
        """The ``checkpoint`` msgpack holding the whole step (the file given, or its step folder's), else None
        (the step's items are folders)."""
        return self.layout.whole_item(self.step_folder(step), self._tree_in)

    def _tree_in(self, folder: str) -> str | None:
        return os.path.join(folder, CHECKPOINT_FILE) if _has_tree(self.storage, folder) else None

    def _tree(self, step: int | None, path: str) -> tuple[Item, int | None]:
        """The step's ``checkpoint`` msgpack (at ``path``), parsed once per step."""
        if step not in self._trees:
            self._trees[step] = read_tree(self.context, path, DEFAULT_ITEM)
        return self._trees[step]

    def _split(self, step: int | None, path: str | None) -> dict[str, Item] | None:
        """A T5X state dict (the msgpack at ``path``, ``_tree_file``) as its top-level items (``target``: the
        model parameters, ``state``: the optimizer's), or None for an Orbax (< 0.5) item file, which is one tree,
        or a step whose items are folders (``path`` None)."""
        if path is None:
            return None
        whole, version = self._tree(step, path)
        if version is None or not whole.leaves or any(len(leaf.path) < 2 for leaf in whole.leaves):
            return None
        out: dict[str, list[Leaf]] = {}
        for leaf in whole.leaves:
            out.setdefault(leaf.path[0], []).append(
                dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[1:])))
        return {name: Item(name, "pytree", leaves) for name, leaves in out.items()}

    def _items(self, step: int | None) -> dict[str, str]:
        """Item name -> the folder holding it (its ``checkpoint``, or Orbax's ``_METADATA``)."""
        folder = self.step_folder(step)
        path = self._tree_file(step)
        if path is not None:
            split = self._split(step, path)
            return dict.fromkeys(split, folder) if split is not None else {DEFAULT_ITEM: folder}
        return {d: os.path.join(folder, d) for d in _subdirs(self.storage, folder)
                if TMP_DIR_SUFFIX not in d and _is_item(self.storage, os.path.join(folder, d))}

    def item_names(self, step: int | None) -> list[str]:
        return list(self._items(step))

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        whole_file = self._tree_file(step)
        split = self._split(step, whole_file)
        if split is not None and whole_file is not None:
            version = self._tree(step, whole_file)[1]
            return Snapshot(step, {name: split[name] for name in names},
                            metadata={"custom": {"t5x_checkpoint_version": version}})
        folders = self._items(step)
        items: dict[str, Item] = {}
        metadata: dict[str, Any] = {}
        step_dir = self.step_folder(step)
        for name in names:
            folder = folders[name]
            if whole_file is not None and folder == step_dir:  # the step is one tree: the file given, or its folder's
                whole, version = self._tree(step, whole_file)
                items[name] = dataclasses.replace(whole, name=name)
            elif self.storage.lexists(os.path.join(folder, PYTREE_METADATA_FILE)):
                items[name] = read_pytree_item(self.context, folder, name)  # a later Orbax save in the same root
            elif is_json_item(self.storage, folder):
                items[name] = read_json_item(self.context, folder, name)
            else:
                items[name], version = read_tree(self.context, os.path.join(folder, CHECKPOINT_FILE), name)
                if version is not None:
                    metadata["custom"] = {"t5x_checkpoint_version": version}
        return Snapshot(step, items, metadata=metadata)


def _claims(path: str, context: ReadContext) -> bool:
    storage = context.storage
    if storage.isfile(path):
        return os.path.basename(path) == CHECKPOINT_FILE and is_msgpack_map(storage, path)
    if not storage.isdir(path):
        return False
    if _is_t5x_tmp(os.path.basename(path)) or _has_tree(storage, path) or _orbax_step(storage, path):
        return True
    # A root: a step folder with a `checkpoint` (its own or an item's), or T5X's tmp folder of an unfinished save.
    for d in _subdirs(storage, path):
        child = os.path.join(path, d)
        if _is_t5x_tmp(d) or (parse_step_name(d) is not None
                              and (_has_tree(storage, child) or _orbax_step(storage, child))):
            return True
    return False


def _open(location: str, display: str, context: ReadContext) -> T5XSource:
    storage = context.storage
    folder = os.path.dirname(location) if storage.isfile(location) else location
    if tmp_step(os.path.basename(folder)) is not None:
        raise CheckpointError(f"{display}: incomplete save (a tmp folder, renamed only when the save finishes); "
                              "it is never read.")
    if storage.isfile(location):
        return T5XSource(display, context, ItemLayout(location, name=DEFAULT_ITEM))
    if _has_tree(storage, location):
        return T5XSource(display, context, StepLayout(location))
    root = any(parse_step_name(d) is not None and _committed(os.path.join(location, d), storage)
               for d in _subdirs(storage, location))
    if not root and _orbax_step(storage, location):
        return T5XSource(display, context, StepLayout(location))
    return T5XSource(display, context, RootLayout(location))


FORMAT = Format(
    name="t5x",
    priority=55,  # before orbax (50), which refuses Orbax < 0.5 item folders that hold `_sharding`
    claims=_claims,
    open=_open,
    description="a T5X model dir, checkpoint_<step> folder or its `checkpoint` file; an Orbax root, step or item "
                "folder saved before Orbax 0.5 (a `checkpoint` msgpack, no _METADATA)",
)
