"""Orbax checkpoints: CheckpointManager roots, step folders and item folders, read without jax or orbax.

Everything comes from the files Orbax writes:

* ``_CHECKPOINT_METADATA`` (a step): which items exist and their handlers
  (pytree or JSON), the save time, metrics and custom metadata;
* ``_METADATA`` (a pytree item): the key path of every leaf and its value type;
* ``_sharding``: the mesh axes and PartitionSpec each array was saved with;
* each array's zarr header, opened through TensorStore (in parallel, no array data).

So metadata inspection imports neither jax nor orbax. A box that an older
save wrote as a node (``kernel/value``, or nnx State saved by plain Orbax,
``raw_value`` in flax 0.8) is read as one leaf at the box's path: a trailing
``value``/``raw_value`` key that is its parent's only child is dropped.
Array data is read only on request, through TensorStore, one block at a time.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import os
import math
from typing import Any, Sequence

import numpy as np

from treetools import storage
from treetools.errors import CheckpointError
from treetools.inspect.arrays import ArrayReader, Index, check_budget, physical_memory
from treetools.inspect.source import (
    DEFAULT_ITEM,
    Format,
    Item,
    Leaf,
    Snapshot,
    Source,
    array_row,
    check_name,
    tree_leaves,
    value_row,
)
from treetools.rows import LeafSharding
from treetools.steps import (
    COMMIT_SUCCESS_FILE,
    JSON_ITEM_FILE,
    PYTREE_METADATA_FILE,
    STEP_METADATA_FILE,
    TMP_DIR_SUFFIX,
    file_kind,
    is_committed,
    parse_step_name,
    read_json_file,
    scan_steps,
    tmp_step,
)

__all__ = ["FORMAT", "OrbaxItem", "OrbaxSource", "TensorStoreReader"]

SHARDING_FILE = "_sharding"
BOX_SUFFIXES = ("value", "raw_value")
_BOXES_KEY = "treetools_boxes"  # recorded by treetools 0.1 saves, which wrote boxes as nodes
_NOT_STORED = ("None",)  # value types Orbax records without data (None leaves, empty nodes)
_VALUE_TYPES = ("scalar", "string")


# ---------------------------------------------------------------------------- array data


def _first_line(e: BaseException) -> str:
    """The gist of an error: its first line, without TensorStore's appended spec dump."""
    text = str(e).strip().splitlines()
    return text[0].split(" [tensorstore_spec=", 1)[0] if text else type(e).__name__


class TensorStoreReader(ArrayReader):
    """One Orbax array, read through TensorStore a block at a time.

    The store is opened read-only with TensorStore's cache disabled, so a
    block's memory is freed once the block is consumed. A storage chunk is
    decompressed whole: the peak per block is the larger of the block and the
    chunks it touches.
    """

    def __init__(self, spec: dict[str, Any], shape: tuple[int, ...], dtype: np.dtype,
                 chunk_shape: tuple[int, ...] | None, *, where: str, context: Any = None):
        self.spec = spec
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.chunk_shape = chunk_shape
        self._where = where
        self._store: Any = None
        self._context = context
        self.remote = context is not None

    def _ts_context(self) -> Any:
        import tensorstore as ts

        return self._context if self._context is not None else ts.Context()

    def _open(self, *, whole: bool = False) -> Any:
        """Open the store; refuse before decoding anything when one stored chunk is too big to hold.

        The chunk shape is the store's own (``.zarray`` / ``zarr.json``), which a
        hostile file may declare at 2^40 elements: block reads are held to the
        memory budget, a whole-array read (``load_parameters``) to the machine's memory.
        """
        import tensorstore as ts

        try:
            store = ts.open(self.spec, read=True, open=True, context=self._ts_context()).result()
        except Exception as e:  # tensorstore raises ValueError with a long status text
            raise CheckpointError(f"{self._where}: cannot open array data ({_first_line(e)}).") from None
        try:
            chunk = tuple(int(c) for c in store.chunk_layout.read_chunk.shape)
        except Exception:  # a driver without a chunk layout: fall back to the metadata's
            chunk = tuple(self.chunk_shape or self.shape)
        piece = math.prod(chunk) * self.dtype.itemsize
        if whole:
            memory = physical_memory()
            if memory is not None and max(piece, math.prod(self.shape) * self.dtype.itemsize) > memory:
                raise CheckpointError(
                    f"{self._where}: the array (or one stored chunk, {list(chunk)}) is larger than this machine's "
                    "memory; read it in slices (treetools inspect --show LEAF[SLICE]) instead."
                )
        else:
            check_budget(piece, where=self._where, what=f"one storage chunk ({list(chunk)} {self.dtype})")
        return store

    def _result(self, future: Any) -> np.ndarray:
        try:
            return np.asarray(future.result())
        except Exception as e:
            raise CheckpointError(f"{self._where}: cannot read array data ({_first_line(e)}).") from None

    def read(self, index: Index) -> np.ndarray:
        store = self._store if self._store is not None else self._open()
        return self._result(store[index].read())

    def read_all(self) -> np.ndarray:
        return self._result(self._open(whole=True).read())

    def blocks(self, plan):
        """Blocks in plan order; the next block's read is in flight while the caller uses this one."""
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


