"""Any folder tree of zarr / zarr3 / N5 arrays, read by its structure: the structural reader asked last.

Many JAX writers store one TensorStore array per leaf and nothing else:
jax's own ``serialization.async_serialize`` / ``GlobalAsyncCheckpointManager``
(paxml and older T5X: one folder per leaf, ``checkpoint_<N>/`` steps),
big_vision's ``save_checkpoint_ts`` (one array per leaf named with ``~`` for
``/``, step folders ``<name>-<step:09d>`` and a ``<name>-LAST`` file naming
the latest complete one), Levanter's ``save_checkpoint`` export without its
``metadata.json``. No marker file names them; this reader takes what the
folders say:

* **arrays**: every folder holding a zarr header (``.zarray``; ``zarr.json``
  of ``node_type`` array) or an N5 ``attributes.json`` with ``dimensions``;
  shape and dtype from the header, data on request through TensorStore;
* **names**: each array's folder path below the checkpoint, split as the
  writer joined it: ``/`` (nested folders), ``~`` (big_vision) or ``.`` (a
  flat folder of dotted names, jax's per-leaf folders) all read as ``/``;
* **steps**: a folder whose sub-folders are named like steps with a prefix
  (``checkpoint_100``, ``ckpt-2``, ``checkpoint.bv-000000100``) and hold
  arrays is a root of steps; a ``<prefix>-LAST`` pointer file is honoured
  (the latest step is the one it names; a newer step folder is a save in
  progress, listed as incomplete); ``-tmp`` step folders of big_vision are
  complete saves kept until the next one.

Each checkpoint is one item, ``default``; ``load_parameters`` finds the
parameters inside it (``params``, ``target``, Levanter's ``model``, ...). A
note says that this reader read it. Folders holding another format's marker
(``_METADATA``, ``_CHECKPOINT_METADATA``, ``manifest.ocdbt``,
``tensorstore_index.json``, ``pytreedef.json``, Levanter's ``metadata.json``)
are never claimed: their own format reads them, or names what is missing.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Sequence

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._orbax_items import logical_paths
from treetools.checkpoint_io.formats._tensorstore import TensorStoreReader, item_stores, natural_key, open_all
from treetools.checkpoint_io.formats._ts_folders import KEY_WORK, LOOKUP_WORK, LOOKUPS_PER_STORED_BYTE
from treetools.checkpoint_io.formats._ts_kvstore import kvstore_spec
from treetools.checkpoint_io.readers import ArrayReader
from treetools.checkpoint_io.leaves import DEFAULT_ITEM, Item, Leaf, Snapshot, array_row, check_name
from treetools.checkpoint_io.source import Format, Layout, RootLayout, Source, StepLayout
from treetools.checkpoint_io.steps import read_file, step_series
from treetools.checkpoint_io.storage import OutsideCheckpointError, Storage, normalize
from treetools.shared.errors import CheckpointError

STEP_NAMES = re.compile(r"^(?P<prefix>.*?[-_.])(?P<step>\d+)(?:-tmp)?$")
"""Step folders with a prefix: ``checkpoint_100``, ``ckpt-2``, big_vision's ``checkpoint.bv-000000100[-tmp]``."""

LAST_SUFFIX = "-LAST"
"""big_vision's pointer: ``<path>-LAST`` holds the step part of the latest complete ``<path>-<step>`` folder."""

FOREIGN = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "tensorstore_index.json", "pytreedef.json",
           "metadata.json", "_sharding")
"""Files of formats with their own reader (Orbax, EasyDeL, jax's pytree format, Levanter): never claimed here."""

PROBE_FOLDERS = 256
"""How many folders ``claims`` looks at (depth first) for an array: cheap, and enough to reach the first leaf."""

MAX_FOLDERS = 1_000_000
"""The most folders one tree is walked through (a runaway tree is refused, not walked for ever)."""

N5_HEADER = "attributes.json"


