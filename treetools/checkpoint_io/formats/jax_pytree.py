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
from typing import Any, Iterator

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._tensorstore import OPEN_BATCH, TensorStoreReader, item_stores, open_all, ts_spec
from treetools.checkpoint_io.leaves import Leaf, array_row, check_name
from treetools.checkpoint_io.source import FileSource, Format
from treetools.checkpoint_io.steps import read_json_file
from treetools.checkpoint_io.storage import Storage, normalize
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

    def vector(self, table: int, index: int) -> tuple[int, int]:
        """Where the entries of a vector of offsets (tables or strings) start, and how many; ``(0, 0)`` when
        absent. Entries are found one at a time (``entry``): a node of 800,000 children holds no list of them."""
        pos = self.field(table, index)
        if pos is None:
            return 0, 0
        vec = pos + self._u("<I", pos)
        n = self._u("<I", vec)
        if n > (len(self.buf) - vec) // 4:
            raise CheckpointError(f"{self.where}: corrupt {TREE_KEY} (a vector of {n:,} entries).")
        return vec + 4, n

    def entry(self, start: int, i: int) -> int:
        """The position of entry ``i`` of a vector of offsets starting at ``start``."""
        return start + 4 * i + self._u("<I", start + 4 * i)

    def string(self, pos: int) -> str:
        n = self._u("<I", pos)
        if pos + 4 + n > len(self.buf):
            raise CheckpointError(f"{self.where}: corrupt {TREE_KEY} (a string past the end of its data).")
        return self.buf[pos + 4:pos + 4 + n].decode("utf-8", "replace")


def _flat(raw: dict[str, Any], where: str) -> _Flat:
    try:
        return _Flat(base64.b64decode(raw[TREE_KEY], validate=True), where)
    except (ValueError, TypeError):
        raise CheckpointError(f"{where}: corrupt {TREE_KEY} (not base64).") from None