def reader_context(folder: str) -> Any:
    """The TensorStore context the readers of one item share: None locally (each array opens with a fresh,
    cache-less context), one shared context in a bucket.

    In a bucket every open costs round trips (an OCDBT manifest and b-tree
    nodes, the credentials): sharing the context shares those and the
    connections, and its small cache keeps the b-tree nodes that every array
    of the item looks up.
    """
    if not storage.is_remote(folder):
        return None
    import tensorstore as ts

    return ts.Context({"cache_pool": {"total_bytes_limit": 64 * 2**20}})


def ts_spec(item_dir: str, name: str, *, use_ocdbt: bool, use_zarr3: bool) -> dict[str, Any]:
    """The TensorStore spec of one saved array, as Orbax's ``ArrayReadSpec`` builds it."""
    if use_ocdbt:
        kvstore: dict[str, Any] = {"driver": "ocdbt", "base": storage.kvstore_spec(item_dir), "path": name}
    else:
        kvstore = storage.kvstore_spec(os.path.join(item_dir, name))
    return {
        "driver": "zarr3" if use_zarr3 else "zarr",
        "kvstore": kvstore,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "fill_missing_data_reads": False,  # a missing chunk is an error, not zeros
    }


# ---------------------------------------------------------------------------- pytree items


@dataclasses.dataclass
class OrbaxItem:
    """What a restore needs of one pytree item, read once: its folder and parsed ``_METADATA``."""

    folder: str
    metadata: dict[str, Any]
    logical: dict[str, tuple[str, ...]]
    """Orbax param name (``Dense_0.kernel.value``) -> the leaf's path (``("Dense_0", "kernel")``)."""


