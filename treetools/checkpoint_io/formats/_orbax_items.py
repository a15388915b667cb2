"""What one Orbax item folder holds, read without jax or orbax: a pytree item (``_METADATA``, ``_sharding`` and
each array's zarr header), a single array (``ArrayCheckpointHandler``), a JSON item, Grain's iterator state, a
composite of items; and the folder predicates the format's claims ask (``orbax.py`` reads roots and steps).

A box that an older save wrote as a node (``kernel/value``, or nnx State saved
by plain Orbax, ``raw_value`` in flax 0.8) is read as one leaf at the box's
path: a trailing ``value``/``raw_value`` key that is its parent's only child is
dropped. Array data is read only on request, through TensorStore, one block at
a time.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
from typing import Any, Callable, Sequence

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._tensorstore import (
    TensorStoreReader,
    item_stores,
    open_all,
    subdirs,
    ts_spec,
    zarr_header,
    zarr_leaves,
)
from treetools.checkpoint_io.leaves import (EMPTY_FOLDER, NO_VALUE, Item, Leaf, Unreadable, array_row, check_name, tree_leaves,
                                   value_row)
from treetools.checkpoint_io.readers import read_metadata
from treetools.checkpoint_io.storage import SpecialFileError, Storage, normalize
from treetools.checkpoint_io.steps import (
    JSON_ITEM_FILE,
    PYTREE_METADATA_FILE,
    STEP_METADATA_FILE,
    TMP_DIR_SUFFIX,
    file_kind,
    parse_step_name,
    read_file,
    read_json_file,
    tmp_step,
)
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError
from treetools.shared.rows import LeafSharding


SHARDING_FILE = "_sharding"
OCDBT_PROCESS_PREFIX = "ocdbt.process_"  # each process's OCDBT database inside an item folder
BOX_SUFFIXES = ("value", "raw_value")
_BOXES_KEY = "treetools_boxes"  # recorded by treetools 0.1 saves, which wrote boxes as nodes
_NOT_STORED = ("None",)  # value types Orbax records without data (None leaves, empty nodes)
_VALUE_TYPES = ("scalar", "string")


# ---------------------------------------------------------------------------- pytree items


@dataclasses.dataclass(frozen=True)
class OrbaxItem(Item):
    """A pytree item and what Orbax's own restore needs of it, read once: its folder and parsed ``_METADATA``.

    Each leaf's ``key`` is its Orbax param name (``Dense_0.kernel.value``).
    """

    folder: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def _entries(raw: Any, path: str) -> list[tuple[tuple[str, ...], str, bool]]:
    """``(keys, value_type, skip)`` of every entry of a parsed ``_METADATA``, after refusing escaping keys."""
    tree = raw.get("tree_metadata") if isinstance(raw, dict) else None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: corrupt Orbax _METADATA (no `tree_metadata` object).")
    out = []
    for key, entry in tree.items():
        try:
            keys = tuple(str(k["key"]) for k in entry["key_metadata"])
            if not all(type(k["key_type"]) is int for k in entry["key_metadata"]):
                raise TypeError("key_type")  # Orbax's own restore reads it: an int (1 a sequence index, 2 a dict key)
            value = entry["value_metadata"]
            value_type = str(value["value_type"])
            skip = bool(value.get("skip_deserialize", False))
        except (KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{path}: corrupt Orbax _METADATA (entry {str(key)[:200]!r} lacks key, key_type or "
                                  "value metadata).") from None
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


def _shardings(context: ReadContext, item_dir: str) -> dict[str, LeafSharding]:
    """Param name -> ``LeafSharding`` from Orbax's ``_sharding`` file (NamedShardings only)."""
    storage = context.storage
    path = os.path.join(item_dir, SHARDING_FILE)
    if not storage.lexists(path):
        return {}
    raw = read_metadata(context, path, what="Orbax _sharding")
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
        if not all(type(size) is int and size > 0 for size in sizes):
            raise CheckpointError(f"{path}: corrupt Orbax _sharding (the mesh of {name[:200]!r} has axis sizes "
                                  f"{str(sizes)[:80]}, not positive integers).")
        entries = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
        out[name] = LeafSharding(entries, {str(a): size for a, size in zip(names, sizes)})
    return out


