"""TensorStore-backed arrays, shared by the formats that store zarr arrays (Orbax, T5X, Orbax before 0.5,
Levanter, EasyDeL).

Not a format (its name starts with ``_``): the reader of one zarr array
(``TensorStoreReader``), the spec of one saved array as Orbax builds it
(``ts_spec``), opening many arrays' headers at once (``open_all``), the
refusal of special files TensorStore would block on (``refuse_special_files``),
and, for the formats that keep one zarr folder per leaf (jax's
``GlobalAsyncCheckpointManager``: Levanter, EasyDeL, Orbax's ``ArrayCheckpointHandler``),
finding those folders (``array_folders``) and reading them as leaves (``zarr_leaves``).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Sequence

import numpy as np

from treetools.ckpt import storage
from treetools.ckpt.readers import ArrayReader, Index, check_budget, physical_memory
from treetools.ckpt.source import Leaf, array_row
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


ZARR_HEADERS = (".zarray", "zarr.json")
"""The header of a zarr v2 / v3 array folder."""


def zarr_header(folder: str) -> str | None:
    """The zarr header file of an array folder (``.zarray`` or ``zarr.json``), None when it is not one."""
    return next((h for h in ZARR_HEADERS if storage.isfile(os.path.join(folder, h))), None)


def natural_key(parts: Sequence[str]) -> tuple[Any, ...]:
    """Sort key of a path that orders ``layers/2`` before ``layers/10``.

    >>> sorted([("l", "10"), ("l", "2"), ("a",)], key=natural_key)
    [('a',), ('l', '2'), ('l', '10')]
    """
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def array_folders(top: str) -> tuple[list[tuple[tuple[str, ...], str]], list[tuple[str, ...]]]:
    """Every zarr array folder at or below ``top``, and every folder below it that ends without one.

    Returns ``([(path parts, header name)], [path parts of empty end folders])``, relative to ``top``
    (``()`` when ``top`` is itself an array), in natural order; nothing below an array folder is
    looked at (its chunks). An end folder without a header is where an array was lost (a partial copy).
    """
    arrays: list[tuple[tuple[str, ...], str]] = []
    empty: list[tuple[str, ...]] = []
    base = storage.normalize(top)
    for folder, dirs, files in storage.walk(top):
        rel = storage.normalize(folder)[len(base):].strip("/")
        parts = tuple(re.split(r"[/\\]", rel)) if rel else ()
        header = next((h for h in ZARR_HEADERS if h in files), None)
        if header is not None:
            arrays.append((parts, header))
            dirs[:] = []  # its chunks (and nested chunk folders of dimension_separator "/")
        elif not dirs:
            empty.append(parts)
    return sorted(arrays, key=lambda a: natural_key(a[0])), sorted(empty, key=natural_key)


def zarr_leaves(base: str, arrays: Sequence[tuple[tuple[str, ...], str, str]], *, where: str,
                problems: list[str] | None = None) -> list[Leaf | None]:
    """One leaf per zarr array folder ``base/<folder>``: ``(leaf path parts, folder, header name)``.

    Shape, dtype and chunks come from the headers, opened all at once (no
    array data); each leaf's data is read on request through a ``TensorStoreReader``.
    With ``problems``, an array that cannot be opened is recorded there and its
    leaf is None; without, it is an error.
    """
    for header in ZARR_HEADERS:
        names = [folder for _, folder, h in arrays if h == header]
        if names:
            refuse_special_files(base, names, use_ocdbt=False, use_zarr3=header == "zarr.json")
    specs = [ts_spec(base, folder, use_ocdbt=False, use_zarr3=header == "zarr.json") for _, folder, header in arrays]
    wheres = [f"{where}: `{'/'.join(parts)}`" for parts, _, _ in arrays]
    context = reader_context(base)
    leaves: list[Leaf | None] = []
    for (parts, folder, _), spec, w, store in zip(arrays, specs, wheres, open_all(specs, wheres, problems)):
        if store is None:
            leaves.append(None)
            continue
        dtype = np.dtype(store.dtype.numpy_dtype)
        shape = tuple(int(d) for d in store.shape)
        chunk = tuple(int(c) for c in store.chunk_layout.read_chunk.shape or ()) or None
        reader = TensorStoreReader(spec, shape, dtype, chunk, where=w, context=context)
        leaves.append(Leaf(array_row(parts, shape, dtype), reader, key=folder))
    return leaves
