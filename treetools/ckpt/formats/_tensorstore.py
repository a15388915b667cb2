"""TensorStore-backed arrays, shared by the formats that store zarr arrays (Orbax, T5X, Orbax before 0.5,
Levanter, EasyDeL).

Not a format (its name starts with ``_``): the reader of one zarr array
(``TensorStoreReader``), the spec of one saved array as Orbax builds it
(``ts_spec``), opening many arrays' headers in bounded batches (``open_all``),
and the refusal of special files TensorStore would block on
(``refuse_special_files``), and, for the formats that keep one zarr folder per leaf (jax's
``GlobalAsyncCheckpointManager``: Levanter, EasyDeL, Orbax's ``ArrayCheckpointHandler``),
finding those folders (``array_folders``) and reading them as leaves (``zarr_leaves``).

TensorStore opens the files of a store itself, by path: the zarr header, each
chunk file, an OCDBT manifest and its data files. So before any store is
opened, every local folder its spec names is opened once and checked
(``Storage.pin``): the folder itself, and (for array data, and for an OCDBT
database always) every entry below it, must resolve inside the checkpoint
root; TensorStore is then handed the folder through that open descriptor
(``/proc/self/fd/N``), so a folder swapped after the check is not the one read.

What a read holds is bounded before TensorStore allocates it: one stored
chunk (and a zarr3 shard's index) by the memory budget; the chunks one read
spans by ``max_chunks_per_read`` (TensorStore keeps about a kilobyte per chunk
in flight: a read over 2^20 one-byte chunks held 1.2 GB), by splitting the
read; a blosc chunk by the size its header claims (blosc allocates that before
decoding: a 29 KB chunk may claim 512 MiB); an OCDBT database by the largest
b-tree node its manifest allows.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from treetools.ckpt.context import DEFAULT_MEMORY_BUDGET, ReadContext
from treetools.ckpt.leaves import Leaf, UnreadProblem, array_row
from treetools.ckpt.readers import (
    ArrayReader,
    Index,
    block_extent,
    check_budget,
    checked_shape,
    physical_memory,
    plan_blocks,
)
from treetools.ckpt.formats._ocdbt import Database, check_database, first_line
from treetools.ckpt.steps import file_kind
from treetools.ckpt.storage import Pinned, SpecialFileError, Storage, normalize
from treetools.shared.errors import CheckpointError


CHUNK_OVERHEAD = 2 * 2**10
"""What TensorStore holds per chunk of a read in flight, in bytes, beside the chunk's data (measured: 1.1 KiB)."""

CHUNK_OVERHEAD_CAP = 64 * 2**20
"""The most per-chunk overhead one read may hold, whatever the budget (``load_parameters`` has none)."""

OPEN_BATCH = 256
"""Array headers opened at once by ``open_all`` (each open in flight holds buffers and a store)."""

OPEN_FILES = (".zarray", "zarr.json", ".zattrs")
"""The files TensorStore reads to open a zarr array (the data are the chunk files beside them)."""

OCDBT_MANIFEST = "manifest.ocdbt"

_BLOSC_HEADER = 16  # version, versionlz, flags, typesize, nbytes (uint32 LE), blocksize, cbytes


def subdirs(storage: Storage, folder: str) -> list[str]:
    """Names of the folders directly under ``folder`` (a link to a folder is one: ``Storage.scandir``), sorted."""
    try:
        with storage.scandir(folder) as it:
            return sorted(e.name for e in it if e.is_dir())
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot list folder ({e.strerror or e}).") from None


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

    >>> from treetools.ckpt.formats._ocdbt import Database
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