def _strings(context: ReadContext, item_dir: str) -> dict[str, str]:
    """The string leaves Orbax keeps in ``_strings.json`` (param name -> string); {} without one."""
    path = os.path.join(item_dir, STRINGS_FILE)
    if not context.storage.isfile(path):
        return {}
    raw = read_metadata(context, path, what=f"Orbax {STRINGS_FILE}")
    return {str(k): v for k, v in raw.items() if isinstance(v, str)} if isinstance(raw, dict) else {}


def read_pytree_item(context: ReadContext, item_dir: str, name: str, problems: list[str] | None = None) -> Item:
    """The leaves of one Orbax pytree item from ``_METADATA``, ``_sharding`` and the zarr headers.

    With ``problems``, leaves whose stored array cannot be opened are recorded
    there and left out, instead of failing the item (``verify``).
    """
    storage = context.storage
    meta_path = os.path.join(item_dir, PYTREE_METADATA_FILE)
    if not storage.lexists(meta_path):
        raise CheckpointError(
            f"{item_dir}: no {PYTREE_METADATA_FILE} file (saved by an Orbax older than 0.5, or copied without it); "
            "treetools cannot tell its leaves."
        )
    raw = read_metadata(context, meta_path, what=f"Orbax {PYTREE_METADATA_FILE}")
    entries = [e for e in _entries(raw, meta_path) if not e[2] and e[1] not in _NOT_STORED]
    custom = raw.get("custom_metadata") if isinstance(raw, dict) else None
    boxes = custom.get(_BOXES_KEY) if isinstance(custom, dict) else None
    boxes = {str(k): v for k, v in boxes.items() if isinstance(v, str)} if isinstance(boxes, dict) else None
    paths = logical_paths([keys for keys, _, _ in entries], boxes)
    use_zarr3 = bool(raw.get("use_zarr3", False))
    use_ocdbt = bool(raw.get("use_ocdbt", storage.exists(os.path.join(item_dir, "manifest.ocdbt"))))
    shardings = _shardings(context, item_dir)
    strings = _strings(context, item_dir)

    stored = [(keys, vt, path) for (keys, vt, _), path in zip(entries, paths) if vt != "string"]
    specs = [ts_spec(storage, item_dir, ".".join(keys), use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
             for keys, _, _ in stored]
    wheres = [f"{item_dir}: `{'/'.join(path)}`" for _, _, path in stored]
    shared = item_stores(storage)
    stores = iter(zip(specs, open_all(context, specs, wheres, problems, stores=shared)))
    leaves: list[Leaf] = []
    for (keys, value_type, _), path in zip(entries, paths):
        param = ".".join(keys)
        if value_type == "string":
            leaves.append(Leaf(value_row(path), key=param, value=strings.get(param, NO_VALUE)))
            continue
        spec, store = next(stores)
        if store is None:  # recorded in `problems`
            continue
        dtype = np.dtype(store.dtype.numpy_dtype)
        shape = tuple(int(d) for d in store.shape)
        chunk = tuple(int(c) for c in store.chunk_layout.read_chunk.shape or ()) or None
        reader = TensorStoreReader(context, spec, shape, dtype, chunk, where=f"{item_dir}: `{'/'.join(path)}`",
                                   shared=shared)
        if value_type in _VALUE_TYPES:  # a Python scalar: a value, counted as no parameter, shown as its value
            leaves.append(Leaf(value_row(path), reader, value=_scalar_value(reader), key=param))
        else:
            row = array_row(path, shape, dtype, sharding=shardings.get(param))
            leaves.append(Leaf(row, reader, key=param))
    return OrbaxItem(name, "pytree", leaves, folder=item_dir, metadata=raw)


def _scalar_value(reader: TensorStoreReader) -> Any:
    """The value of a Python scalar leaf (Orbax stores it as a zero-dimensional array): one element read, so that
    every view shows it (a step counter, numpy's random state ``('MT19937', key, pos, ...)``); ``NO_VALUE`` when
    it is no single element or cannot be read (``verify`` reads it again and names the problem)."""
    if tuple(reader.shape) != () or reader.dtype.kind not in "biuf":
        return NO_VALUE
    try:
        return reader.read_all().item()
    except (CheckpointError, OSError, ValueError):
        return NO_VALUE


ARRAY_ITEM_NAME = "checkpoint"
"""The one array of an ``ArrayCheckpointHandler`` item is stored under the handler's checkpoint name, ``checkpoint``."""

ARRAY_HANDLER = "ArrayCheckpointHandler"
STRINGS_FILE = "_strings.json"
"""Orbax keeps the string leaves of a pytree item in this file (param name -> string)."""
GRAIN_STATE = re.compile(r"^process_(?P<index>\d+)-of-(?P<count>\d+)\.json$")
"""Grain's ``PyGrainCheckpointHandler`` writes one JSON state per process, ``process_<i>-of-<n>.json``."""
COMPOSITE_DEPTH = 3
"""How deep items nested in items (a random-key handler's ``jax_random_key/`` sub-item) are looked for."""


def is_array_item(storage: Storage, folder: str) -> bool:
    """An ``ArrayCheckpointHandler`` save written without ``_METADATA`` (Orbax before 0.7, as xlstm-jax pins):
    ``_sharding`` and the zarr folder ``checkpoint/``; later Orbax adds ``_METADATA`` (``single_array`` reads it)."""
    return (not storage.lexists(os.path.join(folder, PYTREE_METADATA_FILE))
            and zarr_header(storage, os.path.join(folder, ARRAY_ITEM_NAME)) is not None)


def read_array_item(context: ReadContext, item_dir: str, name: str, problems: list[str] | None = None) -> Item:
    """The one array of an ``ArrayCheckpointHandler`` item without ``_METADATA``: one leaf named like the item
    (Orbax restores the item as the array itself); its ``key`` stays the stored name, ``checkpoint``."""
    storage = context.storage
    header = zarr_header(storage, os.path.join(item_dir, ARRAY_ITEM_NAME)) or ".zarray"
    (leaf,) = zarr_leaves(context, item_dir, [((name,), ARRAY_ITEM_NAME, header)], where=item_dir, problems=problems)
    if leaf is None:  # recorded in `problems`
        return Item(name, "pytree", [])
    leaf.row = dataclasses.replace(leaf.row, sharding=_shardings(context, item_dir).get(ARRAY_ITEM_NAME))
    return Item(name, "pytree", [leaf])


def _one_checkpoint_leaf(item: Item) -> bool:
    """Whether ``item`` is what an ``ArrayCheckpointHandler`` save reads as: one leaf, ``checkpoint``."""
    return len(item.leaves) == 1 and item.leaves[0].key == ARRAY_ITEM_NAME


def single_array(item: Item) -> Item:
    """An ``ArrayCheckpointHandler`` item read through its ``_METADATA`` (one leaf, ``checkpoint``) as the array
    itself: its one leaf is named like the item. Anything else comes back as it is."""
    if not _one_checkpoint_leaf(item):
        return item
    leaf = item.leaves[0]
    return dataclasses.replace(item, leaves=[dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=(item.name,)))])


