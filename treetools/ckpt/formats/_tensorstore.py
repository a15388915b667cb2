"""TensorStore-backed arrays, shared by the formats that store zarr arrays (Orbax, T5X, Orbax before 0.5).

Not a format (its name starts with ``_``): the reader of one zarr array
(``TensorStoreReader``), the spec of one saved array as Orbax builds it
(``ts_spec``), opening many arrays' headers at once (``open_all``), and the
refusal of special files TensorStore would block on (``refuse_special_files``).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import numpy as np

from treetools.ckpt import storage
from treetools.ckpt.readers import ArrayReader, Index, check_budget, physical_memory
from treetools.ckpt.steps import file_kind
from treetools.errors import CheckpointError


def subdirs(folder: str) -> list[str]:
    """Names of the folders directly under ``folder`` (symlinks not followed), sorted."""
    try:
        with storage.scandir(folder) as it:
            return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot list folder ({e.strerror or e}).") from None


def first_line(e: BaseException) -> str:
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
            raise CheckpointError(f"{self._where}: cannot open array data ({first_line(e)}).") from None
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
            check_budget(piece, where=self._where, what=f"one storage chunk ({list(chunk)} {self.dtype})",
                         budget=self.budget)
        return store

    def _result(self, future: Any) -> np.ndarray:
        try:
            return np.asarray(future.result())
        except Exception as e:
            raise CheckpointError(f"{self._where}: cannot read array data ({first_line(e)}).") from None

    def read(self, index: Index) -> np.ndarray:
        store = self._store if self._store is not None else self._open()
        return self._result(store[index].read())

    reads_async = True

    def reading(self) -> Callable[[Index], Any]:
        """Open the store once; each call issues one block's read and returns at once (``.result()`` waits)."""
        store = self._open()
        return lambda index: _Reading(self, store[index].read())

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


class _Reading:
    """A TensorStore read in flight: ``result()`` waits for it (errors as one-line ``CheckpointError``s)."""

    def __init__(self, reader: TensorStoreReader, future: Any):
        self._reader, self._future = reader, future

    def result(self) -> np.ndarray:
        return self._reader._result(self._future)


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




def refuse_special_files(item_dir: str, names: Sequence[str], *, use_ocdbt: bool, use_zarr3: bool) -> None:
    """TensorStore blocks forever opening a FIFO: refuse special files among those it reads for array metadata."""
    import stat

    if storage.is_remote(item_dir):
        return  # a bucket holds objects only

    if use_ocdbt:  # the manifests and the b-tree/data files of the item and of each process
        folders = [item_dir, os.path.join(item_dir, "d")]
        folders += [os.path.join(item_dir, p, sub) for p in subdirs(item_dir) if p.startswith("ocdbt.process_")
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


def open_all(specs: list[dict[str, Any]], where: list[str], problems: list[str] | None = None) -> list[Any]:
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
            message = f"{w}: cannot open array metadata ({first_line(e)})."
            if problems is None:
                raise CheckpointError(message) from None
            problems.append(message)
            stores.append(None)
    return stores