def _header(storage: Storage, folder: str, files: Sequence[str], *, strict: bool = False) -> str | None:
    """The TensorStore driver of an array folder (``zarr``, ``zarr3``, ``n5``), None for any other folder.

    ``strict`` (reading the tree, not probing it): a ``zarr.json`` or ``attributes.json`` that cannot be read
    (a FIFO, never opened; truncated, not JSON) is refused in one line naming it, never taken for "no array"
    (the array it heads would be left out without a word)."""
    if ".zarray" in files:
        return "zarr"
    for name, driver in (("zarr.json", "zarr3"), (N5_HEADER, "n5")):
        if name not in files:
            continue
        path = os.path.join(folder, name)
        try:
            meta = json.loads(read_file(storage, path, what="array header", max_bytes=2**20).decode("utf-8"))
        except OutsideCheckpointError:
            raise  # a header linked out of the checkpoint: refused, not "no array"
        except CheckpointError:
            if strict:
                raise
            continue
        except (ValueError, UnicodeDecodeError) as e:
            if strict:
                raise CheckpointError(f"{path}: not a JSON array header ({str(e)[:80]}): truncated or damaged; "
                                      "its folder cannot be read.") from None
            continue
        if not isinstance(meta, dict):
            continue
        if driver == "zarr3" and meta.get("node_type") == "array":
            return driver
        if driver == "n5" and isinstance(meta.get("dimensions"), list) and "dataType" in meta:
            return driver
    return None


def _files(storage: Storage, folder: str) -> tuple[list[str], list[str]]:
    """``(sub-folders, files)`` of ``folder``, sorted; a link is what it leads to (``Storage.scandir``)."""
    try:
        with storage.scandir(folder) as it:
            entries = list(it)
    except OSError:
        return [], []
    dirs = sorted(e.name for e in entries if e.is_dir())
    files = sorted(e.name for e in entries if not e.is_dir())
    return dirs, files


def _probe(storage: Storage, top: str) -> bool:
    """Whether a depth-first look at a few folders below ``top`` finds an array and no other format's marker."""
    try:
        for seen, (folder, _dirs, files) in enumerate(storage.walk(top)):
            if seen >= PROBE_FOLDERS:
                return False
            if any(f in FOREIGN for f in files) or (folder == top and "checkpoint" in files):
                return False  # another format's checkpoint (a T5X step: its `checkpoint` msgpack)
            if _header(storage, folder, files) is not None:
                return True
    except OSError:  # an unreadable folder: no evidence of arrays
        return False
    return False


def arrays_below(storage: Storage, top: str) -> tuple[list[tuple[tuple[str, ...], str, str]], list[str]]:
    """Every array folder at or below ``top``: ``(folder parts relative to top, driver, folder)``, in natural
    order; and the notes (folders holding another format's files, skipped).

    A folder linked inside the checkpoint is read under its own name, as the
    folder it leads to; one linked out of it is refused (``CheckpointError``
    naming ``--follow-links``), never left out (``Storage.walk``).
    """
    found: list[tuple[tuple[str, ...], str, str]] = []
    notes: list[str] = []
    base = normalize(top)
    for seen, (folder, dirs, files) in enumerate(storage.walk(top), 1):
        if seen > MAX_FOLDERS:
            raise CheckpointError(f"{top}: more than {MAX_FOLDERS:,} folders; not walked further (is this a "
                                  "checkpoint?).")
        rel = normalize(folder)[len(base):].strip("/")
        parts = tuple(re.split(r"[/\\]", rel)) if rel else ()
        driver = _header(storage, folder, files, strict=True)
        if driver is not None:
            found.append((parts, driver, folder))
            dirs[:] = []  # its chunks (and nested chunk folders)
    return sorted(found, key=lambda a: natural_key(a[0])), notes


