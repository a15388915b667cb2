"""Single-file checkpoints: ``.safetensors``, ``.npz`` and Flax msgpack.

safetensors and npz are read from their headers alone (no tensor byte is
touched in metadata mode); their data is mapped one block at a time for
statistics, or streamed when an npz member is compressed. Flax msgpack has no
index: ``flax.serialization.msgpack_restore`` materializes the arrays, which is
unavoidable for that format.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import zipfile
from typing import Any, Iterator

import numpy as np

from treetools.inspect._base import (
    ArrayReader,
    CheckpointError,
    Leaf,
    MemmapReader,
    array_row,
    block_span,
    check_name,
    dotted_to_path,
    dtype_name,
    np_dtype,
    tree_leaves,
    value_row,
)

__all__ = ["read_msgpack", "read_npz", "read_safetensors", "sniff_file"]

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}
_ST_MAX_HEADER = 100 * 2**20  # the safetensors spec caps the header at 100 MB


def sniff_file(path: str) -> str | None:
    """``npz``, ``safetensors``, ``msgpack`` or None, from the first bytes (extension as a tie-break)."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
        size = os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}).") from None
    ext = os.path.splitext(path)[1].lower()
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "npz"
    if len(head) == 9 and head[8:9] == b"{" and 2 <= struct.unpack("<Q", head[:8])[0] <= size - 8:
        return "safetensors"
    if ext == ".safetensors":
        return "safetensors"  # broken header: its reader says how
    if ext == ".npz":
        return "npz"
    if head[:1] and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)):
        return "msgpack"  # a map: what flax.serialization.to_bytes writes for a state dict
    if ext in (".msgpack", ".flax", ".mpk"):
        return "msgpack"
    return None


def _leaf_path(name: str, *, where: str) -> str:
    check_name(name, where=where)
    return dotted_to_path(name)


def _unique(leaves: list[Leaf], *, where: str) -> list[Leaf]:
    seen: set[str] = set()
    for leaf in leaves:
        if leaf.row.path in seen:
            raise CheckpointError(f"{where}: two tensors map to the path `{leaf.row.path}`; rename one.")
        seen.add(leaf.row.path)
    return leaves


# ---------------------------------------------------------------------------- safetensors


def _st_header(path: str) -> tuple[dict[str, Any], int, int]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length).")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, _ST_MAX_HEADER):
            raise CheckpointError(
                f"{path}: corrupt or truncated safetensors header (says {n} bytes, file has {size - 8} after the length)."
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object).")
    return header, 8 + n, size - 8 - n


def read_safetensors(path: str) -> list[Leaf]:
    """Leaves of a ``.safetensors`` file from its JSON header; tensor bytes are never read here.

    >>> import numpy as np, safetensors.numpy, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> safetensors.numpy.save_file({"dense.kernel": np.zeros((2, 3), np.float32)}, f)
    >>> [(l.row.path, l.row.shape, l.row.dtype, l.row.bytes) for l in read_safetensors(f)]
    [('dense/kernel', (2, 3), 'float32', 24)]
    """
    header, data_start, data_len = _st_header(path)
    leaves = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        path_s = _leaf_path(name, where=path)
        try:
            dtype = np_dtype(_ST_DTYPES[entry["dtype"]])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{where}: corrupt safetensors header entry {entry!r}.") from None
        size = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_len or end - begin != size * dtype.itemsize:
            raise CheckpointError(
                f"{where}: corrupt safetensors header (offsets {begin}..{end} do not hold shape {list(shape)} "
                f"{dtype_name(dtype)} inside {data_len} data bytes)."
            )
        leaves.append(Leaf(array_row(path_s, shape, dtype), MemmapReader(path, data_start + begin, shape, dtype)))
    return _unique(leaves, where=path)


# ---------------------------------------------------------------------------- npz