def _grain_files(storage: Storage, folder: str) -> list[str]:
    try:
        names = storage.listdir(folder)
    except OSError:
        return []
    found = [(int(m.group("index")), n) for n in names
             if (m := GRAIN_STATE.match(n)) and storage.isfile(os.path.join(folder, n))]
    return [n for _, n in sorted(found, key=lambda pair: pair[0])]


PROTO_FILE = "proto.pbtxt"
"""``ProtoCheckpointHandler``'s file: the message in protobuf text format (shown as its text)."""


def _proto_file(storage: Storage, folder: str) -> str | None:
    path = os.path.join(folder, PROTO_FILE)
    return path if storage.isfile(path) else None


def read_grain_item(context: ReadContext, item_dir: str, name: str) -> Item:
    """A Grain iterator's state (``PyGrainCheckpointHandler``): one JSON file per process. One process: the item is
    that state (what Grain restores on it); several: the states by file name (``process_1-of-2``)."""
    files = _grain_files(context.storage, item_dir)
    states = {f[:-len(".json")]: read_metadata(context, os.path.join(item_dir, f), what="Grain iterator state")
              for f in files}
    value = next(iter(states.values())) if len(states) == 1 else states
    return Item(name, "json", tree_leaves(value, where=item_dir), value=value)


def item_layout(storage: Storage, folder: str, depth: int = 0) -> str | None:
    """What an item folder holds, from its files whatever handler wrote it: ``json``, ``pytree`` (``_METADATA``),
    ``array`` (an ``ArrayCheckpointHandler`` save without ``_METADATA``), ``grain`` (an iterator's per-process JSON),
    ``composite`` (items inside it: the random-key handlers' ``jax_random_key/`` and ``..._metadata/``, a
    ``CompositeCheckpointHandler`` nested in an item); None when it is none of these."""
    if not storage.isdir(folder):
        return None
    if _is_json_item(storage, folder):
        return "json"
    if storage.lexists(os.path.join(folder, PYTREE_METADATA_FILE)):
        return "pytree"
    if is_array_item(storage, folder):
        return "array"
    if _grain_files(storage, folder):
        return "grain"
    if _proto_file(storage, folder) is not None:
        return "proto"
    if depth < COMPOSITE_DEPTH and _sub_items(storage, folder, depth):
        return "composite"
    return None