def leaf_names(folders: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Each array's path, from its folder parts as the writer joined the names: nested folders (``/``),
    big_vision's ``~`` inside a folder name, or a flat folder of dotted names (jax's per-leaf folders).

    >>> leaf_names([("params~head~kernel",), ("step",)])
    [('params', 'head', 'kernel'), ('step',)]
    >>> leaf_names([("target.decoder.kernel",), ("state.step",)])
    [('target', 'decoder', 'kernel'), ('state', 'step')]
    >>> leaf_names([("model", "w.1")])
    [('model', 'w.1')]
    """
    if any("~" in p for parts in folders for p in parts):
        return [tuple(x for p in parts for x in p.split("~")) for parts in folders]
    if folders and all(len(parts) == 1 for parts in folders) and any("." in parts[0] for parts in folders):
        return [tuple(parts[0].split(".")) for parts in folders]
    return [tuple(parts) for parts in folders]


def _spec(storage: Storage, folder: str, driver: str) -> dict[str, Any]:
    return {"driver": driver, "kvstore": kvstore_spec(storage, folder), "recheck_cached_data": False,
            "recheck_cached_metadata": False}


def read_tree(context: ReadContext, top: str, *, problems: list[str] | None = None) -> list[Leaf]:
    """The leaves of one tree of arrays (metadata only: headers opened in bounded batches)."""
    storage = context.storage
    arrays, _ = arrays_below(storage, top)
    if not arrays:
        raise CheckpointError(f"{top}: holds no zarr, zarr3 or N5 array.")
    name = os.path.basename(normalize(top))
    paths = leaf_names([parts for parts, _, _ in arrays])
    # `top` itself is one array: named like its folder; a box saved as a node (`kernel/value`) is one leaf
    paths = logical_paths([p if p else (name,) for p in paths])
    for path in paths:
        for part in path:
            check_name(part, where=top)
    specs = [_spec(storage, folder, driver) for _, driver, folder in arrays]
    wheres = [f"{top}: `{'/'.join(p)}`" for p in paths]
    shared = item_stores(storage)
    leaves = []
    for (parts, _, folder), path, spec, where, header in zip(arrays, paths, specs, wheres,
                                                              open_all(context, specs, wheres, problems, stores=shared)):
        if header is None:  # recorded in `problems`
            continue
        dtype = np.dtype(header.dtype.numpy_dtype)
        shape = tuple(int(d) for d in header.shape)
        chunk = tuple(int(c) for c in header.chunk_layout.read_chunk.shape or ()) or None
        keys = tuple(int(c) for c in header.chunk_layout.write_chunk.shape or ()) or chunk
        why = _out_of_proportion(storage, folder, where, shape, keys)
        reader = (TensorStoreReader(context, spec, shape, dtype, chunk, where=where, shared=shared) if why is None
                  else RefusedReader(context, shape, dtype, chunk, why))
        leaves.append(Leaf(array_row(path, shape, dtype), reader, key="/".join(parts)))
    return leaves


class RefusedReader(ArrayReader):
    """An array whose metadata is shown and whose every read is refused before it starts (``why``, one line)."""

    def __init__(self, context: ReadContext, shape: tuple[int, ...], dtype: np.dtype, chunk: Any, why: str):
        self.context, self.shape, self.dtype, self.chunk_shape, self.why = context, shape, dtype, chunk, why

    def read(self, index: Any) -> np.ndarray:
        raise CheckpointError(self.why)


def _out_of_proportion(storage: Storage, folder: str, where: str, shape: Sequence[int],
                       chunk: Sequence[int] | None) -> str | None:
    """Why reading the array of ``folder`` is refused, or None: TensorStore looks up every chunk (a file here) a
    read spans, stored or not (a chunk never written reads as the fill value), at about 90 us each, so a
    126-byte header declaring 2^34 chunks ran without end. The chunks are held to the bound OCDBT lookups are
    held to (``check_lookups``: ``KEY_WORK`` each, ``LOOKUP_WORK`` plus ``LOOKUPS_PER_STORED_BYTE`` per byte
    stored in the folder); the folder is measured only for an array of more chunks than ``LOOKUP_WORK`` allows."""
    keys = math.prod(-(-int(n) // max(1, int(c))) for n, c in zip(shape, chunk or shape))
    if keys * KEY_WORK <= LOOKUP_WORK:
        return None
    stored = 0
    for top, _, files in storage.walk(folder):
        for name in files:
            try:
                stored += storage.getsize(os.path.join(top, name))
            except OSError:
                continue
        if keys * KEY_WORK <= LOOKUP_WORK + LOOKUPS_PER_STORED_BYTE * stored:
            return None
    return (f"{where}: {keys:,} chunks to look up (each a file, stored or not) for {stored:,} bytes stored in its "
            "folder: reading them would take out of proportion to what is stored (a compute bomb?); refusing to "
            "start.")


def _pointer(storage: Storage, root: str, series: str) -> int | None:
    """The step a ``<series>LAST`` pointer names (big_vision: ``<path>-LAST`` holds ``000000100[-tmp]``)."""
    path = os.path.join(root, series.rstrip("-_.") + LAST_SUFFIX)
    if not storage.isfile(path):
        return None
    try:
        text = read_file(storage, path, what="latest-checkpoint pointer", max_bytes=4096).decode("utf-8").strip()
    except (CheckpointError, UnicodeDecodeError):
        return None
    m = re.match(r"^(\d+)(?:-tmp)?$", text)
    return int(m.group(1)) if m else None


def _committed(folder: str, storage: Storage) -> bool:
    """A step folder holding arrays, not newer than its series' latest-pointer (a newer one is being written)."""
    name = os.path.basename(normalize(folder))
    found = step_series(name, names=STEP_NAMES)
    if found is None or not _probe(storage, folder):
        return False
    pointed = _pointer(storage, os.path.dirname(normalize(folder)), found[0])
    return pointed is None or found[1] <= pointed