class ZipStreamReader(ArrayReader):
    """A compressed npz member, decompressed front to back in bounded reads."""

    sequential = True

    def __init__(self, path: str, member: str, skip: int, shape: tuple[int, ...], dtype: np.dtype, fortran: bool):
        self._path, self._member, self._skip = path, member, skip
        self.shape = shape
        self.dtype = dtype
        self.c_order = not fortran

    def _stream(self, counts: Iterator[tuple[int, tuple[int, ...]]]) -> Iterator[np.ndarray]:
        with zipfile.ZipFile(self._path) as zf, zf.open(self._member) as f:
            f.read(self._skip)
            for count, shape in counts:
                want = count * self.dtype.itemsize
                buf = bytearray(want)
                view = memoryview(buf)
                got = 0
                while got < want:
                    n = f.readinto(view[got:])
                    if not n:
                        raise CheckpointError(f"{self._path}: npz member {self._member!r} is truncated.")
                    got += n
                yield np.frombuffer(buf, dtype=self.dtype).reshape(shape)

    def blocks(self, plan):
        if not self.c_order:
            raise CheckpointError(
                f"{self._path}: npz member {self._member!r} is Fortran-ordered and compressed, so it can only be "
                "streamed in storage order; re-save it with np.ascontiguousarray to compare values."
            )
        expected = 0

        def counts():
            nonlocal expected
            for index in plan:
                start, sizes = block_span(index, self.shape)
                if start != expected:
                    raise CheckpointError(f"{self._path}: blocks of {self._member!r} must be read front to back.")
                expected = start + math.prod(sizes)
                yield math.prod(sizes), sizes

        return self._stream(counts())

    def storage_blocks(self, max_bytes: int) -> Iterator[np.ndarray]:
        total = math.prod(self.shape)
        per = max(1, max_bytes // self.dtype.itemsize)
        return self._stream((min(per, total - a), (min(per, total - a),)) for a in range(0, total, per))


def _npy_header(f: Any, where: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:
            shape, fortran, dtype = fmt._read_array_header(f, version)  # 3.0 (utf-8 names): no public reader
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, SyntaxError) as e:
        raise CheckpointError(f"{where}: corrupt .npy header ({e}).") from None
    return tuple(int(d) for d in shape), bool(fortran), np.dtype(dtype), f.tell()


def _local_data_offset(fh: io.BufferedReader, info: zipfile.ZipInfo, where: str) -> int:
    """Where a stored (uncompressed) member's bytes begin in the zip file."""
    fh.seek(info.header_offset)
    local = fh.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{where}: corrupt zip local header.")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len


def read_npz(path: str) -> list[Leaf]:
    """Leaves of an ``.npz`` from each member's .npy header; array bytes are never read here.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "a.npz")
    >>> np.savez(f, **{"Dense_0/kernel": np.zeros((2, 3), np.float32)})
    >>> [(l.row.path, l.row.shape, l.row.params) for l in read_npz(f)]
    [('Dense_0/kernel', (2, 3), 6)]
    """
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated npz ({e}).") from None
    leaves = []
    with zf, open(path, "rb") as fh:
        for info in zf.infolist():
            if info.is_dir():
                continue
            where = f"{path}: member {info.filename!r}"
            if not info.filename.endswith(".npy"):
                raise CheckpointError(f"{where} is not a .npy array; not an npz checkpoint.")
            path_s = _leaf_path(info.filename[: -len(".npy")], where=path)
            try:
                with zf.open(info) as f:
                    shape, fortran, dtype, header_len = _npy_header(f, where)
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                raise CheckpointError(f"{where}: corrupt zip member ({e}).") from None
            if dtype.hasobject:
                leaves.append(Leaf(value_row(path_s)))
                continue
            size = math.prod(shape)
            if info.file_size != header_len + size * dtype.itemsize:
                raise CheckpointError(f"{where}: corrupt member ({info.file_size} bytes for shape {list(shape)} {dtype}).")
            row = array_row(path_s, shape, dtype)
            if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
                offset = _local_data_offset(fh, info, where) + header_len
                reader: ArrayReader = MemmapReader(path, offset, shape, dtype, fortran=fortran)
            else:
                reader = ZipStreamReader(path, info.filename, header_len, shape, dtype, fortran)
            leaves.append(Leaf(row, reader))
    return _unique(leaves, where=path)


# ---------------------------------------------------------------------------- Flax msgpack


def read_msgpack(path: str) -> list[Leaf]:
    """Leaves of a ``flax.serialization.to_bytes`` file (its arrays are materialized: msgpack has no index)."""
    from flax import serialization

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}).") from None
    try:
        tree = serialization.msgpack_restore(data)
    except Exception as e:  # msgpack raises ValueError, ExtraData, FormatError, TypeError...
        raise CheckpointError(f"{path}: corrupt or truncated Flax msgpack ({type(e).__name__}: {e}).") from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: not a Flax msgpack checkpoint (top level is {type(tree).__name__}, not a dict).")
    return tree_leaves(tree, where=path)