def _sub_items(storage: Storage, folder: str, depth: int = 0) -> list[str]:
    try:
        names = subdirs(storage, folder)
    except CheckpointError:
        return []
    return [d for d in names if d not in _ORBAX_FILES and not d.startswith(OCDBT_PROCESS_PREFIX)
            and TMP_DIR_SUFFIX not in d and item_layout(storage, os.path.join(folder, d), depth + 1) is not None]


def read_item(context: ReadContext, item_dir: str, name: str, problems: list[str] | None = None, *,
              handler: str | None | Callable[[], str | None] = None, depth: int = 0) -> Item:
    """One item folder, whatever handler wrote it (see ``item_layout``).

    ``handler``: the class that wrote it, as the step's metadata records it: an ``ArrayCheckpointHandler`` item
    is the array itself (one leaf named like the item). Or a function that finds it, called only when the
    answer changes what is read (an item of one leaf ``checkpoint``, or an item not read, whose handler is said):
    an item folder given directly finds it in the step folder above it, a probe outside the folder (two or three
    round trips in a bucket) that most items never need.

    Raises:
      UnreadableItem: the folder holds nothing treetools reads (its files are named in the reason).
      SpecialFileError: a file read in it is no regular file (a FIFO, never opened): ``special_item`` makes it the
        reason the item is not read, where it is one item of several.
    """
    storage = context.storage
    layout = item_layout(storage, item_dir, depth)
    if layout == "json":
        return read_json_item(context, item_dir, name)
    if layout == "array":
        return read_array_item(context, item_dir, name, problems)
    if layout == "grain":
        return read_grain_item(context, item_dir, name)
    if layout == "proto":
        path = os.path.join(item_dir, PROTO_FILE)  # there when the layout was read (gone since: read_file says so)
        text = read_file(storage, path, what="Orbax proto item").decode("utf-8", "replace")
        return Item(name, "json", [Leaf(value_row((name,)), value=text)], value=text)
    if layout == "composite":
        return _read_composite(context, item_dir, name, problems, depth)
    if layout == "pytree" or _item_without_metadata(storage, item_dir):
        item = read_pytree_item(context, item_dir, name, problems)
        return single_array(item) if _one_checkpoint_leaf(item) and _short(_asked(handler)) == ARRAY_HANDLER else item
    raise UnreadableItem(name, _short(_asked(handler)) or "no handler recorded", _why_unreadable(storage, item_dir))


def _asked(handler: str | None | Callable[[], str | None]) -> str | None:
    """``read_item``'s ``handler``, found now when it is a function."""
    return handler() if callable(handler) else handler


