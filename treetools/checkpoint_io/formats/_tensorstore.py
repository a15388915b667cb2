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
(``_ts_folders.Pins``, ``_ts_kvstore.pin``): the folder itself, and (for array data, and for an OCDBT
database always) every entry below it, must resolve inside the checkpoint
root; TensorStore is then handed the folder through that open descriptor
(``/proc/self/fd/N``), so a folder swapped after the check is not the one read.
The readers of one item share those folders and one TensorStore context,
whose cache keeps the item's OCDBT manifest and b-tree nodes
(``ItemStores``); a folder is handed out again only while it is unchanged.

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

from treetools.checkpoint_io.context import DEFAULT_MEMORY_BUDGET, ReadContext
from treetools.checkpoint_io.leaves import Leaf, UnreadProblem, array_row
from treetools.checkpoint_io.readers import (
    ArrayReader,
    Index,
    block_extent,
    check_budget,
    checked_shape,
    physical_memory,
    plan_blocks,
)
from treetools.checkpoint_io.formats._ocdbt import first_line, values as ocdbt_values
from treetools.checkpoint_io.formats._ts_folders import ItemStores, Pins
from treetools.checkpoint_io.formats._ts_kvstore import kvstore_spec
from treetools.checkpoint_io.steps import file_kind
from treetools.checkpoint_io.storage import SpecialFileError, Storage, normalize
from treetools.shared.errors import CheckpointError


CHUNK_OVERHEAD = 2 * 2**10
"""What TensorStore holds per chunk of a read in flight, in bytes, beside the chunk's data (measured: 1.1 KiB)."""

CHUNK_OVERHEAD_CAP = 64 * 2**20
"""The most per-chunk overhead one read may hold, whatever the budget (``load_parameters`` has none)."""

OPEN_BATCH = 256
"""Array headers opened at once by ``open_all`` (each open in flight holds buffers and a store)."""

OCDBT_MANIFEST = "manifest.ocdbt"

_BLOSC_HEADER = 16  # version, versionlz, flags, typesize, nbytes (uint32 LE), blocksize, cbytes


def subdirs(storage: Storage, folder: str) -> list[str]:
    """Names of the folders directly under ``folder`` (a link to a folder is one: ``Storage.scandir``), sorted."""
    try:
        with storage.scandir(folder) as it:
            return sorted(e.name for e in it if e.is_dir())
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot list folder ({e.strerror or e}).") from None