def _entries(raw: Any, path: str) -> list[tuple[tuple[str, ...], str, bool]]:
    """``(keys, value_type, skip)`` of every entry of a parsed ``_METADATA``, after refusing escaping keys."""
    tree = raw.get("tree_metadata") if isinstance(raw, dict) else None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: corrupt Orbax _METADATA (no `tree_metadata` object).")
    out = []
    for key, entry in tree.items():
        try:
            keys = tuple(str(k["key"]) for k in entry["key_metadata"])
            value = entry["value_metadata"]
            value_type = str(value["value_type"])
            skip = bool(value.get("skip_deserialize", False))
        except (KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{path}: corrupt Orbax _METADATA (entry {key!r} lacks key or value metadata).") from None
        for k in keys:
            check_name(k, where=path)
        check_name(".".join(keys), where=path)
        out.append((keys, value_type, skip))
    return out


def logical_paths(keys: Sequence[tuple[str, ...]], boxes: dict[str, str] | None = None) -> list[tuple[str, ...]]:
    """The leaf path of each stored key path: a box stored as a node is one leaf at the box's path.

    A trailing ``value``/``raw_value`` key is dropped when it is its parent's
    only child (a flax box or nnx ``Variable`` that a save wrote as a node).

    >>> logical_paths([("a", "kernel", "value"), ("a", "bias"), ("b", "value"), ("b", "other")])
    [('a', 'kernel'), ('a', 'bias'), ('b', 'value'), ('b', 'other')]
    """
    children: dict[tuple[str, ...], set[str]] = {}
    for k in keys:
        for i in range(len(k)):
            children.setdefault(k[:i], set()).add(k[i])
    recorded = {tuple(box.split("/")) + (inner,) for box, inner in (boxes or {}).items()}
    out = []
    for k in keys:
        drop = len(k) > 1 and (k in recorded or (k[-1] in BOX_SUFFIXES and len(children[k[:-1]]) == 1))
        out.append(k[:-1] if drop else k)
    return out


def _shardings(item_dir: str) -> dict[str, LeafSharding]:
    """Param name -> ``LeafSharding`` from Orbax's ``_sharding`` file (NamedShardings only)."""
    path = os.path.join(item_dir, SHARDING_FILE)
    if not storage.lexists(path):
        return {}
    raw = read_json_file(path, what="Orbax _sharding")
    out: dict[str, LeafSharding] = {}
    if not isinstance(raw, dict):
        return out
    for key, text in raw.items():
        try:
            name = base64.b64decode(key).decode("utf-8")
            info = json.loads(text) if isinstance(text, str) else text
        except (ValueError, UnicodeDecodeError, TypeError):
            continue
        if not isinstance(info, dict) or info.get("sharding_type") != "NamedSharding":
            continue
        names, sizes, spec = info.get("axis_names"), info.get("shape"), info.get("partition_spec")
        if not (isinstance(names, list) and isinstance(sizes, list) and isinstance(spec, list)):
            continue
        entries = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
        out[name] = LeafSharding(entries, {str(a): int(s) for a, s in zip(names, sizes)})
    return out


def _refuse_special_files(item_dir: str, names: Sequence[str], *, use_ocdbt: bool, use_zarr3: bool) -> None:
    """TensorStore blocks forever opening a FIFO: refuse special files among those it reads for array metadata."""
    import stat

    if storage.is_remote(item_dir):
        return  # a bucket holds objects only

    if use_ocdbt:  # the manifests and the b-tree/data files of the item and of each process
        folders = [item_dir, os.path.join(item_dir, "d")]
        folders += [os.path.join(item_dir, p, sub) for p in _subdirs(item_dir) if p.startswith("ocdbt.process_")
                    for sub in ("", "d")]
        paths = []
        for folder in folders:
            if storage.isdir(folder):
                with storage.scandir(folder) as it:
                    paths += [e.path for e in it]
    else:
        paths = [os.path.join(item_dir, n, "zarr.json" if use_zarr3 else ".zarray") for n in names]
    for path in paths:
        try:
            mode = storage.stat(path).st_mode
        except OSError:
            continue  # missing: TensorStore's own error names it
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CheckpointError(f"{path}: not a regular file ({file_kind(path)}); cannot read it as Orbax array data.")


def _open_all(specs: list[dict[str, Any]], where: list[str], problems: list[str] | None = None) -> list[Any]:
    """Open many arrays' zarr headers at once (TensorStore reads them in parallel); no array data.

    With ``problems``, a leaf that cannot be opened is recorded there (and its
    store is None) instead of failing the whole item: ``verify`` lists them all.
    """
    import tensorstore as ts

    context = ts.Context({"cache_pool": {"total_bytes_limit": 64 * 2**20}})
    futures = [ts.open(spec, read=True, open=True, context=context) for spec in specs]
    stores = []
    for future, w in zip(futures, where):
        try:
            stores.append(future.result())
        except Exception as e:
            message = f"{w}: cannot open array metadata ({_first_line(e)})."
            if problems is None:
                raise CheckpointError(message) from None
            problems.append(message)
            stores.append(None)
    return stores


def read_pytree_item(item_dir: str, name: str, problems: list[str] | None = None) -> Item:
    """The leaves of one Orbax pytree item from ``_METADATA``, ``_sharding`` and the zarr headers.

    With ``problems``, leaves whose stored array cannot be opened are recorded
    there and left out, instead of failing the item (``verify``).
    """
    meta_path = os.path.join(item_dir, PYTREE_METADATA_FILE)
    if not storage.lexists(meta_path):
        raise CheckpointError(
            f"{item_dir}: no {PYTREE_METADATA_FILE} file (saved by an Orbax older than 0.5, or copied without it); "
            "treetools cannot tell its leaves."
        )
    raw = read_json_file(meta_path, what=f"Orbax {PYTREE_METADATA_FILE}")
    entries = [e for e in _entries(raw, meta_path) if not e[2] and e[1] not in _NOT_STORED]
    custom = raw.get("custom_metadata") if isinstance(raw, dict) else None
    boxes = custom.get(_BOXES_KEY) if isinstance(custom, dict) else None
    boxes = {str(k): v for k, v in boxes.items() if isinstance(v, str)} if isinstance(boxes, dict) else None
    paths = logical_paths([keys for keys, _, _ in entries], boxes)
    use_zarr3 = bool(raw.get("use_zarr3", False))
    use_ocdbt = bool(raw.get("use_ocdbt", storage.exists(os.path.join(item_dir, "manifest.ocdbt"))))
    shardings = _shardings(item_dir)

    stored = [(keys, vt, path) for (keys, vt, _), path in zip(entries, paths) if vt != "string"]
    _refuse_special_files(item_dir, [".".join(keys) for keys, _, _ in stored], use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
    specs = [ts_spec(item_dir, ".".join(keys), use_ocdbt=use_ocdbt, use_zarr3=use_zarr3) for keys, _, _ in stored]
    wheres = [f"{item_dir}: `{'/'.join(path)}`" for _, _, path in stored]
    stores = iter(zip(specs, _open_all(specs, wheres, problems)))
    context = reader_context(item_dir)
    leaves: list[Leaf] = []
    logical: dict[str, tuple[str, ...]] = {}
    for (keys, value_type, _), path in zip(entries, paths):
        param = ".".join(keys)
        logical[param] = path
        if value_type == "string":
            leaves.append(Leaf(value_row(path), key=param))
            continue
        spec, store = next(stores)
        if store is None:  # recorded in `problems`
            continue
        dtype = np.dtype(store.dtype.numpy_dtype)
        shape = tuple(int(d) for d in store.shape)
        chunk = tuple(int(c) for c in store.chunk_layout.read_chunk.shape or ()) or None
        reader = TensorStoreReader(spec, shape, dtype, chunk, where=f"{item_dir}: `{'/'.join(path)}`", context=context)
        if value_type in _VALUE_TYPES:  # a Python scalar: a value, counted as no parameter
            leaves.append(Leaf(value_row(path), reader, key=param))
        else:
            row = array_row(path, shape, dtype, sharding=shardings.get(param))
            leaves.append(Leaf(row, reader, key=param))
    return Item(name, "pytree", leaves, handle=OrbaxItem(item_dir, raw, logical))


def _json_file(folder: str) -> str:
    """The file of a JSON item: ``metadata`` (JsonSave's default), else one named as its folder.

    A manager with ``best_fn`` stores the step's metrics as the item ``metrics``
    in the file ``metrics/metrics``.
    """
    own = os.path.join(folder, os.path.basename(storage.normalize(folder)))
    default = os.path.join(folder, JSON_ITEM_FILE)
    return own if not _is_file(default) and _is_file(own) else default


def read_json_item(item_dir: str, name: str) -> Item:
    path = _json_file(item_dir)
    value = read_json_file(path, what="Orbax JSON item")
    return Item(name, "json", tree_leaves(value, where=path), handle=value)


# ---------------------------------------------------------------------------- folders


def _is_file(path: str) -> bool:
    return storage.isfile(path)


def _is_json_item(folder: str) -> bool:
    path = _json_file(folder)
    if not _is_file(path) or storage.lexists(os.path.join(folder, PYTREE_METADATA_FILE)):
        return False
    try:
        with storage.open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError:
        return False
    return head[:1] in (b"{", b"[")


is_json_item = _is_json_item


def _is_item(folder: str) -> bool:
    return storage.lexists(os.path.join(folder, PYTREE_METADATA_FILE)) or _is_json_item(folder)


def _item_without_metadata(folder: str) -> bool:
    """Orbax's own item files (OCDBT manifest, ``_sharding``) without ``_METADATA``: read_pytree_item names what is missing."""
    return any(storage.isfile(os.path.join(folder, f)) for f in ("manifest.ocdbt", SHARDING_FILE))


def _subdirs(folder: str) -> list[str]:
    try:
        with storage.scandir(folder) as it:
            return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot list folder ({e.strerror or e}).") from None


def _step_is_item(folder: str) -> bool:
    """A step folder that is itself the item: a Checkpointer's save per step (Flax's ``checkpoint_<N>`` Orbax mode)."""
    return (parse_step_name(os.path.basename(folder)) is not None
            and storage.lexists(os.path.join(folder, STEP_METADATA_FILE)) and _is_item(folder))


def _looks_like_step(folder: str) -> bool:
    if storage.lexists(os.path.join(folder, STEP_METADATA_FILE)):
        return True
    try:  # a folder of step folders that are items (or their tmp folders) is a root, not a step holding items
        return any(_is_item(os.path.join(folder, d)) and not (_step_is_item(os.path.join(folder, d))
                                                               or tmp_step(d) is not None) for d in _subdirs(folder))
    except CheckpointError:
        return False


def _kind_of(handler: Any) -> str:
    text = str(handler or "")
    if "Json" in text:
        return "json"
    if not text or "PyTree" in text or "Standard" in text:
        return "pytree"
    return "unsupported"


class OrbaxSource(Source):
    """An Orbax CheckpointManager root (``mode="root"``), one step folder, or one item folder."""

    format = "orbax"
    record_sharding = True

    def __init__(self, local: str, display: str, mode: str):
        self.local = local
        self.mode = mode
        listing = scan_steps(local) if mode == "root" else None
        step = parse_step_name(os.path.basename(local)) if mode == "step" else None
        super().__init__(display, listing=listing, step=step)
        self._step_meta: dict[str, Any] = {}

    def item_dir(self, step: int | None, name: str) -> str:
        """The folder of one item of one step (the step folder itself when the step is one item)."""
        if self.mode == "item":
            return self.local
        step_dir = self._step_dir(step)
        return step_dir if self.mode == "root" and _step_is_item(step_dir) else os.path.join(step_dir, name)

    def _step_dir(self, step: int | None) -> str:
        return self.listing.folder(step) if self.listing is not None and step is not None else self.local

    def step_metadata(self, step_dir: str) -> dict[str, Any]:
        """The parsed ``_CHECKPOINT_METADATA`` of a step folder (read once per source), {} when absent."""
        if step_dir not in self._step_meta:
            path = os.path.join(step_dir, STEP_METADATA_FILE)
            meta = read_json_file(path, what=f"Orbax {STEP_METADATA_FILE}") if storage.lexists(path) else {}
            self._step_meta[step_dir] = meta if isinstance(meta, dict) else {}
        return self._step_meta[step_dir]

    def _handlers(self, step_dir: str) -> dict[str, str] | None:
        handlers = self.step_metadata(step_dir).get("item_handlers")
        return {str(k): str(v) for k, v in handlers.items()} if isinstance(handlers, dict) else None

    def item_names(self, step: int | None) -> list[str]:
        if self.mode == "item":
            return [self._item_name()]
        step_dir = self._step_dir(step)
        if self.mode == "root" and _step_is_item(step_dir):
            return [DEFAULT_ITEM]
        handlers = self._handlers(step_dir)
        if handlers is not None:
            return sorted(handlers)
        return [d for d in _subdirs(step_dir) if TMP_DIR_SUFFIX not in d and _is_item(os.path.join(step_dir, d))]

    def _item_name(self) -> str:
        """``default`` for a standalone Checkpointer save (the folder is the item), else the folder's name."""
        if storage.lexists(os.path.join(self.local, STEP_METADATA_FILE)):
            return "default"
        return os.path.basename(self.local) or "default"

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        notes: list[str] = []
        items: dict[str, Item] = {}
        step_dir = self._step_dir(step)
        if self.mode == "item" or (self.mode == "root" and _step_is_item(step_dir)):
            folder = self.local if self.mode == "item" else step_dir
            (name,) = names
            reader = read_json_item if _is_json_item(folder) else read_pytree_item
            items[name] = reader(folder, name)
            return Snapshot(step, items, record_sharding=True, metadata=self._metadata(folder), notes=notes)
        handlers = self._handlers(step_dir) or {}
        for name in names:
            check_name(name, where=os.path.join(step_dir, STEP_METADATA_FILE))
            item_dir = os.path.join(step_dir, name)
            if not storage.isdir(item_dir):
                notes.append(f"item `{name}` is listed in {STEP_METADATA_FILE} but has no folder; skipped.")
                continue
            kind = _kind_of(handlers.get(name)) if name in handlers else ("json" if _is_json_item(item_dir) else "pytree")
            if kind == "unsupported":
                notes.append(f"item `{name}` was saved by {handlers[name].rsplit('.', 1)[-1]}, "
                             "which treetools does not read; skipped.")
                continue
            items[name] = (read_json_item if kind == "json" else read_pytree_item)(item_dir, name)
        return Snapshot(step, items, record_sharding=True, metadata=self._metadata(step_dir), notes=notes)

    def _metadata(self, step_dir: str) -> dict[str, Any]:
        meta = self.step_metadata(step_dir)
        out: dict[str, Any] = {}
        ns = meta.get("commit_timestamp_nsecs") or meta.get("init_timestamp_nsecs")
        if isinstance(ns, (int, float)) and ns > 0:
            moment = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc)
            out["saved_at"] = moment.strftime("%Y-%m-%dT%H:%M:%SZ")
        custom = meta.get("custom_metadata") if isinstance(meta.get("custom_metadata"), dict) else {}
        # save_checkpoint stores metrics in custom metadata: Orbax keeps its own field only with a best_fn.
        metrics = meta.get("metrics") or custom.get("metrics")
        if isinstance(metrics, dict) and metrics:
            out["metrics"] = metrics
        custom = {k: v for k, v in custom.items() if k != "metrics"}
        if custom:
            out["custom"] = custom
        return out


def _claims(path: str) -> bool:
    if not storage.isdir(path):
        return False
    name = os.path.basename(path)
    if TMP_DIR_SUFFIX in name:
        return True
    if any(storage.lexists(os.path.join(path, f)) for f in (PYTREE_METADATA_FILE, STEP_METADATA_FILE)):
        return True
    if _is_json_item(path) or _looks_like_step(path) or _item_without_metadata(path):
        return True
    # A root: some step folder (or Orbax tmp folder) with Orbax's own evidence in it.
    for child in _subdirs(path):
        if TMP_DIR_SUFFIX in child and tmp_step(child) is not None:
            return True
        if parse_step_name(child) is not None:
            folder = os.path.join(path, child)
            if storage.lexists(os.path.join(folder, COMMIT_SUCCESS_FILE)) or _looks_like_step(folder):
                return True
    return False


def _open(local: str, display: str) -> OrbaxSource:
    name = os.path.basename(local)
    if TMP_DIR_SUFFIX in name or (parse_step_name(name) is not None and _looks_like_step(local)
                                  and not _is_item(local) and not is_committed(local)):
        raise CheckpointError(f"{display}: incomplete save (an Orbax tmp folder or no commit marker); it is never read.")
    if _is_item(local) or _item_without_metadata(local):
        source = OrbaxSource(local, display, "item")
        if source._item_name() == "default" and not is_committed(local):
            raise CheckpointError(f"{display}: incomplete save (no commit marker); it is never read.")
        return source
    if _looks_like_step(local):
        return OrbaxSource(local, display, "step")
    return OrbaxSource(local, display, "root")


FORMAT = Format(
    name="orbax",
    priority=50,
    claims=_claims,
    open=_open,
    description="an Orbax CheckpointManager root, step folder or item folder",
)