def special_item(e: SpecialFileError, name: str, item_dir: str, handler: str | None) -> Unreadable:
    """Item ``name`` listed as not read because a file it holds is no regular file (``e``: a FIFO, never opened)."""
    return Unreadable(name, _short(handler) or "no handler recorded", _not_regular(e.path, e.kind, item_dir))


def _not_regular(path: str, kind: str, folder: str) -> str:
    """The reason an item is not read: ``path`` (shown below the item ``folder``) is ``kind``, no regular file."""
    head = normalize(folder).rstrip("/") + "/"
    shown = path[len(head):] if path.startswith(head) else path
    return f"`{shown}` is not a regular file ({kind}), and treetools never opens one"


def _key_notes(storage: Storage, item_dir: str, name: str) -> list[str]:
    """A note for a typed key saved by ``JaxRandomKeyCheckpointHandler``: shown as its key data."""
    meta = os.path.join(item_dir, "jax_random_key_metadata", JSON_ITEM_FILE)
    if not storage.isfile(meta):
        return []
    try:
        value = read_json_file(storage, meta, what="Orbax random key metadata")
    except (CheckpointError, CheckpointNotFoundError):
        return []
    if not (isinstance(value, dict) and value.get("typed") is True):
        return []
    return [f"item `{name}` is a typed PRNG key (JaxRandomKeyCheckpointHandler), shown as its key data; "
            "restored onto a key target (jax.random.key) it is the key again."]


class UnreadableItem(CheckpointError):
    """An item folder holding nothing treetools reads: ``unreadable`` says which, who wrote it, and why."""

    def __init__(self, name: str, handler: str, reason: str):
        super().__init__(f"item `{name}` ({handler}) cannot be read: {reason}")
        self.unreadable = Unreadable(name, handler, reason)


def _short(handler: str | None) -> str | None:
    return str(handler).rsplit(".", 1)[-1] if handler else None


def _why_unreadable(storage: Storage, folder: str) -> str:
    try:
        with storage.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as e:
        return f"its folder cannot be listed ({e.strerror or e})"
    odd = [e for e in entries if not (e.is_file() or e.is_dir())]  # a FIFO where a JSON item's file is: say so
    if odd:
        return "; ".join(_not_regular(e.path, file_kind(storage, e.path), folder) for e in odd[:4])
    names = [e.name for e in entries]
    shown = ", ".join(f"`{n}`" for n in names[:8]) + (", ..." if len(names) > 8 else "")
    return (f"{EMPTY_FOLDER if not shown else f'its folder holds {shown}'}: no Orbax _METADATA, JSON file, zarr array, proto text or "
            "Grain iterator state, which are what treetools reads")


def _read_composite(context: ReadContext, folder: str, name: str, problems: list[str] | None, depth: int) -> Item:
    """Items inside an item. The random-key handlers save the key as one sub-item (``jax_random_key/``: the key
    data, written as an ``ArrayCheckpointHandler`` array; ``np_random_key/``: numpy's state tuple) beside its JSON
    metadata (``jax_random_key_metadata/``): the item is that one sub-item (one array: named like the item).
    Several sub-items: each one's leaves below its name."""
    storage = context.storage
    subs = _sub_items(storage, folder, depth)
    main = [s for s in subs if not (s.endswith("_metadata") and s[:-len("_metadata")] in subs)]
    if len(main) == 1:
        inner = read_item(context, os.path.join(folder, main[0]), name, problems, depth=depth + 1,
                          handler=ARRAY_HANDLER)
        return inner
    leaves: list[Leaf] = []
    for sub in subs:
        inner = read_item(context, os.path.join(folder, sub), sub, problems, depth=depth + 1)
        leaves += [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=(sub, *leaf.path)))
                   for leaf in inner.leaves]
    return Item(name, "pytree", leaves)


