"""jax's own pytree serialization (``jax.experimental.array_serialization.pytree_serialization.save``).

``save(tree, directory)`` writes two things into ``directory``:

* ``pytreedef.json``: the tree's structure as a base64 flatbuffer (``__jax_pytreedef_repr``) and one
  description per flattened leaf (``__jax_leaf_ids``: ``"Array(float32[2, 3])"``, or null for a None leaf);
* ``array_store/``: one OCDBT database holding every array as a zarr3 array under the key of its leaf's index
  in the flattened tree (``0``, ``2``, ...).

The structure is a flatbuffer (jax's export schema), walked here without jax: dict keys by name, tuple, list
and custom-node children by position, joined with ``/`` (``params/w``, ``l/0``); shapes and dtypes come from
the arrays' own headers, data is read on request through TensorStore. The folder is claimed before Orbax's (its
``array_store/`` is an OCDBT database without ``_METADATA``, which is not an Orbax item); ``array_store/`` given
alone opens its checkpoint.
"""

from __future__ import annotations

import base64
import os
import struct
from typing import Any

import numpy as np

from treetools.ckpt.context import ReadContext
from treetools.ckpt.formats._tensorstore import TensorStoreReader, item_stores, open_all, ts_spec
from treetools.ckpt.leaves import Leaf, array_row, check_name
from treetools.ckpt.source import FileSource, Format
from treetools.ckpt.steps import read_json_file
from treetools.ckpt.storage import Storage, normalize
from treetools.shared.errors import CheckpointError

TREEDEF_FILE = "pytreedef.json"
ARRAY_STORE = "array_store"
TREE_KEY, LEAVES_KEY = "__jax_pytreedef_repr", "__jax_leaf_ids"


def _is_checkpoint(storage: Storage, folder: str) -> bool:
    return storage.isfile(os.path.join(folder, TREEDEF_FILE)) and storage.isdir(os.path.join(folder, ARRAY_STORE))


def _root(storage: Storage, location: str) -> str | None:
    """The checkpoint folder of ``location`` (itself, or the folder above its ``array_store/``)."""
    if not storage.isdir(location):
        return None
    if _is_checkpoint(storage, location):
        return location
    parent = os.path.dirname(normalize(location))
    if os.path.basename(normalize(location)) == ARRAY_STORE and parent != normalize(location) and _is_checkpoint(
            storage, parent):
        return parent
    return None


_KIND_LEAF, _KIND_NONE, _KIND_TUPLE, _KIND_LIST, _KIND_DICT, _KIND_CUSTOM = range(6)
"""``PyTreeDefKind`` of jax's export schema (``jax/_src/export/serialization.fbs``)."""
MAX_NODES = 10_000_000
MAX_DEPTH = 1000


class _Flat:
    """Just enough of the flatbuffers wire format to walk one ``PyTreeDef`` table (no dependency, no jax):
    a table's fields through its vtable, vectors of tables and of strings, every offset checked."""

    def __init__(self, buf: bytes, where: str):
        self.buf, self.where = buf, where

    def _u(self, fmt: str, pos: int) -> int:
        size = struct.calcsize(fmt)
        if pos < 0 or pos + size > len(self.buf):
            raise CheckpointError(f"{self.where}: corrupt {TREE_KEY} (an offset past the end of its data).")
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def root(self) -> int:
        return self._u("<I", 0)

    def field(self, table: int, index: int) -> int | None:
        """The position of field ``index`` of the table at ``table``, None when absent."""
        vtable = table - self._u("<i", table)
        size = self._u("<H", vtable)
        slot = 4 + 2 * index
        if slot + 2 > size:
            return None
        off = self._u("<H", vtable + slot)
        return table + off if off else None

    def kind(self, table: int) -> int:
        pos = self.field(table, 0)
        return self._u("<b", pos) if pos is not None else 0

    def vector(self, table: int, index: int) -> list[int]:
        """Positions of the elements of a vector of offsets (tables or strings); [] when absent."""
        pos = self.field(table, index)
        if pos is None:
            return []
        vec = pos + self._u("<I", pos)
        n = self._u("<I", vec)
        if n > len(self.buf) // 4:
            raise CheckpointError(f"{self.where}: corrupt {TREE_KEY} (a vector of {n:,} entries).")
        return [vec + 4 + 4 * i + self._u("<I", vec + 4 + 4 * i) for i in range(n)]

    def string(self, pos: int) -> str:
        n = self._u("<I", pos)
        if pos + 4 + n > len(self.buf):
            raise CheckpointError(f"{self.where}: corrupt {TREE_KEY} (a string past the end of its data).")
        return self.buf[pos + 4:pos + 4 + n].decode("utf-8", "replace")