def max_chunks_per_read(budget: float) -> int:
    """How many stored chunks one read may span: the chunks' in-flight overhead held to the budget (and a cap).

    >>> max_chunks_per_read(16 * 2**20), max_chunks_per_read(float("inf"))
    (8192, 32768)
    """
    return max(1, int(min(budget, CHUNK_OVERHEAD_CAP) // CHUNK_OVERHEAD))


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


_REMOTE_SCHEMES = {"gcs": "gs", "s3": "s3"}  # TensorStore's key-value store drivers -> URL schemes


class Pins:
    """The local folders of TensorStore specs, opened once and checked, and the specs rewritten to read
    through them. Close it when TensorStore is done with the stores opened from its specs.

    ``data``: the stores will read array data, so every file below each array
    folder is checked; else (opening headers) only the zarr header files. An
    OCDBT database's folder is always checked whole (its manifest and data
    files are what opening a header reads) and its manifest held to ``budget``.
    """

    def __init__(self, storage: Storage, *, data: bool, budget: float, where: str = ""):
        self._storage, self._data, self._budget, self._where = storage, data, budget, where
        self._pins: dict[tuple[str, bool], Pinned] = {}
        self._remote_checked: set[str] = set()
        self._refused: dict[tuple[str, bool], CheckpointError] = {}
        self.databases: dict[str, Database] = {}
        """The OCDBT databases pinned, by folder: what they store, and the leaves chunks are looked up in."""

    def spec(self, spec: dict[str, Any], where: str | None = None) -> dict[str, Any]:
        """``spec`` with every local ``file`` store replaced by its checked, pinned folder; errors name ``where``."""
        if where is not None:
            self._where = where
        return self._rewrite(spec, ocdbt=False)

    def _rewrite(self, node: Any, *, ocdbt: bool) -> Any:
        if isinstance(node, list):
            return [self._rewrite(v, ocdbt=ocdbt) for v in node]
        if not isinstance(node, dict):
            return node
        if node.get("driver") == "file" and isinstance(node.get("path"), str):
            return {**node, "path": self.folder(node["path"], ocdbt=ocdbt).path + "/"}
        if ocdbt and node.get("driver") in _REMOTE_SCHEMES and isinstance(node.get("bucket"), str):
            url = f"{_REMOTE_SCHEMES[node['driver']]}://{node['bucket']}/{str(node.get('path') or '').strip('/')}"
            if url not in self._remote_checked:  # a bucket has no links: the database's manifest only
                check_ocdbt(self._storage, normalize(url), self._budget)
                self._remote_checked.add(url)
            return node
        inner = node.get("driver") == "ocdbt"
        return {k: self._rewrite(v, ocdbt=inner and k == "base") for k, v in node.items()}

    def folder(self, folder: str, *, ocdbt: bool = False) -> Pinned:
        """``folder`` opened and checked (``ocdbt``: an OCDBT database, checked whole, its manifests held to the
        budget); opened once per ``Pins``."""
        folder = folder.rstrip("/") or "/"
        key = (folder, ocdbt)
        pinned = self._pins.get(key)
        if pinned is not None:
            return pinned
        if key in self._refused:  # one OCDBT database refused is every array in it refused, once
            raise self._refused[key]
        try:
            pinned = self._open(folder, ocdbt)
        except CheckpointError as e:
            self._refused[key] = e
            raise
        self._pins[key] = pinned
        return pinned

    def _open(self, folder: str, ocdbt: bool) -> Pinned:
        what = "array data" if self._data else "array metadata"
        try:
            pinned = self._storage.pin(folder)
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
                self.databases[folder] = check_ocdbt(self._storage, pinned.path, self._budget, shown=folder)
            elif self._data:
                pinned.check_tree()
            else:
                for header in OPEN_FILES:
                    pinned.check_file(header)
        except BaseException:
            pinned.close()
            raise
        return pinned

    def check_lookups(self, where: str, shape: Sequence[int], chunk: Sequence[int]) -> None:
        """Refuse to read an array of ``shape`` stored in chunks (or shards) of ``chunk`` from the OCDBT databases
        pinned, when its chunk lookups are out of proportion to what they store (``check_lookups``)."""
        keys = math.prod(-(-int(n) // max(1, int(c))) for n, c in zip(shape, chunk))
        for database in self.databases.values():
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


# ---------------------------------------------------------------------------- reading one array


def _codec_info(spec: dict[str, Any]) -> tuple[bool, bool, Any]:
    """``(blosc, blosc inside shards, chunk key of a chunk index)`` from an open store's spec."""
    meta = spec.get("metadata") or {}
    if spec.get("driver") == "zarr3":
        codecs = [c for c in meta.get("codecs") or [] if isinstance(c, dict)]
        names = [c.get("name") for c in codecs]
        inner = [i.get("name") for c in codecs if c.get("name") == "sharding_indexed"
                 for i in (c.get("configuration") or {}).get("codecs") or [] if isinstance(i, dict)]
        encoding = meta.get("chunk_key_encoding") or {}
        default = encoding.get("name", "default") != "v2"
        sep = (encoding.get("configuration") or {}).get("separator") or ("/" if default else ".")

        def key(ix: Sequence[int]) -> str:
            body = sep.join(map(str, ix))
            return ("c" + sep + body if body else "c") if default else (body or "0")

        return "blosc" in names, "blosc" in inner, key
    compressor = meta.get("compressor") or {}
    filters = meta.get("filters") or []
    blosc = (isinstance(compressor, dict) and compressor.get("id") == "blosc") or any(
        isinstance(f, dict) and f.get("id") == "blosc" for f in filters)
    sep = meta.get("dimension_separator") or "."
    return blosc, False, lambda ix: sep.join(map(str, ix)) or "0"


class _Opened:
    """One open store of a ``TensorStoreReader`` and what its reads are held to."""

    def __init__(self, reader: "TensorStoreReader", store: Any, pins: Pins, chunk: tuple[int, ...]):
        self.reader, self.store, self.pins, self.chunk = reader, store, pins, chunk
        self.max_chunks = max_chunks_per_read(reader.budget)
        self.blosc = None
        blosc, inner, key = _codec_info(store.spec().to_json())
        if inner:
            raise CheckpointError(
                f"{reader._where}: blosc-compressed chunks inside zarr3 shards; a blosc header may claim any decoded "
                "size, and inside a shard it cannot be checked before decoding; refusing to read it."
            )
        if blosc:
            self.blosc = key

    def close(self) -> None:
        self.pins.close()

    def _check_blosc(self, index: Index) -> None:
        """Refuse a blosc chunk whose header claims more bytes than the chunk holds, before TensorStore decodes it."""
        if self.blosc is None or not self.chunk:
            return
        starts, sizes = block_extent(index, self.reader.shape)
        if 0 in sizes:
            return
        ranges = [range(s // c, -(-(s + n) // c)) for s, n, c in zip(starts, sizes, self.chunk)]
        import itertools

        keys = [self.blosc(ix) for ix in itertools.product(*ranges)]
        chunk_bytes = math.prod(self.chunk) * self.reader.dtype.itemsize
        kv = self.store.kvstore
        futures = [kv.read(k, byte_range=slice(0, _BLOSC_HEADER)) for k in keys]
        for k, f in zip(keys, futures):
            try:
                result = f.result()
            except Exception as e:
                raise CheckpointError(f"{self.reader._where}: cannot read chunk {k!r} "
                                      f"({self.pins.shown(first_line(e))}).") from None
            value = bytes(result.value) if result.state == "value" else b""
            if len(value) >= 8:
                claimed = int.from_bytes(value[4:8], "little")
                if claimed > chunk_bytes:
                    raise CheckpointError(
                        f"{self.reader._where}: blosc chunk {k!r} claims to decode to {claimed:,} bytes, but a chunk "
                        f"holds {chunk_bytes:,}; the chunk is corrupt or hostile: refusing to decode it."
                    )

    def pieces(self, index: Index) -> Iterator[tuple[Index, Index]] | None:
        """None when ``index`` spans at most ``max_chunks`` stored chunks; else ``(piece, where in the block)``
        for pieces of whole chunks that tile it, each spanning at most that many."""
        starts, sizes = block_extent(index, self.reader.shape)
        chunk = self.chunk or tuple(max(1, n) for n in self.reader.shape)
        lo = [s // c for s, c in zip(starts, chunk)]
        counts = [(-(-(s + n) // c) - l) if n else 0 for s, n, c, l in zip(starts, sizes, chunk, lo)]
        if 0 in sizes or math.prod(counts) <= self.max_chunks:
            return None

        def tiles() -> Iterator[tuple[Index, Index]]:
            for grid in plan_blocks(counts, self.max_chunks):
                piece, local = [], []
                for g, n_chunks, l, c, s, n in zip(grid, counts, lo, chunk, starts, sizes):
                    a, b, _ = g.indices(n_chunks)
                    e0, e1 = max(s, (l + a) * c), min(s + n, (l + b) * c)
                    piece.append(slice(e0, e1))
                    local.append(slice(e0 - s, e1 - s))
                yield tuple(piece), tuple(local)

        return tiles()

    def start(self, index: Index) -> Any:
        """A read of ``index`` under way: a TensorStore future, or (a read split in pieces) a callable."""
        pieces = self.pieces(index)
        if pieces is None:
            self._check_blosc(index)
            return self.store[index].read()
        starts, sizes = block_extent(index, self.reader.shape)

        def piecewise() -> np.ndarray:
            out = np.empty(sizes, self.reader.dtype)
            for piece, local in pieces:
                self._check_blosc(piece)
                out[local] = self.wait(self.store[piece].read())
            return out

        return piecewise

    def result(self, pending: Any) -> np.ndarray:
        return pending() if callable(pending) else self.wait(pending)

    def wait(self, future: Any) -> np.ndarray:
        try:
            return np.asarray(future.result())
        except Exception as e:
            raise CheckpointError(f"{self.reader._where}: cannot read array data "
                                  f"({self.pins.shown(first_line(e))}).") from None


class TensorStoreReader(ArrayReader):
    """One zarr array, read through TensorStore a block at a time.

    The store is opened read-only with TensorStore's cache disabled, so a
    block's memory is freed once the block is consumed. A storage chunk is
    decompressed whole: the peak per block is the larger of the block and the
    chunks it touches. Each open checks and pins the local folders it reads
    (``Pins``); reads are split so none spans more than ``max_chunks_per_read``.
    """

    def __init__(self, context: ReadContext, spec: dict[str, Any], shape: tuple[int, ...], dtype: np.dtype,
                 chunk_shape: tuple[int, ...] | None, *, where: str, shared: Any = None):
        self.context = context
        self.spec = spec
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.chunk_shape = chunk_shape
        self._where = where
        self._shared = shared
        self.remote = context.storage.remote

    def _ts_context(self) -> Any:
        import tensorstore as ts

        return self._shared if self._shared is not None else ts.Context()

    def _open(self, *, whole: bool = False) -> _Opened:
        """Pin and check the folders, open the store; refuse before decoding anything when one stored chunk
        (or a zarr3 shard's index) is too big to hold.

        The chunk shape is the store's own (``.zarray`` / ``zarr.json``), which a
        hostile file may declare at 2^40 elements: block reads are held to the
        memory budget, a whole-array read (``load_parameters``) to the machine's memory.
        """
        import tensorstore as ts

        pins = Pins(self.context.storage, data=True, budget=self.budget, where=self._where)
        try:
            spec = pins.spec(self.spec)
            try:
                store = ts.open(spec, read=True, open=True, context=self._ts_context()).result()
            except Exception as e:  # tensorstore raises ValueError with a long status text
                raise CheckpointError(f"{self._where}: cannot open array data ({pins.shown(first_line(e))}).") from None
            try:
                chunk = tuple(int(c) for c in store.chunk_layout.read_chunk.shape)
                shard = tuple(int(c) for c in store.chunk_layout.write_chunk.shape or chunk)
            except Exception:  # a driver without a chunk layout: fall back to the metadata's
                chunk = shard = tuple(self.chunk_shape or self.shape)
            pins.check_lookups(self._where, self.shape, shard)
            piece = math.prod(chunk) * self.dtype.itemsize
            if whole:
                memory = physical_memory()
                if memory is not None and max(piece, math.prod(self.shape) * self.dtype.itemsize) > memory:
                    raise CheckpointError(
                        f"{self._where}: the array (or one stored chunk, {list(chunk)}) is larger than this machine's "
                        "memory; read it in slices (treetools inspect --show LEAF[SLICE]) instead."
                    )
            else:
                check_budget(piece, where=self._where, what=f"one storage chunk ({list(chunk)} {self.dtype})",
                             budget=self.budget)
            if shard != chunk and len(shard) == len(chunk):  # zarr3 sharding: 16 bytes of index per inner chunk
                entries = math.prod(-(-s // max(1, c)) for s, c in zip(shard, chunk))
                check_budget(16 * entries, where=self._where, what=f"one shard's index ({entries:,} inner chunks)",
                             budget=min(self.budget, DEFAULT_MEMORY_BUDGET))
            return _Opened(self, store, pins, chunk)
        except BaseException:
            pins.close()
            raise

    def read(self, index: Index) -> np.ndarray:
        opened = self._open()
        try:
            return opened.result(opened.start(index))
        finally:
            opened.close()

    reads_async = True

    def reading(self) -> Callable[[Index], Any]:
        """Open the store once; each call issues one block's read and returns at once (``.result()`` waits).
        ``close()`` on the function returned lets go of the store (and the folders pinned for it)."""
        return _Starter(self._open())

    def read_all(self) -> np.ndarray:
        opened = self._open(whole=True)
        try:
            return opened.result(opened.start(tuple(slice(None) for _ in self.shape)))
        finally:
            opened.close()

    def blocks(self, plan):
        """Blocks in plan order; the next block's read is in flight while the caller uses this one."""
        opened = self._open()
        try:
            pending = None
            for index in plan:
                nxt = opened.start(index)
                if pending is not None:
                    yield opened.result(pending)
                pending = nxt
            if pending is not None:
                yield opened.result(pending)
        finally:
            opened.close()


class _Starter:
    """``TensorStoreReader.reading``'s function: each call begins one block's read on the open store."""

    def __init__(self, opened: _Opened):
        self._opened = opened

    def __call__(self, index: Index) -> "_Reading":
        return _Reading(self._opened, self._opened.start(index))

    def close(self) -> None:
        self._opened.close()


class _Reading:
    """A TensorStore read in flight: ``result()`` waits for it (errors as one-line ``CheckpointError``s)."""

    def __init__(self, opened: _Opened, pending: Any):
        self._opened, self._pending = opened, pending

    def result(self) -> np.ndarray:
        return self._opened.result(self._pending)


def shared_ts_context(storage: Storage) -> Any:
    """The TensorStore context the readers of one item share (``Storage.tensorstore_context``): None locally
    (each array opens with a fresh, cache-less context), one shared context in a bucket, where every open costs
    round trips that sharing saves."""
    spec = storage.tensorstore_context()
    if spec is None:
        return None
    import tensorstore as ts

    return ts.Context(spec)


def ts_spec(storage: Storage, item_dir: str, name: str, *, use_ocdbt: bool, use_zarr3: bool) -> dict[str, Any]:
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


def refuse_special_files(storage: Storage, item_dir: str, names: Sequence[str], *, use_ocdbt: bool,
                         use_zarr3: bool) -> None:
    """TensorStore blocks forever opening a FIFO: refuse special files among those it reads for array metadata.

    ``open_all`` checks the files of every spec it opens (``Pins``); this is the
    same check for a caller that names the files itself.
    """
    import stat

    if storage.remote:
        return  # a bucket holds objects only

    if use_ocdbt:  # the manifests and the b-tree/data files of the item and of each process
        folders = [item_dir, os.path.join(item_dir, "d")]
        folders += [os.path.join(item_dir, p, sub) for p in subdirs(storage, item_dir) if p.startswith("ocdbt.process_")
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
            kind = file_kind(storage, path)
            raise SpecialFileError(f"{path}: not a regular file ({kind}); cannot read it as Orbax array data.",
                                   path=path, kind=kind)


class ArrayHeader:
    """What opening one zarr array's header told: its shape, dtype and chunk layout, without the store.

    The attributes are the store's own (``shape``, ``dtype.numpy_dtype``,
    ``chunk_layout.read_chunk.shape``), so code written against an open store
    reads it alike; holding 400k of these costs a fraction of 400k stores.
    """

    __slots__ = ("shape", "dtype", "chunk_layout")

    def __init__(self, store: Any, where: str):
        dtype = np.dtype(store.dtype.numpy_dtype)
        if not dtype.itemsize or dtype.fields is not None or dtype.subdtype is not None:  # zarr's |V0, |S0
            raise CheckpointError(f"{where}: dtype {dtype.str} is not a plain element type of a positive size; the "
                                  "array header is corrupt or hostile.")
        self.dtype = store.dtype
        self.shape = checked_shape(list(store.shape), where=where, itemsize=dtype.itemsize)
        chunk = store.chunk_layout.read_chunk.shape
        if chunk is not None and any(c is None for c in chunk):
            raise CheckpointError(f"{where}: no chunk shape TensorStore can read; the array header is corrupt.")
        self.chunk_layout = store.chunk_layout


def open_all(context: ReadContext, specs: list[dict[str, Any]], where: list[str],
             problems: list[str] | None = None) -> list[ArrayHeader | None]:
    """Open many arrays' zarr headers (TensorStore reads ``OPEN_BATCH`` of them in parallel); no array data.

    Each spec's local folders are checked first (``Pins``: the headers, and an
    OCDBT database whole, must resolve inside the checkpoint). With
    ``problems``, a leaf that cannot be opened is recorded there (and its
    header is None) instead of failing the whole item: ``verify`` lists them all.
    """
    import tensorstore as ts

    headers: list[ArrayHeader | None] = []
    for a in range(0, len(specs), OPEN_BATCH):
        # One descriptor per array folder, held until its header is read: a batch's worth at a time. The cache
        # (b-tree nodes the arrays of one OCDBT item share) lives as long as the descriptors: a descriptor number
        # reused by the next batch names another folder.
        cache = ts.Context({"cache_pool": {"total_bytes_limit": 16 * 2**20}})
        with Pins(context.storage, data=False, budget=context.memory_budget) as pins:
            batch = []
            for spec, w in zip(specs[a:a + OPEN_BATCH], where[a:a + OPEN_BATCH]):
                try:
                    batch.append(ts.open(pins.spec(spec, w), read=True, open=True, context=cache))
                except CheckpointError as e:
                    if problems is None:
                        raise
                    batch.append(e)
            for future, w in zip(batch, where[a:a + OPEN_BATCH]):
                try:
                    if isinstance(future, CheckpointError):
                        raise future
                    headers.append(ArrayHeader(future.result(), w))
                    continue
                except CheckpointError as e:  # a FIFO where a file is read: not read (never opened), not damage
                    message = UnreadProblem(e) if isinstance(e, SpecialFileError) else str(e)
                except Exception as e:
                    message = f"{w}: cannot open array metadata ({pins.shown(first_line(e))})."
                if problems is None:
                    raise CheckpointError(message) from None
                if message not in problems[-1:]:  # a database refused whole: said once, not once per array
                    problems.append(message)
                headers.append(None)
    return headers


ZARR_HEADERS = (".zarray", "zarr.json")
"""The header of a zarr v2 / v3 array folder."""


def zarr_header(storage: Storage, folder: str) -> str | None:
    """The zarr header file of an array folder (``.zarray`` or ``zarr.json``), None when it is not one."""
    return next((h for h in ZARR_HEADERS if storage.isfile(os.path.join(folder, h))), None)


def natural_key(parts: Sequence[str]) -> tuple[Any, ...]:
    """Sort key of a path that orders ``layers/2`` before ``layers/10``.

    >>> sorted([("l", "10"), ("l", "2"), ("a",)], key=natural_key)
    [('a',), ('l', '2'), ('l', '10')]
    """
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def array_folders(storage: Storage, top: str) -> tuple[list[tuple[tuple[str, ...], str]], list[tuple[str, ...]]]:
    """Every zarr array folder at or below ``top``, and every folder below it that ends without one.

    Returns ``([(path parts, header name)], [path parts of empty end folders])``, relative to ``top``
    (``()`` when ``top`` is itself an array), in natural order; nothing below an array folder is
    looked at (its chunks). An end folder without a header is where an array was lost (a partial copy).
    """
    arrays: list[tuple[tuple[str, ...], str]] = []
    empty: list[tuple[str, ...]] = []
    base = normalize(top)
    for folder, dirs, files in storage.walk(top):
        rel = normalize(folder)[len(base):].strip("/")
        parts = tuple(re.split(r"[/\\]", rel)) if rel else ()
        header = next((h for h in ZARR_HEADERS if h in files), None)
        if header is not None:
            arrays.append((parts, header))
            dirs[:] = []  # its chunks (and nested chunk folders of dimension_separator "/")
        elif not dirs:
            empty.append(parts)
    return sorted(arrays, key=lambda a: natural_key(a[0])), sorted(empty, key=natural_key)


def zarr_leaves(context: ReadContext, base: str, arrays: Sequence[tuple[tuple[str, ...], str, str]], *, where: str,
                problems: list[str] | None = None) -> list[Leaf | None]:
    """One leaf per zarr array folder ``base/<folder>``: ``(leaf path parts, folder, header name)``.

    Shape, dtype and chunks come from the headers, opened all at once (no
    array data); each leaf's data is read on request through a ``TensorStoreReader``.
    With ``problems``, an array that cannot be opened is recorded there and its
    leaf is None; without, it is an error.
    """
    storage = context.storage
    for header in ZARR_HEADERS:
        names = [folder for _, folder, h in arrays if h == header]
        if names:
            refuse_special_files(storage, base, names, use_ocdbt=False, use_zarr3=header == "zarr.json")
    specs = [ts_spec(storage, base, folder, use_ocdbt=False, use_zarr3=header == "zarr.json")
             for _, folder, header in arrays]
    wheres = [f"{where}: `{'/'.join(parts)}`" for parts, _, _ in arrays]
    shared = shared_ts_context(storage)
    leaves: list[Leaf | None] = []
    for (parts, folder, _), spec, w, store in zip(arrays, specs, wheres, open_all(context, specs, wheres, problems)):
        if store is None:
            leaves.append(None)
            continue
        dtype = np.dtype(store.dtype.numpy_dtype)
        shape = tuple(int(d) for d in store.shape)
        chunk = tuple(int(c) for c in store.chunk_layout.read_chunk.shape or ()) or None
        reader = TensorStoreReader(context, spec, shape, dtype, chunk, where=w, shared=shared)
        leaves.append(Leaf(array_row(parts, shape, dtype), reader, key=folder))
    return leaves
