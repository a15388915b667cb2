"""jax's own pytree serialization (``jax.experimental.array_serialization.pytree_serialization.save``).

``save(tree, directory)`` writes two things into ``directory``:

* ``pytreedef.json``: the tree's structure as a base64 flatbuffer (``__jax_pytreedef_repr``) and one
  description per flattened leaf (``__jax_leaf_ids``: ``"Array(float32[2, 3])"``, or null for a None leaf);
* ``array_store/``: one OCDBT database holding every array as a zarr3 array under the key of its leaf's index
  in the flattened tree (``0``, ``2``, ...).

The structure is a flatbuffer only jax decodes: this format imports jax to name the leaves (their key paths
joined with ``/``: ``params/w``, ``l/0``); shapes and dtypes come from the arrays' own headers, data is read on
request through TensorStore. A structure jax cannot rebuild here (a custom node registered by the program that
saved it) names the leaves by their index, with a note. The folder is claimed before Orbax's (its
``array_store/`` is an OCDBT database without ``_METADATA``, which is not an Orbax item); ``array_store/`` given
alone opens its checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from treetools.ckpt.context import ReadContext
from treetools.ckpt.formats._tensorstore import TensorStoreReader, open_all, shared_ts_context, ts_spec
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


def _entry_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_paths(raw: dict[str, Any], count: int, where: str) -> tuple[list[tuple[str, ...]], list[str]]:
    """The key path of each of the ``count`` flattened leaves, from the structure jax serialized; and notes.

    jax decodes the flatbuffer (imported here only: no other format needs it for metadata).
    """
    try:
        import jax
        from jax.experimental.array_serialization import pytree_serialization_utils as utils

        treedef = utils.deserialize_pytreedef(raw)
        tree = jax.tree.unflatten(treedef, list(range(count)))
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    except (ImportError, ValueError, TypeError, KeyError, IndexError) as e:
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        return [(str(i),) for i in range(count)], [
            f"{where}: jax cannot rebuild the saved structure here ({reason}); leaves are named by their index in "
            "the flattened tree."]
    paths: list[tuple[str, ...]] = [(str(i),) for i in range(count)]
    for keypath, index in flat:
        if isinstance(index, int) and 0 <= index < count:
            paths[index] = tuple(_entry_name(e) for e in keypath) or (str(index),)
    return paths, []


def read_jax_pytree(context: ReadContext, folder: str) -> tuple[list[Leaf], list[str]]:
    """The leaves of one ``pytree_serialization.save`` folder (metadata only), and notes."""
    storage = context.storage
    meta_path = os.path.join(folder, TREEDEF_FILE)
    raw = read_json_file(storage, meta_path, what=f"jax {TREEDEF_FILE}")
    if not (isinstance(raw, dict) and isinstance(raw.get(TREE_KEY), str) and isinstance(raw.get(LEAVES_KEY), list)):
        raise CheckpointError(f"{meta_path}: not jax's pytree serialization ({TREE_KEY} and {LEAVES_KEY} expected).")
    descriptions = raw[LEAVES_KEY]
    paths, notes = leaf_paths(raw, len(descriptions), meta_path)
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
    shared = shared_ts_context(storage)
    leaves = []
    for i, spec, where, header in zip(ids, specs, wheres, open_all(context, specs, wheres)):
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
    description="jax's pytree serialization (jax.experimental.array_serialization.pytree_serialization.save: "
                "pytreedef.json and array_store/)",
)
