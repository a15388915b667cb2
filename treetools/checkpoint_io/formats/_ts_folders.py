"""The local folders TensorStore reads, opened once and checked (``Pins``), and what the readers of one item
share (``ItemStores``): one TensorStore context, its cache, and those folders.

Not a format (its name starts with ``_``); ``_tensorstore`` reads arrays through these. Why the folders are
pinned: TensorStore opens files by path, so every local folder a spec names is opened once, checked (everything
below it must resolve inside the checkpoint) and handed to TensorStore as ``/proc/self/fd/N``; a folder swapped
after the check is not the one read.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any, Callable, Sequence

from treetools.checkpoint_io.context import DEFAULT_MEMORY_BUDGET
from treetools.checkpoint_io.formats._ocdbt import Database, check_database
from treetools.checkpoint_io.steps import file_kind
from treetools.checkpoint_io.formats._ts_kvstore import Pinned, folder_of, pin, tensorstore_context
from treetools.checkpoint_io.storage import Storage, normalize
from treetools.shared.errors import CheckpointError

OPEN_FILES = (".zarray", "zarr.json", ".zattrs")
"""The files TensorStore reads to open a zarr array (the data are the chunk files beside them)."""

LOOKUP_WORK = 2**34
"""Chunk lookups one array may cost in an OCDBT database before the bytes it stores count: chunks x bytes of the
b-tree leaf each lookup scans (measured on two cores: 2^34 is about 3 s of TensorStore's time, 2^18 chunks in a
3 MB leaf about 100 s)."""

LOOKUPS_PER_STORED_BYTE = 2**10
"""Chunk lookup work (as ``LOOKUP_WORK`` counts it) each byte the database stores on disk allows on top."""

KEY_WORK = 2**18
"""What each chunk lookup costs whatever the leaf it scans, in ``LOOKUP_WORK``'s units: TensorStore's own work for
one chunk read, stored or missing (measured: 2^16 chunks missing from a 450-byte database, read with
``fill_missing_data_reads`` as jax's pytree serialization reads, took 3 s of ``--stats``, about 45 us a chunk;
2^23 of them ran for minutes)."""


def check_lookups(where: str, keys: int, database: Database) -> None:
    """Refuse to read an array of ``keys`` chunks (or shards) from an OCDBT ``database`` when looking them up would
    cost out of proportion to what the database stores.

    TensorStore looks every chunk of a read up in the b-tree leaf holding it, a
    scan of the leaf: the work grows with chunks x leaf size, while a leaf of
    ``2^18`` one-byte chunks compresses to a few hundred bytes. Work is held to
    ``LOOKUP_WORK`` plus ``LOOKUPS_PER_STORED_BYTE`` per byte on disk, before anything is read; each chunk
    costs ``KEY_WORK`` on top of its leaf's bytes (a chunk never stored costs TensorStore a lookup all the same).

    >>> from treetools.checkpoint_io.formats._ocdbt import Database
    >>> check_lookups("w", 8, Database(stored_bytes=1202, node_bytes=408, leaf_bytes=408, nodes=1))
    >>> check_lookups("ckpt/params: `w`", 2**18, Database(4538, 3407984, 3407984, 1))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    treetools.shared.errors.CheckpointError: ckpt/params: `w`: 262,144 chunks to look up in an OCDBT b-tree leaf of ...
    """
    work = keys * (KEY_WORK + database.leaf_bytes)
    if work > LOOKUP_WORK + LOOKUPS_PER_STORED_BYTE * database.stored_bytes:
        raise CheckpointError(
            f"{where}: {keys:,} chunks to look up in an OCDBT b-tree leaf of up to {database.leaf_bytes:,} bytes, "
            f"from a database of {database.stored_bytes:,} bytes on disk: reading them would take out of proportion "
            "to what is stored (a compute bomb?); refusing to start."
        )


# ---------------------------------------------------------------------------- local folders, checked


def check_ocdbt(storage: Storage, base: str, budget: float, *, shown: str | None = None) -> Database:
    """Refuse an OCDBT database whose manifests or b-tree nodes may decode to more than the budget.

    TensorStore decodes a manifest and each b-tree node whole; what each may
    decode to is bounded from its stored zstd stream (``_ocdbt.check_database``),
    not from the ``max_decoded_node_bytes`` the manifest declares (Orbax writes
    100,000,000 and readers do not enforce it). Held to the budget (the default
    budget where none applies, as for ``load_parameters``). ``base`` is the
    database's folder (a pinned local folder or a URL); ``shown`` names it in errors.
    """
    return check_database(storage, base, min(budget, DEFAULT_MEMORY_BUDGET), shown=shown)


class Pins:
    """The local folders of TensorStore specs, opened once and checked, and the specs rewritten to read
    through them. Close it when TensorStore is done with the stores opened from its specs.

    ``data``: the stores will read array data, so every file below each array
    folder is checked; else (opening headers) only the zarr header files. An
    OCDBT database's folder is always checked whole (its manifest and data
    files are what opening a header reads) and its manifest held to ``budget``.
    """

    def __init__(self, storage: Storage, *, data: bool, budget: float, where: str = "", recheck: bool = False):
        self._storage, self._data, self._budget, self._where = storage, data, budget, where
        self.recheck = recheck
        self._pins: dict[tuple[str, bool], Pinned] = {}
        self._remote_checked: set[str] = set()
        self._refused: dict[tuple[str, bool], CheckpointError] = {}
        self.databases: dict[str, Database] = {}
        """The OCDBT databases pinned, by folder: what they store, and the leaves chunks are looked up in."""
        self.used: dict[str, Database] = {}
        """The OCDBT databases the last ``spec`` reads from."""
        self.used_folders: list[Pinned] = []
        """The folders the last ``spec`` reads from."""

    def __len__(self) -> int:
        return len(self._pins)

    def spec(self, spec: dict[str, Any], where: str | None = None) -> dict[str, Any]:
        """``spec`` with every local ``file`` store replaced by its checked, pinned folder; errors name ``where``.

        With ``recheck`` (pins held for many opens: ``ItemStores``), a folder
        pinned before is handed out again only while it is unchanged
        (``Pinned.unchanged``); else ``Changed`` is raised, and the caller starts afresh.
        """
        if where is not None:
            self._where = where
        self.used, self.used_folders = {}, []
        return self._rewrite(spec, ocdbt=False)

    def _rewrite(self, node: Any, *, ocdbt: bool) -> Any:
        if isinstance(node, list):
            return [self._rewrite(v, ocdbt=ocdbt) for v in node]
        if not isinstance(node, dict):
            return node
        if node.get("driver") == "file" and isinstance(node.get("path"), str):
            return {**node, "path": self.folder(node["path"], ocdbt=ocdbt).path + "/"}
        url = folder_of(node) if ocdbt else None
        if url is not None:
            if url not in self._remote_checked:  # a bucket has no links: the database's manifest only
                check_ocdbt(self._storage, normalize(url), self._budget)
                self._remote_checked.add(url)
            return node
        inner = node.get("driver") == "ocdbt"
        return {k: self._rewrite(v, ocdbt=inner and k == "base") if isinstance(v, (dict, list)) else v
                for k, v in node.items()}

    def folder(self, folder: str, *, ocdbt: bool = False) -> Pinned:
        """``folder`` opened and checked (``ocdbt``: an OCDBT database, checked whole, its manifests held to the
        budget); opened once per ``Pins``."""
        folder = folder.rstrip("/") or "/"
        key = (folder, ocdbt)
        pinned = self._pins.get(key)
        if pinned is not None:
            if self.recheck and not pinned.unchanged():
                raise Changed(folder)
            if folder in self.databases:
                self.used[folder] = self.databases[folder]
            self.used_folders.append(pinned)
            return pinned
        if key in self._refused:  # one OCDBT database refused is every array in it refused, once
            raise self._refused[key]
        try:
            pinned = self._open(folder, ocdbt)
        except CheckpointError as e:
            self._refused[key] = e
            raise
        self._pins[key] = pinned
        self.used_folders.append(pinned)
        return pinned

    def _open(self, folder: str, ocdbt: bool) -> Pinned:
        what = "array data" if self._data else "array metadata"
        try:
            pinned = pin(self._storage, folder)
        except NotADirectoryError:
            raise CheckpointError(f"{self._where}: cannot open {what} ({folder} is {file_kind(self._storage, folder)}, "
                                  "not a folder).") from None
        except FileNotFoundError:
            raise CheckpointError(f"{self._where}: cannot open {what} (its folder {folder} is missing).") from None
        except OSError as e:
            raise CheckpointError(f"{self._where}: cannot open {what} ({folder}: {e.strerror or e}).") from None
        try:
            if ocdbt:
                pinned.check_tree()
                self.databases[folder] = self.used[folder] = check_ocdbt(self._storage, pinned.path, self._budget,
                                                                        shown=folder)
            elif self._data:
                pinned.check_tree()
            else:
                for header in OPEN_FILES:
                    pinned.check_file(header)
        except BaseException:
            pinned.close()
            raise
        return pinned

    def check_lookups(self, where: str, shape: Sequence[int], chunk: Sequence[int],
                      databases: Sequence[Database] | None = None) -> None:
        """Refuse to read an array of ``shape`` stored in chunks (or shards) of ``chunk`` from the OCDBT databases
        pinned (or ``databases``), when its chunk lookups are out of proportion to what they store
        (``check_lookups``)."""
        keys = math.prod(-(-int(n) // max(1, int(c))) for n, c in zip(shape, chunk))
        for database in self.databases.values() if databases is None else databases:
            check_lookups(where, keys, database)

    def shown(self, text: str) -> str:
        """``text`` (TensorStore's error) naming each pinned folder as the checkpoint names it, not by descriptor."""
        for pinned in sorted(self._pins.values(), key=lambda p: -len(p.path)):  # /proc/self/fd/31 before .../3
            text = text.replace(pinned.path, pinned.folder)
        return text

    def close(self) -> None:
        for pinned in self._pins.values():
            pinned.close()
        self._pins.clear()

    def __enter__(self) -> "Pins":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Changed(Exception):
    """A folder pinned earlier has changed on disk since (``Pins`` with ``recheck``): pin and check afresh."""


# ---------------------------------------------------------------------------- one item's stores

ITEM_CACHE_BYTES = 16 * 2**20
"""TensorStore's cache for the readers of one local item: OCDBT manifests and b-tree nodes only (never array
chunks, so a block's memory is still freed once consumed). Without it each array's open and each read decoded
the item's manifest and b-tree again: 31 ms per leaf at 33k leaves, against 1.4 ms with it."""

PINS_PER_CONTEXT = 64
"""Folders one context's pins hold open at most (one per array for zarr folders; one per OCDBT item): the next
array starts a new context, and the old one's folders close when its last store does."""

OPEN_STORES = 16
"""Stores one context keeps open for reuse (``_Generation.stores``): a few leaves in flight at once, each
read a block at a time. No array chunk is cached in them."""

_OCDBT_CACHE = "cache_pool#ocdbt"


class _Generation:
    """One TensorStore context and the folders pinned for it. The context's cache is keyed by the pinned
    folders' paths (``/proc/self/fd/N``), so they close together: once retired (no new store opens with the
    context) and the last store opened with it is closed."""

    def __init__(self, storage: Storage, budget: float, context_spec: dict[str, Any]):
        import tensorstore as ts

        self.context: Any = ts.Context(context_spec)
        self.pins = Pins(storage, data=True, budget=budget, recheck=True)
        self.budget = budget
        self.users = 0
        self.retired = False
        self.stores: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        """The last ``OPEN_STORES`` stores opened, by ``id`` of the reader's spec: ``(spec, store, chunk, shard,
        blosc key)``. A reader read a block at a time (``read``) opens its store once, not once per block; and
        TensorStore drops a key-value store's cache (an OCDBT item's b-tree nodes) with the last store reading
        through it, so some are kept open while the context may be used."""
        self.opening: dict[int, threading.Lock] = {}
        self.keep: Any = None
        """A header's store (``open_all``), kept for the same reason."""
        self.specs: collections.OrderedDict[int, tuple[dict, dict, list[Pinned], list[Database]]] = \
            collections.OrderedDict()
        """By ``id`` of a reader's spec, the last ``OPEN_STORES``: the spec (held, so the id stays its own), as
        rewritten to read through the pins, the folders it reads and the OCDBT databases it looks chunks up in."""

    def close(self) -> None:
        self.context = self.keep = None
        self.stores.clear()
        self.specs.clear()
        self.pins.close()


class ItemStores:
    """What the ``TensorStoreReader``s of one item share: one TensorStore context (its cache keeps what every
    array's open and read looks up: an OCDBT item's manifest and b-tree nodes) and the item's folders, pinned and
    checked once (``Pins``) instead of once per open.

    Each open hands out a folder pinned earlier only while it is unchanged on
    disk (``Pinned.unchanged``: its path leads to the same folder, no folder below
    it changed); else the context and its pins are retired and the open pins and
    checks afresh under a new context, as it does after ``PINS_PER_CONTEXT``
    folders. A context's folders stay open as long as the context may be used:
    until it is retired and its last store closed, or the item is let go of.
    """

    def __init__(self, storage: Storage):
        self._storage = storage
        remote = tensorstore_context(storage)
        # A bucket's context (its own cache, shared connections) as it gives it; locally, a cache for OCDBT only.
        self._context_spec = remote if remote is not None else {_OCDBT_CACHE: {"total_bytes_limit": ITEM_CACHE_BYTES}}
        self._ocdbt_cache = remote is None
        self._current: _Generation | None = None
        self._lock = threading.Lock()
        self.contexts = 0
        """Contexts made so far (one per item unless folders changed or more than ``PINS_PER_CONTEXT`` were pinned)."""
        self.listed: dict[int, tuple[dict[str, Any], str, bytes, tuple[tuple[bytes, bytes], ...]]] = {}
        """Arrays whose header and chunks ``_tensorstore._open_listed`` kept from its one pass over the item's
        OCDBT b-tree, by ``id`` of a reader's spec: ``(the spec, its header's file name, the header, (key below
        the array's folder, chunk)...)``. Let go of when a folder of the item changes."""
        self._memory: tuple[Any, Any] | None = None
        self._listed_n = 0

    def keep_listed(self, listed: dict[int, tuple[dict[str, Any], str, bytes, tuple[tuple[bytes, bytes], ...]]]) -> None:
        with self._lock:
            self.listed.update(listed)

    def listed_spec(self, spec: dict[str, Any]) -> tuple[dict[str, Any], Any] | None:
        """``(spec reading from memory, its context)`` for an array kept from the one pass, else None: its header
        and chunks put in a memory key-value store (once: a later open reads through the database)."""
        import tensorstore as ts

        with self._lock:
            known = self.listed.get(id(spec))
            if known is None or known[0] is not spec:
                return None
            del self.listed[id(spec)]
            if self._memory is None:
                context = ts.Context()
                self._memory = (context, ts.KvStore.open({"driver": "memory"}, context=context).result())
            context, kv = self._memory
            self._listed_n += 1
            folder = f"{self._listed_n}/".encode()
        kv[folder + known[1].encode()] = known[2]
        for key, value in known[3]:
            kv[folder + key] = value
        return {**spec, "kvstore": {"driver": "memory", "path": folder.decode()}}, context

    def acquire(self, storage: Storage, spec: dict[str, Any], where: str, budget: float,
                recheck: bool = True) -> tuple[_Generation, dict, list[Database]]:
        """The context to open ``spec`` with, the spec reading through its checked, pinned folders, and the OCDBT
        databases it reads; ``release`` the generation when the store is closed. Without ``recheck``, a folder
        pinned earlier is handed out without looking whether it changed (``open_all``: once a batch)."""
        with self._lock:
            for _ in range(3):
                gen = self._current
                if gen is None or gen.budget != budget or storage is not self._storage:
                    gen = self._renew(storage, budget)
                known = gen.specs.get(id(spec))
                if known is not None and known[0] is spec:
                    if recheck and not all(pinned.unchanged() for pinned in known[2]):
                        self.listed = {}
                        self._retire(gen)
                        continue
                    gen.users += 1
                    return gen, known[1], known[3]
                if len(gen.pins) >= PINS_PER_CONTEXT:
                    gen = self._renew(storage, budget)
                try:
                    gen.pins.recheck = recheck
                    rewritten = gen.pins.spec(spec, where)
                except Changed:
                    self.listed = {}
                    self._retire(gen)
                    continue
                if self._ocdbt_cache:
                    rewritten = self._with_cache(rewritten)
                databases = list(gen.pins.used.values())
                gen.specs[id(spec)] = (spec, rewritten, list(gen.pins.used_folders), databases)
                while len(gen.specs) > OPEN_STORES:
                    gen.specs.popitem(last=False)
                gen.users += 1
                return gen, rewritten, databases
            raise CheckpointError(f"{where}: the checkpoint's folders keep changing while they are read; try again.")

    def opened(self, gen: _Generation, spec: dict[str, Any], open_: Callable[[], tuple]) -> tuple:
        """``open_()`` (``(store, chunk, shard, blosc key)``) of ``spec``, called once for ``gen``'s context while it
        keeps the store: readers of one array in several threads (the row bands of a convert) wait for one open."""
        with self._lock:
            known = self._known(gen, spec)
            if known is not None:
                return known
            opening = gen.opening.setdefault(id(spec), threading.Lock())
        try:
            with opening:
                with self._lock:
                    known = self._known(gen, spec)
                if known is None:
                    known = open_()
                    with self._lock:
                        if gen.context is not None:
                            gen.stores[id(spec)] = (spec, *known)
                            while len(gen.stores) > OPEN_STORES:
                                gen.stores.popitem(last=False)
        finally:
            with self._lock:
                gen.opening.pop(id(spec), None)
        return known

    @staticmethod
    def _known(gen: _Generation, spec: dict[str, Any]) -> tuple | None:
        known = gen.stores.get(id(spec))
        if known is None or known[0] is not spec:
            return None
        gen.stores.move_to_end(id(spec))
        return known[1:]

    def release(self, gen: _Generation) -> None:
        with self._lock:
            gen.users -= 1
            if gen.retired and not gen.users:
                gen.close()

    def _renew(self, storage: Storage, budget: float) -> _Generation:
        if self._current is not None:
            self._retire(self._current)
        self._current = _Generation(storage, budget, self._context_spec)
        self.contexts += 1
        return self._current

    def _retire(self, gen: _Generation) -> None:
        gen.retired = True
        if self._current is gen:
            self._current = None
        if not gen.users:
            gen.close()

    def _with_cache(self, node: Any) -> Any:
        """``node`` with every OCDBT key-value store reading through the item's cache."""
        if isinstance(node, list):
            return [self._with_cache(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: self._with_cache(v) if isinstance(v, (dict, list)) else v for k, v in node.items()}
        if out.get("driver") == "ocdbt":
            out["cache_pool"] = _OCDBT_CACHE
        return out