def _json_file(storage: Storage, folder: str) -> str:
    """The file of a JSON item: ``metadata`` (JsonSave's default), else one named as its folder.

    A manager with ``best_fn`` stores the step's metrics as the item ``metrics``
    in the file ``metrics/metrics``.
    """
    own = os.path.join(folder, os.path.basename(normalize(folder)))
    default = os.path.join(folder, JSON_ITEM_FILE)
    return own if not _is_file(storage, default) and _is_file(storage, own) else default


def read_json_item(context: ReadContext, item_dir: str, name: str) -> Item:
    storage = context.storage
    path = _json_file(storage, item_dir)
    value = read_metadata(context, path, what="Orbax JSON item")
    return Item(name, "json", tree_leaves(value, where=path), value=value)


# ---------------------------------------------------------------------------- folders


def _is_file(storage: Storage, path: str) -> bool:
    return storage.isfile(path)


def _is_json_item(storage: Storage, folder: str) -> bool:
    path = _json_file(storage, folder)
    if not _is_file(storage, path) or storage.lexists(os.path.join(folder, PYTREE_METADATA_FILE)):
        return False
    try:
        with storage.open(path) as f:
            head = f.read(64).lstrip()
    except OSError:
        return False
    return head[:1] in (b"{", b"[")


is_json_item = _is_json_item


def _is_item(storage: Storage, folder: str) -> bool:
    return storage.lexists(os.path.join(folder, PYTREE_METADATA_FILE)) or _is_json_item(storage, folder) or is_array_item(storage, folder)


def _item_without_metadata(storage: Storage, folder: str) -> bool:
    """Orbax's own item files (OCDBT manifest, ``_sharding``) without ``_METADATA``: read_pytree_item names what is missing."""
    return any(storage.isfile(os.path.join(folder, f)) for f in ("manifest.ocdbt", SHARDING_FILE))


def _listed_item(storage: Storage, folder: str) -> bool:
    """A folder its step's ``_CHECKPOINT_METADATA`` lists as an item (whatever handler wrote it: a random key's
    folder of sub-items, a Grain iterator's state), holding something ``item_layout`` reads."""
    parent = os.path.dirname(normalize(folder))
    meta = os.path.join(parent, STEP_METADATA_FILE)
    if parent == normalize(folder) or not storage.isfile(meta):
        return False
    try:
        handlers = read_json_file(storage, meta, what=f"Orbax {STEP_METADATA_FILE}").get("item_handlers")
    except (CheckpointError, CheckpointNotFoundError, AttributeError):
        return False
    return (isinstance(handlers, dict) and os.path.basename(normalize(folder)) in handlers
            and item_layout(storage, folder) is not None)


def _step_is_item(storage: Storage, folder: str) -> bool:
    """A step folder that is itself the item: a Checkpointer's save per step (Flax's ``checkpoint_<N>`` Orbax mode)."""
    return (parse_step_name(os.path.basename(folder)) is not None
            and storage.lexists(os.path.join(folder, STEP_METADATA_FILE)) and _is_item(storage, folder))


def _looks_like_step(storage: Storage, folder: str) -> bool:
    """A step folder: one with Orbax's step metadata, or (Orbax before it wrote that file) one holding an item.

    A folder of step folders that are items (or their tmp folders) is a root, not a step holding items; and a
    subfolder that is a save of its own (its own ``_CHECKPOINT_METADATA``: a StandardCheckpointer's output, a
    converted ``orbax_ckpt/``) makes no step of the folder holding it (a repository root beside ``.git``)."""
    if storage.lexists(os.path.join(folder, STEP_METADATA_FILE)):
        return True
    try:
        return any(_is_item(storage, os.path.join(folder, d))
                   and not (_step_is_item(storage, os.path.join(folder, d)) or tmp_step(d) is not None
                            or storage.lexists(os.path.join(folder, d, STEP_METADATA_FILE)))
                   for d in subdirs(storage, folder))
    except CheckpointError:
        return False


_ORBAX_FILES = {"_METADATA", "_sharding", "_CHECKPOINT_METADATA", "commit_success.txt", "array_metadatas", "d",
                "manifest.ocdbt", "descriptor", "metadata", STRINGS_FILE, "orbax.checkpoint", "proto.pbtxt"}