def _step_children(storage: Storage, folder: str) -> list[str]:
    dirs, _ = _files(storage, folder)
    return [d for d in dirs if STEP_NAMES.match(d)]


def _is_root(storage: Storage, folder: str) -> bool:
    """A folder of step folders of arrays (and no arrays of its own beside them)."""
    dirs, files = _files(storage, folder)
    if _header(storage, folder, files) is not None or any(f in FOREIGN for f in files):
        return False
    steps = [d for d in dirs if STEP_NAMES.match(d)]
    if not steps:
        return False
    others = [d for d in dirs if d not in steps]
    if any(_probe(storage, os.path.join(folder, d)) for d in others):
        return False  # arrays beside the step folders: one tree whose names end in numbers
    return any(_probe(storage, os.path.join(folder, d)) for d in steps[-3:])


class ZarrTreeSource(Source):
    """A folder of step folders of arrays (``RootLayout``) or one tree of arrays (``StepLayout``): item
    ``default``."""

    format = "zarr-tree"

    def __init__(self, display: str, context: ReadContext, layout: Layout):
        super().__init__(display, context, layout=layout, names=STEP_NAMES, commit_rule=_committed,
                         prefer=("checkpoint_", "checkpoint-", "ckpt_", "ckpt-", ""))
        self.notes.append(f"{display}: read by the structural zarr-tree reader (no format's marker file): one array "
                          "per folder, leaf names from the folder paths.")

    def item_names(self, step: int | None) -> list[str]:
        return [DEFAULT_ITEM]

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        leaves = read_tree(self.context, self.step_folder(step))
        return Snapshot(step, {name: Item(name, "pytree", leaves) for name in names})

    def verify_metadata(self, step: int | None) -> tuple[list[Item], list[str]]:
        problems: list[str] = []
        try:
            leaves = read_tree(self.context, self.step_folder(step), problems=problems)
        except CheckpointError as e:
            return [], problems + [str(e)]
        return [Item(DEFAULT_ITEM, "pytree", leaves)], problems


def _claims(location: str, context: ReadContext) -> bool:
    storage = context.storage
    if not storage.isdir(location):
        return False
    return _is_root(storage, location) or _probe(storage, location)


def _open(location: str, display: str, context: ReadContext) -> ZarrTreeSource:
    layout = RootLayout(location) if _is_root(context.storage, location) else StepLayout(location)
    return ZarrTreeSource(display, context, layout)


FORMAT = Format(
    name="zarr-tree",
    priority=1,  # structural: asked after every format that knows its files
    claims=_claims,
    open=_open,
    structural=True,
    description="zarr/N5 array folders",
)
