"""Keras 3 ``.weights.h5`` and ``.keras`` files, read through h5py (the ``keras`` extra), without keras or jax.

Keras writes its variables into HDF5 (keras/src/saving/saving_lib.py,
``H5IOStore``): one group per saveable named by its attribute path
(``layers/dense``; the layer's own name is the ``name`` attribute of its
``vars`` group), the variables as datasets ``vars/0``, ``vars/1``, ... in the
order of ``layer.weights``, the optimizer's under ``optimizer/vars/N``.
bfloat16 (and other ml_dtypes) is stored as opaque bytes (``|V2``) with the
attribute ``dtype="bfloat16"``. ``model.save("m.keras")`` zips
``metadata.json``, ``config.json`` and that HDF5 file as ``model.weights.h5``,
uncompressed: it is read in place, at its offset in the zip.

One item, ``default``, whose leaf paths are the HDF5 dataset paths
(``layers/dense/vars/0``), in natural order; shapes and dtypes come from the
dataset headers, data is read on request, one block at a time. Any other
HDF5 file reads the same way, as its datasets. Without h5py the file is
refused with one line naming what it is and the extra to install.

The file is untrusted (``_hdf5``): external links, virtual datasets and
external storage (data libhdf5 would read from other files) are refused; a
chunked dataset is decoded chunk by chunk by treetools, each chunk held to
its size and the memory budget, and what a dataset declares is held to the
file's size before it is read.
"""

from __future__ import annotations

import io
import math
import zipfile
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats import _hdf5
from treetools.checkpoint_io.formats._tensorstore import natural_key
from treetools.checkpoint_io.leaves import Leaf, array_row, check_name, value_row
from treetools.checkpoint_io.readers import ArrayReader, Index, check_budget, is_numeric, np_dtype
from treetools.checkpoint_io.source import file_head, FileSource, Format
from treetools.checkpoint_io.storage import Storage
from treetools.shared.errors import CheckpointError
from treetools.shared.install import install_hint

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGIC = b"PK\x03\x04"
WEIGHTS_MEMBER = "model.weights.h5"
"""The HDF5 file inside a ``.keras`` zip (saving_lib's ``_VARS_FNAME`` + ``.h5``)."""
INSTALL = install_hint("keras")


class _Window(io.RawIOBase):
    """``size`` bytes at ``start`` of a file (local or in a bucket), as a read-only seekable file: the HDF5 file
    stored uncompressed inside a ``.keras`` zip, which h5py reads in place."""

    def __init__(self, storage: Storage, path: str, start: int, size: int):
        self._file = storage.open(path, block_size=2**20)
        self._start, self._size, self._pos = start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        self._file.seek(self._start + self._pos)
        data = self._file.read(n)
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        self._file.close()
        super().close()


def _member(storage: Storage, path: str) -> zipfile.ZipInfo | None:
    """The ``model.weights.h5`` entry of a ``.keras`` zip, None when the zip has none."""
    with storage.open(path) as f, zipfile.ZipFile(f) as z:
        try:
            return z.getinfo(WEIGHTS_MEMBER)
        except KeyError:
            return None


def _opener(storage: Storage, path: str) -> tuple[Callable[[], Any], int]:
    """A function opening the file's HDF5 (the file itself, or the member of a ``.keras`` zip) with h5py, through
    ``storage`` (a local file opened inside the checkpoint, or ranged reads in a bucket), and the HDF5's size."""
    import h5py  # the `keras` extra: imported only to read a Keras file

    if file_head(storage, path, len(HDF5_MAGIC)) == HDF5_MAGIC:
        return (lambda: h5py.File(storage.open(path, block_size=2**20), "r")), storage.getsize(path)
    info = _member(storage, path)
    if info is None:
        raise CheckpointError(f"{path}: a zip without {WEIGHTS_MEMBER}; not a Keras 3 .keras file.")
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{path}: {WEIGHTS_MEMBER} is compressed in the zip (Keras stores it uncompressed); "
                              "unzip it and read the .h5 file.")
    # The data follows the member's local header: 30 bytes, its name and its extra field.
    local = storage.read_range(path, info.header_offset, 30)
    if len(local) < 30 or local[:4] != ZIP_MAGIC:
        raise CheckpointError(f"{path}: corrupt zip (no local header for {WEIGHTS_MEMBER}).")
    start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    # The size the zip's directory declares is no evidence: the member must lie within the zip's own bytes (a 7 KB
    # file declaring a 4 GB member let its datasets declare 2^28 chunks "within" it, for verify to walk).
    total = storage.getsize(path)
    if info.compress_size != info.file_size or start + info.file_size > total:
        raise CheckpointError(f"{path}: corrupt zip ({WEIGHTS_MEMBER} declares {info.file_size:,} bytes from byte "
                              f"{start:,}, and the file holds {total:,}); refusing to read it.")
    return (lambda: h5py.File(_Window(storage, path, start, info.file_size), "r")), info.file_size


