"""HDF5 files read without letting libhdf5 open other files or decode without bounds (h5py, the ``keras`` extra).

Not a format (its name starts with ``_``): what ``keras`` (Keras 3 ``.weights.h5`` / ``.keras``, any HDF5 file's
datasets) reads HDF5 through.

libhdf5 opens other files by name on its own, wherever they are: the target of an external link, the source
files of a virtual dataset (VDS), the raw files of a dataset with external storage (``H5Pset_external``). None of
them goes through the checkpoint's confined storage, so **all three are refused**, whatever their target: Keras
and h5py's ``create_dataset`` write none of them, and a target that looks inside the checkpoint today may be a
link elsewhere tomorrow (libhdf5 resolves names against its own search paths and environment variables). A soft
link (a second name inside the same file) is skipped: its dataset is listed under its own name.

libhdf5 also decodes what a chunked dataset declares without bounds: it builds a structure for every chunk a
selection touches (2^18 chunks declared by a 4.5 KB file: 1.7 GB) and inflates a deflate chunk into a buffer it
doubles until the stream ends (a 4-byte chunk whose 0.8 MB stream inflates to 800 MiB). So:

* before a dataset is read, what it declares is held to the file's size: at most ``FREE_CHUNKS`` chunks beyond
  one per 16 bytes of the file (each stored chunk costs an index entry), and at most ``FREE_BYTES`` beyond
  ``DEFLATE_MAX_RATIO`` times the file's size (zlib's own limit: nothing inflates further);
* a chunked dataset is read chunk by chunk by this module, not by libhdf5: each chunk the block touches is
  looked up, its stored bytes read raw (``H5Dread_chunk``) and decoded here through the filters treetools knows
  (``FILTERS``: deflate, shuffle, fletcher32; any other filter is refused, never a plugin loaded), each stage
  stopping at the chunk's size; a chunk never written is the fill value, without any decoding. One chunk is held
  at a time, and a chunk must fit the memory budget.

Compact and contiguous datasets (Keras's own layout) are read by libhdf5 directly: no filter, no decoding, one
block at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from typing import Any

import numpy as np

from treetools.checkpoint_io.readers import Index, block_extent, check_budget
from treetools.shared.errors import CheckpointError

FILTERS = {1: "deflate", 2: "shuffle", 3: "fletcher32"}
"""The HDF5 filters this module decodes itself (h5py's ``compression="gzip"``, ``shuffle=True``, ``fletcher32=True``)."""

FREE_CHUNKS = 65_536
"""Chunks a dataset may declare beyond what its file can store (one chunk per 16 bytes)."""

FREE_BYTES = 2**30
"""Bytes a dataset may declare beyond what its file can inflate to (``DEFLATE_MAX_RATIO`` times its size)."""

DEFLATE_MAX_RATIO = 1032
"""The most one byte of a deflate stream inflates to (zlib's technical note: 258 bytes per 2 bits)."""

MAX_DEPTH = 256
"""Groups nested deeper than this are refused (a path of that many names is no checkpoint)."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """What treetools keeps of one HDF5 dataset: its path (names as stored, bytes), shape, dtypes, layout."""

    raw: tuple[bytes, ...]
    parts: tuple[str, ...]
    shape: tuple[int, ...]
    stored: np.dtype
    dtype: np.dtype
    chunks: tuple[int, ...] | None
    filters: tuple[tuple[int, int, tuple[int, ...]], ...]


def refuse_foreign(dcpl: Any, where: str) -> None:
    """Refuse a dataset whose data libhdf5 would read from other files: a virtual dataset, external storage."""
    import h5py

    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        raise CheckpointError(f"{where}: a virtual dataset (its data is read from other files); treetools never "
                              "lets libhdf5 open files outside the checkpoint: refusing to read it.")
    if dcpl.get_external_count():
        raise CheckpointError(f"{where}: a dataset with external storage (its data lives in other files); treetools "
                              "never lets libhdf5 open files outside the checkpoint: refusing to read it.")


def _name(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def _filters(dcpl: Any) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    out = []
    for i in range(dcpl.get_nfilters()):
        code, flags, values, _ = dcpl.get_filter(i)
        out.append((int(code), int(flags), tuple(int(v) for v in values)))
    return tuple(out)


def _small_text_attr(obj: Any, name: bytes, limit: int = 256) -> str | None:
    """A small string attribute (Keras's ``dtype="bfloat16"``), None when absent or not small text."""
    import h5py

    if not h5py.h5a.exists(obj.id, name):
        return None
    attr = h5py.h5a.open(obj.id, name)
    if attr.get_storage_size() > limit or attr.shape not in ((), (1,)) or attr.dtype.kind not in "SUO":
        return None
    try:
        value = obj.attrs[name.decode()]
    except (OSError, TypeError, ValueError):
        return None
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)[0] if value.size else None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) and len(value) <= limit else None