def iter_leaf_paths(raw: dict[str, Any], where: str) -> Iterator[tuple[str, ...]]:
    """The key path of every flattened leaf (in jax's flatten order), from the serialized ``PyTreeDef``: dict keys
    by name, tuple/list/custom-node children by position. Read without jax, one leaf at a time.

    What it holds is the path being walked, never a list of every leaf or child. In a tree every node but the
    root takes a 4-byte offset in its parent's vector and a table of its own (at least its 4-byte vtable
    offset), so the nodes walked are bounded by the bytes, 1 + bytes / 8: a DAG of shared nodes (a 28 KB file
    spelling 2^60 leaves, which grew the process past 2 GB) is refused once it outgrows them.

    >>> list(iter_leaf_paths({TREE_KEY: "EAAAAAAACgAQAA8ACAAEAAoAAAAMAAAAJAAAAAAAAAQCAAAAEAAAAAQAAAABAAAAYgAAAAEAAABhAAAAAgAAABAAAAAEAAAA/P///wQABAAEAAAA"}, "x"))  # jax: {"b": 1, "a": 2}
    [('a',), ('b',)]
    """
    flat = _flat(raw, where)
    most = min(MAX_NODES, 1 + len(flat.buf) // 8)
    walked = 0

    def visit(table: int, depth: int) -> int:
        nonlocal walked
        walked += 1
        if walked > most:
            raise CheckpointError(f"{where}: corrupt {TREE_KEY} (more nodes than its {len(flat.buf):,} bytes can "
                                  "spell: nodes shared, as no tree has them).")
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{where}: {TREE_KEY} nests deeper than a checkpoint does.")
        return flat.kind(table)

    root = flat.root()
    if visit(root, 0) == _KIND_LEAF:
        yield ()
        return
    # One frame per node on the path walked: (kind, children vector, names vector, next child, path to the node).
    stack: list[list[Any]] = []

    def push(table: int, kind: int, path: tuple[str, ...]) -> None:
        if kind == _KIND_NONE:
            return
        if kind not in (_KIND_DICT, _KIND_TUPLE, _KIND_LIST, _KIND_CUSTOM):
            raise CheckpointError(f"{where}: corrupt {TREE_KEY} (a node of unknown kind {kind}).")
        children = flat.vector(table, 1)
        names = flat.vector(table, 2) if kind == _KIND_DICT else (0, 0)
        if kind == _KIND_DICT and names[1] != children[1]:
            raise CheckpointError(f"{where}: corrupt {TREE_KEY} (a dict whose keys and children differ in number).")
        stack.append([kind, children, names, 0, path])

    push(root, flat.kind(root), ())
    while stack:
        frame = stack[-1]
        kind, (start, n), (names_at, _), i, path = frame
        if i == n:
            stack.pop()
            continue
        frame[3] = i + 1
        child = flat.entry(start, i)
        name = flat.string(flat.entry(names_at, i)) if kind == _KIND_DICT else str(i)
        child_kind = visit(child, len(path) + 1)
        if child_kind == _KIND_LEAF:
            yield path + (name,)
        else:
            push(child, child_kind, path + (name,))


def leaf_paths(raw: dict[str, Any], where: str) -> list[tuple[str, ...]]:
    """Every leaf's key path (``iter_leaf_paths``), as a list.

    >>> leaf_paths({TREE_KEY: "EAAAAAAACgAQAA8ACAAEAAoAAAAMAAAAJAAAAAAAAAQCAAAAEAAAAAQAAAABAAAAYgAAAAEAAABhAAAAAgAAABAAAAAEAAAA/P///wQABAAEAAAA"}, "x")
    [('a',), ('b',)]
    """
    return list(iter_leaf_paths(raw, where))


def read_jax_pytree(context: ReadContext, folder: str) -> tuple[list[Leaf], list[str]]:
    """The leaves of one ``pytree_serialization.save`` folder (metadata only), and notes."""
    storage = context.storage
    meta_path = os.path.join(folder, TREEDEF_FILE)
    raw = read_json_file(storage, meta_path, what=f"jax {TREEDEF_FILE}")
    if not (isinstance(raw, dict) and isinstance(raw.get(TREE_KEY), str) and isinstance(raw.get(LEAVES_KEY), list)):
        raise CheckpointError(f"{meta_path}: not jax's pytree serialization ({TREE_KEY} and {LEAVES_KEY} expected).")
    descriptions = raw[LEAVES_KEY]
    count = sum(1 for _ in iter_leaf_paths(raw, meta_path))  # first counted, nothing kept: a mismatch costs nothing
    if count != len(descriptions):
        raise CheckpointError(f"{meta_path}: its structure has {count:,} leaves and {LEAVES_KEY} lists "
                              f"{len(descriptions):,}; the file is corrupt.")
    notes: list[str] = []
    store = os.path.join(folder, ARRAY_STORE)
    ocdbt = storage.isfile(os.path.join(store, "manifest.ocdbt"))
    shared = item_stores(storage)
    leaves: list[Leaf] = []
    batch: list[tuple[int, tuple[str, ...]]] = []

    def flush() -> None:
        # jax writes no chunk that equals the fill value (zeros) and reads a missing chunk as fill, as here.
        specs = [{**ts_spec(storage, store, str(i), use_ocdbt=ocdbt, use_zarr3=True), "fill_missing_data_reads": True}
                 for i, _ in batch]
        wheres = [f"{folder}: `{'/'.join(path)}`" for _, path in batch]
        headers = open_all(context, specs, wheres, stores=shared)
        for (i, path), spec, where, header in zip(batch, specs, wheres, headers):
            if header is None:  # only with problems=, which collects instead of raising
                continue
            dtype = np.dtype(header.dtype.numpy_dtype)
            shape = tuple(int(d) for d in header.shape)
            chunk = tuple(int(c) for c in header.chunk_layout.read_chunk.shape or ()) or None
            reader = TensorStoreReader(context, spec, shape, dtype, chunk, where=where, shared=shared)
            leaves.append(Leaf(array_row(path, shape, dtype), reader, key=str(i)))
        batch.clear()

    # Specs are made and headers opened a batch at a time, as the paths are walked: what is held before an array
    # that is not there is refused is one batch, not a spec per declared leaf (800,000 of them held 661 MB).
    for i, path in enumerate(iter_leaf_paths(raw, meta_path)):
        if descriptions[i] is None or descriptions[i] == "null":
            continue
        path = path or (str(i),)  # a tree that is one array: named by its index
        for part in path:
            check_name(part, where=meta_path)
        batch.append((i, path))
        if len(batch) == OPEN_BATCH:
            flush()
    flush()
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