def leaf_paths(raw: dict[str, Any], where: str) -> list[tuple[str, ...]]:
    """The key path of every flattened leaf (in jax's flatten order), from the serialized ``PyTreeDef``: dict keys
    by name, tuple/list/custom-node children by position. Read without jax.

    >>> leaf_paths({TREE_KEY: "EAAAAAAACgAQAA8ACAAEAAoAAAAMAAAAJAAAAAAAAAQCAAAAEAAAAAQAAAABAAAAYgAAAAEAAABhAAAAAgAAABAAAAAEAAAA/P///wQABAAEAAAA"}, "x")  # jax: {"b": 1, "a": 2}
    [('a',), ('b',)]
    """
    try:
        flat = _Flat(base64.b64decode(raw[TREE_KEY], validate=True), where)
    except (ValueError, TypeError):
        raise CheckpointError(f"{where}: corrupt {TREE_KEY} (not base64).") from None
    paths: list[tuple[str, ...]] = []
    stack: list[tuple[int, tuple[str, ...]]] = [(flat.root(), ())]
    seen = 0
    while stack:
        table, path = stack.pop()
        seen += 1
        if seen > MAX_NODES or len(path) > MAX_DEPTH:
            raise CheckpointError(f"{where}: {TREE_KEY} holds more nodes, or nests deeper, than a checkpoint does.")
        kind = flat.kind(table)
        if kind == _KIND_LEAF:
            paths.append(path)
            continue
        if kind == _KIND_NONE:
            continue
        children = flat.vector(table, 1)
        if kind == _KIND_DICT:
            names = [flat.string(p) for p in flat.vector(table, 2)]
            if len(names) != len(children):
                raise CheckpointError(f"{where}: corrupt {TREE_KEY} (a dict whose keys and children differ in number).")
        elif kind in (_KIND_TUPLE, _KIND_LIST, _KIND_CUSTOM):
            names = [str(i) for i in range(len(children))]
        else:
            raise CheckpointError(f"{where}: corrupt {TREE_KEY} (a node of unknown kind {kind}).")
        stack.extend((child, path + (name,)) for child, name in reversed(list(zip(children, names))))
    return paths


def read_jax_pytree(context: ReadContext, folder: str) -> tuple[list[Leaf], list[str]]:
    """The leaves of one ``pytree_serialization.save`` folder (metadata only), and notes."""
    storage = context.storage
    meta_path = os.path.join(folder, TREEDEF_FILE)
    raw = read_json_file(storage, meta_path, what=f"jax {TREEDEF_FILE}")
    if not (isinstance(raw, dict) and isinstance(raw.get(TREE_KEY), str) and isinstance(raw.get(LEAVES_KEY), list)):
        raise CheckpointError(f"{meta_path}: not jax's pytree serialization ({TREE_KEY} and {LEAVES_KEY} expected).")
    descriptions = raw[LEAVES_KEY]
    paths = leaf_paths(raw, meta_path)
    if len(paths) != len(descriptions):
        raise CheckpointError(f"{meta_path}: its structure has {len(paths):,} leaves and {LEAVES_KEY} lists "
                              f"{len(descriptions):,}; the file is corrupt.")
    paths = [p or (str(i),) for i, p in enumerate(paths)]  # a tree that is one array: named by its index
    notes: list[str] = []
    ids = [i for i, d in enumerate(descriptions) if d is not None and d != "null"]
    for i in ids:
        for part in paths[i]:
            check_name(part, where=meta_path)
    store = os.path.join(folder, ARRAY_STORE)
    ocdbt = storage.isfile(os.path.join(store, "manifest.ocdbt"))
    # jax writes no chunk that equals the fill value (zeros) and reads a missing chunk as fill, as here.
    specs = [{**ts_spec(storage, store, str(i), use_ocdbt=ocdbt, use_zarr3=True), "fill_missing_data_reads": True}
             for i in ids]
    wheres = [f"{folder}: `{'/'.join(paths[i])}`" for i in ids]
    shared = item_stores(storage)
    leaves = []
    for i, spec, where, header in zip(ids, specs, wheres, open_all(context, specs, wheres, stores=shared)):
        dtype = np.dtype(header.dtype.numpy_dtype)
        shape = tuple(int(d) for d in header.shape)
        chunk = tuple(int(c) for c in header.chunk_layout.read_chunk.shape or ()) or None
        reader = TensorStoreReader(context, spec, shape, dtype, chunk, where=where, shared=shared)
        leaves.append(Leaf(array_row(paths[i], shape, dtype), reader, key=str(i)))
    return leaves, notes


def _open(location: str, display: str, context: ReadContext) -> FileSource:
    folder = _root(context.storage, location) or location
    leaves, notes = read_jax_pytree(context, folder)
    if normalize(folder) != normalize(location):
        notes.append(f"{display} is the array store of the jax pytree checkpoint {os.path.dirname(display.rstrip('/'))}: "
                     "read whole.")
    return FileSource(display, context, "jax-pytree", leaves, notes=notes)


FORMAT = Format(
    name="jax-pytree",
    priority=55,  # before orbax (50): its array_store/ is an OCDBT database Orbax would call an item without _METADATA
    claims=lambda location, context: _root(context.storage, location) is not None,
    open=_open,
    description="jax pytree_serialization folders",
)