def describe(ds: Any, raw: tuple[bytes, ...], where: str, wanted_dtype: Any) -> Dataset:
    """One dataset's record, after refusing one whose data libhdf5 would read from other files (see the module).

    ``wanted_dtype(stored dtype, dtype attribute) -> dtype`` maps opaque bytes to an ml_dtype (Keras's bfloat16).
    """
    dcpl = ds.id.get_create_plist()
    refuse_foreign(dcpl, where)
    stored = np.dtype(ds.dtype)
    shape = tuple(int(d) for d in ds.shape or ())
    chunks = tuple(int(c) for c in ds.chunks) if ds.chunks else None
    filters = _filters(dcpl) if chunks else ()
    dtype = wanted_dtype(stored, _small_text_attr(ds, b"dtype")) if stored.kind == "V" else stored
    return Dataset(raw, tuple(_name(r) for r in raw), shape, stored, np.dtype(dtype), chunks, filters)


def check_work(info: Dataset, file_size: int, where: str) -> None:
    """Refuse to read a dataset treetools cannot decode within bounds: a filter it does not know, more bytes than
    any encoding of its file's size inflates to, more chunks than the file can index (see the module). Nothing is
    read: what was listed is checked."""
    for code, _, _ in info.filters:
        if code not in FILTERS:
            raise CheckpointError(f"{where}: HDF5 filter {code}, which treetools does not decode (it reads "
                                  f"{', '.join(FILTERS.values())}; loading a filter plugin is refused).")
    nbytes = math.prod(info.shape) * max(1, info.stored.itemsize)
    if nbytes > FREE_BYTES + DEFLATE_MAX_RATIO * file_size:
        raise CheckpointError(
            f"{where}: declares {nbytes:,} bytes of data in a file of {file_size:,} bytes, more than any HDF5 "
            "encoding it could hold inflates to; the file is corrupt or hostile: refusing to read it.")
    if info.chunks:
        declared = math.prod(-(-n // max(1, c)) for n, c in zip(info.shape, info.chunks))
        if declared > FREE_CHUNKS + file_size // 16:
            raise CheckpointError(
                f"{where}: declares {declared:,} chunks of {list(info.chunks)} in a file of {file_size:,} bytes (each "
                "stored chunk takes an index entry): reading them would cost out of proportion to what is stored; "
                "the file is corrupt or hostile: refusing to read it.")


def datasets(f: Any, where: str, wanted_dtype: Any) -> list[Dataset]:
    """Every dataset of the open file ``f``, walked group by group over hard links (no recursion, each object
    once); an external or user-defined link is refused, a soft link skipped (see the module)."""
    import h5py

    out: list[Dataset] = []
    seen = {h5py.h5o.get_info(f.id).addr}
    stack: list[tuple[tuple[bytes, ...], Any]] = [((), f)]
    while stack:
        parts, group = stack.pop()
        for raw in list(group.id):
            link = group.id.links.get_info(raw)
            path = parts + (raw,)
            shown = "/".join(_name(p) for p in path)
            if link.type == h5py.h5l.TYPE_SOFT:
                continue
            if link.type == h5py.h5l.TYPE_EXTERNAL:
                raise CheckpointError(f"{where}: `{shown}` is an external link (to another HDF5 file); treetools never "
                                      "lets libhdf5 open files outside the checkpoint: refusing to read it.")
            if link.type != h5py.h5l.TYPE_HARD:
                raise CheckpointError(f"{where}: `{shown}` is a user-defined HDF5 link; refusing to follow it.")
            obj = h5py.h5o.open(group.id, raw)
            addr = h5py.h5o.get_info(obj).addr
            if addr in seen:  # a second hard link to an object already listed (or a cycle back up)
                continue
            seen.add(addr)
            kind = h5py.h5i.get_type(obj)
            if kind == h5py.h5i.GROUP:
                if len(path) >= MAX_DEPTH:
                    raise CheckpointError(f"{where}: groups nested more than {MAX_DEPTH} deep; no checkpoint is: "
                                          "refusing to read it.")
                stack.append((path, h5py.Group(obj)))
            elif kind == h5py.h5i.DATASET:
                out.append(describe(h5py.Dataset(obj), path, f"{where}: `{shown}`", wanted_dtype))
    return out


def open_dataset(f: Any, raw: tuple[bytes, ...], where: str) -> Any:
    """The dataset at ``raw`` (names as stored), reached link by link over hard links only, checked again (a file
    changed since it was listed reads nothing from elsewhere)."""
    import h5py

    node = f.id
    for name in raw:
        if not node.links.exists(name) or node.links.get_info(name).type != h5py.h5l.TYPE_HARD:
            raise CheckpointError(f"{where}: the file changed since it was listed; read it again.")
        node = h5py.h5o.open(node, name)
    if h5py.h5i.get_type(node) != h5py.h5i.DATASET:
        raise CheckpointError(f"{where}: the file changed since it was listed; read it again.")
    ds = h5py.Dataset(node)
    refuse_foreign(ds.id.get_create_plist(), where)
    return ds


# ----------------------------------------------------------------------------------- chunks decoded here


def fletcher32(data: bytes | memoryview) -> int:
    """HDF5's Fletcher-32 checksum (``H5_checksum_fletcher32``: big-endian 16-bit words, sums folded every 360).

    >>> hex(fletcher32(b"abcde"))
    '0x4ff029c7'
    """
    raw = np.frombuffer(data, np.uint8)
    words = raw[: raw.size // 2 * 2].reshape(-1, 2).astype(np.uint64)
    words = (words[:, 0] << np.uint64(8)) | words[:, 1]
    sum1 = sum2 = 0
    mask = 0xFFFFFFFF
    for a in range(0, words.size, 360):
        block = words[a:a + 360]
        n = int(block.size)
        total = int(block.sum())
        prefixes = int(np.cumsum(block).sum())  # sum over k of (w_1 + ... + w_k)
        sum2 = (sum2 + n * sum1 + prefixes) & mask
        sum1 = (sum1 + total) & mask
        sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
        sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    if raw.size % 2:
        sum1 = (sum1 + (int(raw[-1]) << 8)) & mask
        sum2 = (sum2 + sum1) & mask
        sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
        sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
    sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    return ((sum2 << 16) | sum1) & mask


def _inflate(data: bytes, limit: int, where: str) -> bytes:
    """A deflate (zlib) stream inflated, stopping at ``limit`` bytes: a stream with more to give is refused before
    the rest is made."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, limit)
        if not d.eof and d.decompress(d.unconsumed_tail, 1):
            raise CheckpointError(f"{where}: a deflate chunk inflates to more than the {limit:,} bytes a chunk holds; "
                                  "the file is corrupt or hostile: refusing to inflate it.")
    except zlib.error as e:
        raise CheckpointError(f"{where}: a corrupt deflate chunk ({e}).") from None
    return out


def _unshuffle(data: bytes, size: int) -> bytes:
    if size <= 1 or len(data) < size:
        return data
    n = len(data) // size
    body = np.frombuffer(data, np.uint8, count=n * size).reshape(size, n).T.tobytes()
    return body + data[n * size:]


def decode_chunk(raw: bytes, mask: int, filters: tuple[tuple[int, int, tuple[int, ...]], ...], nbytes: int,
                 where: str) -> bytes:
    """A stored chunk through its filters, last applied first (those ``mask`` says were skipped left out); every
    stage stops at the chunk's ``nbytes``, and the result must be exactly that."""
    data = raw
    for i in reversed(range(len(filters))):
        if mask & (1 << i):
            continue
        code, _, values = filters[i]
        if code == 3:  # fletcher32: the checksum of what precedes it, stored after it
            if len(data) < 4:
                raise CheckpointError(f"{where}: a chunk too short for its fletcher32 checksum.")
            body, stored = data[:-4], int.from_bytes(data[-4:], "little")
            actual = fletcher32(body)
            swapped = ((actual & 0x00FF00FF) << 8) | ((actual >> 8) & 0x00FF00FF)  # libhdf5's older byte order
            if stored not in (actual, swapped):
                raise CheckpointError(f"{where}: a chunk fails its fletcher32 checksum; the file is corrupt.")
            data = body
        elif code == 1:
            data = _inflate(data, nbytes, where)
        elif code == 2:
            data = _unshuffle(data, values[0] if values else 1)
    if len(data) != nbytes:
        raise CheckpointError(f"{where}: a chunk decodes to {len(data):,} bytes, but a chunk holds {nbytes:,}; the "
                              "file is corrupt.")
    return data


def read_chunked(ds: Any, info: Dataset, index: Index, *, where: str, budget: float, file_size: int) -> np.ndarray:
    """The block ``index`` of a chunked dataset, assembled chunk by chunk (see the module)."""
    chunks = info.chunks or ()
    starts, sizes = block_extent(index, info.shape)
    fill = np.asarray(ds.fillvalue, dtype=info.stored)
    out = np.empty(sizes, info.stored)
    out[...] = fill
    if 0 in sizes:
        return out
    item = info.stored.itemsize
    nbytes = math.prod(chunks) * item
    check_budget(nbytes, where=where, what=f"one HDF5 chunk ({list(chunks)} {info.stored})", budget=budget)
    ranges = [range(s // c, -(-(s + n) // c)) for s, n, c in zip(starts, sizes, chunks)]
    dsid = ds.id
    for coords in itertools.product(*ranges):
        offset = tuple(k * c for k, c in zip(coords, chunks))
        stored = dsid.get_chunk_info_by_coord(offset)
        if stored.byte_offset is None:  # never written: the fill value, already there
            continue
        if stored.size > file_size:
            raise CheckpointError(f"{where}: a chunk of {stored.size:,} stored bytes in a file of {file_size:,}; the "
                                  "file is corrupt.")
        check_budget(stored.size, where=where, what="one HDF5 chunk as stored", budget=budget)
        mask, raw = dsid.read_direct_chunk(offset)
        data = decode_chunk(raw, mask, info.filters, nbytes, where) if info.filters else raw
        if len(data) != nbytes:
            raise CheckpointError(f"{where}: a chunk of {len(data):,} bytes, but a chunk holds {nbytes:,}; the file is "
                                  "corrupt.")
        chunk = np.frombuffer(data, info.stored).reshape(chunks)
        src = tuple(slice(max(s, o) - o, min(s + n, o + c) - o) for s, n, o, c in zip(starts, sizes, offset, chunks))
        dst = tuple(slice(max(s, o) - s, min(s + n, o + c) - s) for s, n, o, c in zip(starts, sizes, offset, chunks))
        out[dst] = chunk[src]
    return out