def max_chunks_per_read(budget: float) -> int:
    """How many stored chunks one read may span: the chunks' in-flight overhead held to the budget (and a cap).

    >>> max_chunks_per_read(16 * 2**20), max_chunks_per_read(float("inf"))
    (8192, 32768)
    """
    return max(1, int(min(budget, CHUNK_OVERHEAD_CAP) // CHUNK_OVERHEAD))


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


def _blosc_key(store: Any, where: str) -> Any:
    """The chunk key of a chunk index when ``store``'s chunks are blosc-compressed (their headers are checked
    before decoding), else None; blosc inside zarr3 shards is refused."""
    try:  # the codecs alone cost a fifth of the whole spec; the spec only where blosc is among them
        plain = "blosc" not in repr(store.codec.to_json())
    except Exception:
        plain = False
    blosc, inner, key = (False, False, None) if plain else _codec_info(store.spec().to_json())
    if inner:
        raise CheckpointError(
            f"{where}: blosc-compressed chunks inside zarr3 shards; a blosc header may claim any decoded "
            "size, and inside a shard it cannot be checked before decoding; refusing to read it."
        )
    return key if blosc else None


def _grid_shape(shape: tuple[int | None, ...] | None) -> tuple[int, ...]:
    """A chunk layout grid's shape as ints; TypeError when it is unset (None, or None in a dimension)."""
    if shape is None or None in shape:
        raise TypeError(f"chunk grid shape {shape} is not set")
    return tuple(int(c) for c in shape if c is not None)


class _Opened:
    """One open store of a ``TensorStoreReader`` and what its reads are held to."""

    def __init__(self, reader: "TensorStoreReader", store: Any, pins: Pins, chunk: tuple[int, ...], blosc: Any,
                 close: Callable[[], None], reopen: Callable[[], Any] | None = None):
        self.reader, self.store, self.pins, self.chunk, self.blosc = reader, store, pins, chunk, blosc
        self._close = close
        self._reopen = reopen
        """For a store read from the item's one pass (memory), opening it through the database: a read that
        fails from memory is read again that way, so its error is the one TensorStore gives there."""
        self.max_chunks = max_chunks_per_read(reader.budget)

    def close(self) -> None:
        self.store = None
        self._close()

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
        counts = [(-(-(s + n) // c) - first) if n else 0 for s, n, c, first in zip(starts, sizes, chunk, lo)]
        if 0 in sizes or math.prod(counts) <= self.max_chunks:
            return None

        def tiles() -> Iterator[tuple[Index, Index]]:
            for grid in plan_blocks(counts, self.max_chunks):
                piece, local = [], []
                for g, n_chunks, first, c, s, n in zip(grid, counts, lo, chunk, starts, sizes):
                    a, b, _ = g.indices(n_chunks)
                    e0, e1 = max(s, (first + a) * c), min(s + n, (first + b) * c)
                    piece.append(slice(e0, e1))
                    local.append(slice(e0 - s, e1 - s))
                yield tuple(piece), tuple(local)

        return tiles()

    def start(self, index: Index) -> Any:
        """A read of ``index`` under way: a TensorStore future, or (a read split in pieces) a callable."""
        pieces = self.pieces(index)
        if pieces is None:
            self._check_blosc(index)
            return self._read(index)
        starts, sizes = block_extent(index, self.reader.shape)

        def piecewise() -> np.ndarray:
            out = np.empty(sizes, self.reader.dtype)
            for piece, local in pieces:
                self._check_blosc(piece)
                out[local] = self.result(self._read(piece))
            return out

        return piecewise

    def _read(self, index: Index) -> Any:
        future = self.store[index].read()
        reopen = self._reopen
        if reopen is None:
            return future

        def or_through_database() -> np.ndarray:
            try:
                return np.asarray(future.result())
            except Exception:
                return self.wait(reopen()[index].read())

        return or_through_database

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

    The store is opened read-only with no cache for array chunks, so a
    block's memory is freed once the block is consumed. A storage chunk is
    decompressed whole: the peak per block is the larger of the block and the
    chunks it touches. The readers of one item share a context and the local
    folders they read, checked and pinned once (``ItemStores``: ``shared``; by
    default the reader's own); reads are split so none spans more than
    ``max_chunks_per_read``.
    """

    context: ReadContext  # always given (ArrayReader's may be None)

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

    @property
    def stores(self) -> ItemStores:
        """The context and pinned folders this reader opens its store with (its item's, or its own)."""
        if self._shared is None:
            self._shared = ItemStores(self.context.storage)
        return self._shared

    def _open(self, *, whole: bool = False) -> _Opened:
        """Pin and check the folders, open the store; refuse before decoding anything when one stored chunk
        (or a zarr3 shard's index) is too big to hold.

        The chunk shape is the store's own (``.zarray`` / ``zarr.json``), which a
        hostile file may declare at 2^40 elements: block reads are held to the
        memory budget, a whole-array read (``load_parameters``) to the machine's memory.
        """
        import tensorstore as ts

        stores = self.stores
        gen, spec, databases = stores.acquire(self.context.storage, self.spec, self._where, self.budget)
        pins = gen.pins
        try:
            def through_database() -> Any:
                try:
                    return ts.open(spec, read=True, open=True, context=gen.context).result()
                except Exception as e:  # tensorstore raises ValueError with a long status text
                    raise CheckpointError(f"{self._where}: cannot open array data ({pins.shown(first_line(e))}).") \
                        from None

            def open_() -> tuple:
                listed = stores.listed_spec(self.spec)
                store = None
                if listed is not None:  # its chunks kept from the item's one pass (``_hold_listed``)
                    try:
                        store = ts.open(listed[0], read=True, open=True, context=listed[1]).result()
                    except Exception:
                        store = None  # opened through the database, whose error names what is wrong
                store = store or through_database()
                try:
                    chunk = _grid_shape(store.chunk_layout.read_chunk.shape)
                    shard = _grid_shape(store.chunk_layout.write_chunk.shape or chunk)
                except Exception:  # a driver without a chunk layout: fall back to the metadata's
                    chunk = shard = tuple(self.chunk_shape or self.shape)
                return store, chunk, shard, _blosc_key(store, self._where), listed is not None and store is not None

            known = stores.opened(gen, self.spec, open_)
            store, chunk, shard, blosc, from_memory = known
            pins.check_lookups(self._where, self.shape, shard, databases)
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
            return _Opened(self, store, pins, chunk, blosc, lambda: stores.release(gen),
                           through_database if from_memory else None)
        except BaseException:
            stores.release(gen)
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


def item_stores(storage: Storage) -> ItemStores:
    """What the readers of one item share (``ItemStores``): one TensorStore context, its cache (OCDBT b-tree nodes
    locally; in a bucket, its scheme's ``_ts_kvstore.KvStore.context``, where every open costs round trips), and the folders
    they read, pinned once."""
    return ItemStores(storage)


def ts_spec(storage: Storage, item_dir: str, name: str, *, use_ocdbt: bool, use_zarr3: bool) -> dict[str, Any]:
    """The TensorStore spec of one saved array, as Orbax's ``ArrayReadSpec`` builds it."""
    if use_ocdbt:
        kvstore: dict[str, Any] = {"driver": "ocdbt", "base": kvstore_spec(storage, item_dir), "path": name}
    else:
        kvstore = kvstore_spec(storage, os.path.join(item_dir, name))
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
             problems: list[str] | None = None, stores: ItemStores | None = None) -> list[ArrayHeader | None]:
    """Open many arrays' zarr headers (TensorStore reads ``OPEN_BATCH`` of them in parallel); no array data.

    Each spec's local folders are checked first (``Pins``: the headers, and an
    OCDBT database whole, must resolve inside the checkpoint). With
    ``problems``, a leaf that cannot be opened is recorded there (and its
    header is None) instead of failing the whole item: ``verify`` lists them all.
    With ``stores`` (the item's readers' ``ItemStores``), the arrays of an OCDBT
    database open through its context, pinned folder and b-tree cache, once for
    the item rather than once per batch.
    """
    headers: list[ArrayHeader | None] = [None] * len(specs)
    if stores is not None:
        headers = _open_listed(context, stores, specs, where)
    rest = [i for i, header in enumerate(headers) if header is None]
    for a in range(0, len(rest), OPEN_BATCH):
        at = rest[a:a + OPEN_BATCH]
        batch, wheres = [specs[i] for i in at], [where[i] for i in at]
        if stores is not None and all((s.get("kvstore") or {}).get("driver") == "ocdbt" for s in batch):
            opened = _open_shared(context, stores, batch, wheres, problems)
        else:
            opened = _open_batch(context, batch, wheres, problems)
        for i, header in zip(at, opened):
            headers[i] = header
    return headers


_HEADER_FILES = {"zarr": ".zarray", "zarr3": "zarr.json"}
_PLAIN_SPEC = {"driver", "kvstore", "recheck_cached_data", "recheck_cached_metadata", "fill_missing_data_reads"}
"""What ``ts_spec`` puts in a spec: nothing that changes how a header parses but the driver (no dtype or shape
asked of it), so one parse serves every array whose header has the same bytes."""


def _header_key(spec: dict[str, Any]) -> bytes | None:
    """The key of an array's zarr header in the OCDBT database its spec (as ``ts_spec`` builds them) reads, None
    for any other spec."""
    name, kvstore = _HEADER_FILES.get(str(spec.get("driver"))), spec.get("kvstore") or {}
    path = kvstore.get("path", "")
    if name is None or kvstore.get("driver") != "ocdbt" or not isinstance(path, str) or not set(spec) <= _PLAIN_SPEC:
        return None
    return (path + name if not path or path.endswith("/") else f"{path}/{name}").encode()


def _open_listed(context: ReadContext, stores: ItemStores, specs: list[dict[str, Any]],
                 where: list[str]) -> list[ArrayHeader | None]:
    """The headers of the arrays of one local OCDBT database, read in one pass over its b-tree
    (``_ocdbt.values``) and opened from memory by TensorStore's own zarr drivers: the same parse and checks
    (``ArrayHeader``) as an open through the database, without one b-tree lookup per array (each scans a leaf
    of the whole item: metadata ``inspect`` grew with exponent 1.5 in leaves). None for each array to open
    as before (``_open_shared``): specs of other databases or kinds, a tree ``values`` declines, a header not
    found, or one that does not open (TensorStore's error through the database is the one said).
    """
    import tensorstore as ts

    none: list[ArrayHeader | None] = [None] * len(specs)
    keys = [_header_key(spec) for spec in specs]
    base = (specs[0].get("kvstore") or {}).get("base") if specs else None
    if (context.storage.remote or not isinstance(base, dict) or base.get("driver") != "file" or None in keys
            or any((spec.get("kvstore") or {}).get("base") != base for spec in specs)):
        return none
    try:
        gen, rewritten, _ = stores.acquire(context.storage, specs[0], where[0], context.memory_budget)
    except CheckpointError:
        return none  # a database refused: every array's open says so, as before
    try:
        pinned = ((rewritten.get("kvstore") or {}).get("base") or {}).get("path")
        if not isinstance(pinned, str):
            return none
        arrays = {_array_prefix(spec, key) for spec, key in zip(specs, keys) if key is not None}
        chunks: dict[bytes, dict[bytes, bytes] | None] = {}
        limit = min(context.memory_budget, DEFAULT_MEMORY_BUDGET)
        found = ocdbt_values(context.storage, pinned.rstrip("/"), set(k for k in keys if k is not None), limit,
                             shown=str(base["path"]).rstrip("/"), arrays=arrays, chunks=chunks,
                             hold=int(min(limit * LISTED_DATA_SHARE, LISTED_DATA_BYTES)))
    finally:
        stores.release(gen)
    if not found:
        return none
    # A header's parse depends on its bytes alone: arrays of one shape and dtype (a model's layers) share one.
    distinct: dict[tuple[str, bytes], list[int]] = {}
    for i, key in enumerate(keys):
        if key in found:
            distinct.setdefault((specs[i]["driver"], found[key]), []).append(i)
    memory = ts.Context()
    kv = ts.KvStore.open({"driver": "memory"}, context=memory).result()
    firsts = [(at[0], at) for at in distinct.values()]
    for n, (i, _) in enumerate(firsts):
        kv[f"{n}/{_HEADER_FILES[specs[i]['driver']]}".encode()] = found[keys[i]]  # type: ignore[index]
    headers = none[:]
    for a in range(0, len(firsts), OPEN_BATCH):
        futures = []
        for n, (i, at) in enumerate(firsts[a:a + OPEN_BATCH], start=a):
            futures.append((at, ts.open({**specs[i], "kvstore": {"driver": "memory", "path": str(n)}}, read=True,
                                        open=True, context=memory)))
        for at, future in futures:
            try:
                header = ArrayHeader(future.result(), where[at[0]])
            except Exception:  # opened through the database instead, whose error names what is wrong
                continue
            for i in at:
                headers[i] = header
    _hold_listed(stores, specs, keys, headers, found, chunks)
    return headers


LISTED_DATA_BYTES = 256 * 2**20
"""The most bytes of arrays' inline chunks ``_open_listed`` keeps from its pass (and half the memory budget)."""

LISTED_DATA_SHARE = 0.5


def _array_prefix(spec: dict[str, Any], key: bytes) -> bytes:
    """The folder (``name/``) of an array's keys in its OCDBT database, from its header's key."""
    return key[:len(key) - len(_HEADER_FILES[spec["driver"]])]


def _hold_listed(stores: ItemStores, specs: list[dict[str, Any]], keys: list[bytes | None],
                 headers: list[ArrayHeader | None], found: dict[bytes, bytes],
                 chunks: dict[bytes, dict[bytes, bytes] | None]) -> None:
    """Keep, for ``stores``, the header and chunks of each array all of whose chunks the pass found inline (each
    chunk of its grid, and no other key): ``TensorStoreReader`` opens those from memory (``ItemStores.listed_spec``
    puts them in a memory key-value store when the array is first read), TensorStore's zarr driver decoding the
    same bytes, instead of looking each chunk up in the database (each lookup scans a leaf of the whole item). Any
    other array is read as before. Arrays of the same header share its bytes."""
    listed: dict[int, tuple[dict[str, Any], str, bytes, tuple[tuple[bytes, bytes], ...]]] = {}
    shared: dict[bytes, bytes] = {}
    for spec, key, header in zip(specs, keys, headers):
        kept = chunks.pop(_array_prefix(spec, key), None) if key is not None and header is not None else None
        if not kept or header is None or key is None:
            continue
        layout = header.chunk_layout
        grid = () if not header.shape else layout.write_chunk.shape or layout.read_chunk.shape  # 0-d: one chunk
        if grid is None or len(grid) != len(header.shape) or any(not c for c in grid):
            continue
        if len(kept) != math.prod(-(-n // c) for n, c in zip(header.shape, grid)):
            continue  # a chunk missing (TensorStore's error says so) or a key that is no chunk of the grid
        header_bytes = shared.setdefault(found[key], found[key])
        listed[id(spec)] = (spec, _HEADER_FILES[spec["driver"]], header_bytes, tuple(kept.items()))
    chunks.clear()
    if listed:
        stores.keep_listed(listed)


def _open_batch(context: ReadContext, specs: list[dict[str, Any]], where: list[str],
                problems: list[str] | None) -> list[ArrayHeader | None]:
    import tensorstore as ts

    # One descriptor per array folder, held until its header is read: a batch's worth at a time. The cache
    # (b-tree nodes the arrays of one OCDBT item share) lives as long as the descriptors: a descriptor number
    # reused by the next batch names another folder.
    cache = ts.Context({"cache_pool": {"total_bytes_limit": 16 * 2**20}})
    with Pins(context.storage, data=False, budget=context.memory_budget) as pins:
        batch: list[ts.Future[ts.TensorStore] | CheckpointError] = []
        for spec, w in zip(specs, where):
            try:
                batch.append(ts.open(pins.spec(spec, w), read=True, open=True, context=cache))
            except CheckpointError as e:
                if problems is None:
                    raise
                batch.append(e)
        return [_header(future, w, pins, problems) for future, w in zip(batch, where)]


def _open_shared(context: ReadContext, stores: ItemStores, specs: list[dict[str, Any]], where: list[str],
                 problems: list[str] | None) -> list[ArrayHeader | None]:
    import tensorstore as ts

    batch: list[tuple[Any, Any]] = []
    try:
        for i, (spec, w) in enumerate(zip(specs, where)):
            try:  # the folders checked for change once a batch, as a batch of Pins of its own did
                gen, rewritten, _ = stores.acquire(context.storage, spec, w, context.memory_budget, recheck=i == 0)
            except CheckpointError as e:
                if problems is None:
                    raise
                batch.append((e, None))
                continue
            batch.append((None, gen))  # released below even if the open raises
            batch[-1] = (ts.open(rewritten, read=True, open=True, context=gen.context), gen)
        out: list[ArrayHeader | None] = []
        for future, gen in batch:
            header = _header(future, where[len(out)], gen.pins if gen is not None else None, problems)
            if gen is not None and header is not None:
                gen.keep = future.result()  # the b-tree cache lives as long as a store reading through it
            out.append(header)
        return out
    finally:
        for _, gen in batch:
            if gen is not None:
                stores.release(gen)


def _header(future: Any, w: str, pins: Pins | None, problems: list[str] | None) -> ArrayHeader | None:
    """The header a ``ts.open`` future gives; an error recorded in ``problems`` (None returned), or raised."""
    try:
        if isinstance(future, CheckpointError):
            raise future
        return ArrayHeader(future.result(), w)
    except CheckpointError as e:  # a FIFO where a file is read: not read (never opened), not damage
        message = UnreadProblem(e) if isinstance(e, SpecialFileError) else str(e)
    except Exception as e:
        text = first_line(e)
        message = f"{w}: cannot open array metadata ({pins.shown(text) if pins is not None else text})."
    if problems is None:
        raise CheckpointError(message) from None
    if message not in problems[-1:]:  # a database refused whole: said once, not once per array
        problems.append(message)
    return None


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
    shared = item_stores(storage)
    leaves: list[Leaf | None] = []
    headers = open_all(context, specs, wheres, problems, stores=shared)
    for (parts, folder, _), spec, w, store in zip(arrays, specs, wheres, headers):
        if store is None:
            leaves.append(None)
            continue
        dtype = np.dtype(store.dtype.numpy_dtype)
        shape = tuple(int(d) for d in store.shape)
        chunk = tuple(int(c) for c in store.chunk_layout.read_chunk.shape or ()) or None
        reader = TensorStoreReader(context, spec, shape, dtype, chunk, where=w, shared=shared)
        leaves.append(Leaf(array_row(parts, shape, dtype), reader, key=folder))
    return leaves