def _dtype(stored: np.dtype, name: str | None) -> np.dtype:
    """A dataset's dtype; opaque bytes with a ``dtype`` attribute are that ml_dtype (Keras's bfloat16)."""
    if stored.kind == "V" and name is not None:
        try:
            wanted = np_dtype(name)
        except (TypeError, AttributeError):
            return stored
        if wanted.itemsize == stored.itemsize:
            return wanted
    return stored


class H5Reader(ArrayReader):
    """One HDF5 dataset, read a block at a time: libhdf5 reads a compact or contiguous one directly; a chunked one
    is read chunk by chunk and decoded by treetools (``_hdf5.read_chunked``), one chunk held at a time."""

    def __init__(self, context: ReadContext, opener: Callable[[], Any], info: _hdf5.Dataset, file_size: int, *,
                 where: str):
        self.context = context
        self._opener, self._info, self._size, self._where = opener, info, file_size, where
        self.shape, self.dtype, self.chunk_shape = info.shape, info.dtype, info.chunks
        self.remote = context.storage.remote

    def _read(self, f: Any, index: Index) -> np.ndarray:
        info = self._info
        try:
            ds = _hdf5.open_dataset(f, info.raw, self._where)
            if info.chunks:
                block = _hdf5.read_chunked(ds, info, index, where=self._where, budget=self.budget,
                                           file_size=self._size)
            else:
                block = np.asarray(ds[index if index else ()])
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{self._where}: cannot read array data ({e}).") from None
        return block.view(self.dtype) if self.dtype != info.stored else block

    def _check(self) -> None:
        _hdf5.check_work(self._info, self._size, self._where)
        if self.chunk_shape is not None:  # a chunk is decoded whole
            check_budget(math.prod(self.chunk_shape) * self.dtype.itemsize, where=self._where,
                         what=f"one HDF5 chunk ({list(self.chunk_shape)} {self.dtype})", budget=self.budget)

    def read(self, index: Index) -> np.ndarray:
        self._check()
        with self._opener() as f:
            return self._read(f, index)

    def blocks(self, plan: Iterable[Index]) -> Iterator[np.ndarray]:
        self._check()
        with self._opener() as f:
            for index in plan:
                yield self._read(f, index)


def read_h5(context: ReadContext, path: str, opener: Callable[[], Any], file_size: int) -> list[Leaf]:
    """Every dataset of the HDF5 file as a leaf at its path; no array data is read. Links, virtual datasets and
    external storage that would make libhdf5 open other files are refused (``_hdf5``)."""
    try:
        with opener() as f:
            found = _hdf5.datasets(f, path, _dtype)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated HDF5 (a Keras weights file?): {e}.") from None
    leaves = []
    for info in sorted(found, key=lambda d: natural_key(d.parts)):
        name = "/".join(info.parts)
        check_name(name, where=path)
        if not is_numeric(info.dtype) or info.dtype.hasobject or not info.dtype.itemsize:
            leaves.append(Leaf(value_row(info.parts)))  # strings (a lookup layer's vocabulary): a value, not read
            continue
        reader = H5Reader(context, opener, info, file_size, where=f"{path}: `{name}`")
        leaves.append(Leaf(array_row(info.parts, info.shape, info.dtype), reader))
    return leaves


def _what(storage: Storage, path: str) -> str:
    if file_head(storage, path, len(HDF5_MAGIC)) == HDF5_MAGIC:
        return "a Keras weights file (HDF5, model.save_weights)"
    return "a Keras 3 model file (.keras: a zip holding model.weights.h5)"


def _open(location: str, display: str, context: ReadContext) -> FileSource:
    storage = context.storage
    try:
        opener, size = _opener(storage, location)
    except ImportError:
        raise CheckpointError(f"{display}: {_what(storage, location)}; reading it needs h5py: {INSTALL}.") from None
    try:
        leaves = read_h5(context, location, opener, size)
    except CheckpointError as e:  # name the path as typed
        raise CheckpointError(str(e).replace(location, display, 1)) from None
    return FileSource(display, context, "keras", leaves)


def _claims(path: str, context: ReadContext) -> bool:
    storage = context.storage
    head = file_head(storage, path, len(HDF5_MAGIC))
    if head == HDF5_MAGIC:
        return True
    if not head.startswith(ZIP_MAGIC):
        return False
    try:
        return _member(storage, path) is not None
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return False


FORMAT = Format(
    name="keras",
    priority=32,  # before npz (30), which takes any zip
    claims=_claims,
    open=_open,
    # a literal: `inspect --help` reads it from this source without importing the module (formats.catalog)
    description="a Keras 3 .weights.h5 or .keras file (or any HDF5 file's datasets), through h5py (pip install "
                "'jax-treetools[keras]')",
)
