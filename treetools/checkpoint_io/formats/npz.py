"""``.npz`` archives (``numpy.savez``): leaves from each member's .npy header; array bytes on request.

A stored (uncompressed) member is mapped a block at a time; a compressed one is
streamed front to back. Member names are kept as stored (``Dense_0/kernel``).
A member stored as 2-byte void (``<V2``: how numpy writes bfloat16) reads as bfloat16.
"""

from __future__ import annotations

import dataclasses
import io
import math
import struct
import zipfile
from typing import Any, Iterator

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.diagnose import TORCH_SUFFIXES, is_torch_zip
from treetools.checkpoint_io.leaves import Leaf, array_row, check_name, stored_path, value_row
from treetools.checkpoint_io.readers import (ArrayReader, FileReader, SequentialReader, block_span, check_budget,
                                             checked_shape, np_dtype)
from treetools.checkpoint_io.source import file_head, FileSource, Format
from treetools.shared.errors import CheckpointError


class ZipStreamReader(SequentialReader):
    """A compressed npz member, decompressed front to back in bounded reads."""

    def __init__(self, context: ReadContext, path: str, member: str, skip: int, shape: tuple[int, ...],
                 dtype: np.dtype, fortran: bool):
        self.context: ReadContext = context  # always given: read through its checkpoint's storage
        self._path, self._member, self._skip = path, member, skip
        self.shape = shape
        self.dtype = dtype
        self.c_order = not fortran

    def _stream(self, counts: Iterator[tuple[int, tuple[int, ...]]]) -> Iterator[np.ndarray]:
        import zlib

        try:
            yield from self._stream_unchecked(counts)
        except (zlib.error, zipfile.BadZipFile, EOFError, OSError) as e:
            raise CheckpointError(f"{self._path}: npz member {self._member!r} is corrupt ({e}).") from None
        except RuntimeError as e:  # zipfile: an encrypted member needs a password
            raise CheckpointError(f"{self._path}: npz member {self._member!r} cannot be read ({e}).") from None
        except NotImplementedError as e:  # zipfile: a compression method it does not support
            raise CheckpointError(f"{self._path}: npz member {self._member!r} uses an unsupported compression ({e}).") from None

    def _stream_unchecked(self, counts: Iterator[tuple[int, tuple[int, ...]]]) -> Iterator[np.ndarray]:
        storage = self.context.storage
        with storage.open(self._path, block_size=8 * 2**20) as raw, zipfile.ZipFile(raw) as zf, zf.open(self._member) as f:
            f.read(self._skip)
            for count, shape in counts:
                want = count * self.dtype.itemsize
                buf = bytearray(want)
                view = memoryview(buf)
                got = 0
                while got < want:
                    n = f.readinto(view[got:])  # type: ignore[attr-defined]  # a ZipExtFile; typeshed says IO[bytes]
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


def npy_dtype(dtype: np.dtype) -> np.dtype:
    """A ``.npy`` header's dtype; 2-byte void is bfloat16, as numpy writes an ``ml_dtypes.bfloat16`` array
    (``np.save``, ``jnp.save``, ``np.savez``) and ``jnp.load`` reads it back.

    >>> npy_dtype(np.dtype("V2")).name, npy_dtype(np.dtype("<f4")).name
    ('bfloat16', 'float32')
    """
    if dtype.kind == "V" and dtype.itemsize == 2 and dtype.fields is None and dtype.subdtype is None:
        return np_dtype("bfloat16")
    return dtype


FLOAT0 = np.dtype([("float0", "V")])
"""jax's ``float0`` (the gradient of an integer input), as numpy saves it: the one structured dtype a header may hold."""


class NpyHeaderError(CheckpointError):
    """A ``.npy`` header that does not parse (a stream cut inside its header raises this too)."""


def npy_header(f: Any, where: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """``(shape, fortran_order, dtype, data offset)`` of the ``.npy`` stream at ``f``'s position (parsed as numpy
    parses it: a literal, never evaluated), validated where it is parsed: the shape a list of integers >= 0 whose
    size fits (``checked_shape``), the dtype a plain element type of a positive size.

    Raises:
      NpyHeaderError: a header that does not parse (or is cut short).
      CheckpointError: a structured or zero-byte dtype, a negative or overflowing shape.

    >>> import io
    >>> buf = io.BytesIO(); np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False,
    ...                                                                "shape": (-128,)}); _ = buf.seek(0)
    >>> npy_header(buf, "m.eqx: leaf 0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    treetools.shared.errors.CheckpointError: m.eqx: leaf 0: corrupt shape (entry 0 is -128, not an integer >= 0); ...
    """
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:
            # 3.0 (utf-8 names): no public reader
            shape, fortran, dtype = fmt._read_array_header(f, version)  # type: ignore[attr-defined]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, SyntaxError, TypeError) as e:
        raise NpyHeaderError(f"{where}: corrupt .npy header ({str(e)[:200]}).") from None
    dtype = np.dtype(dtype)
    if dtype == FLOAT0:  # jax's gradients of integer inputs: a value of no bytes, read as it is stored
        return checked_shape(list(shape), where=where), bool(fortran), dtype, f.tell()
    if dtype.fields is not None or dtype.subdtype is not None:
        raise CheckpointError(f"{where}: a structured .npy dtype ({str(dtype)[:80]}); treetools reads arrays of plain "
                              "elements only.")
    if not dtype.itemsize:  # |V0, |S0, <U0: any count of elements in no bytes
        raise CheckpointError(f"{where}: a .npy dtype of zero bytes per element ({dtype.str}); the header is corrupt "
                              "or hostile.")
    dtype = npy_dtype(dtype)
    # numpy's parser takes any integers: a negative dimension made a reader loop, 2^70 overflow its arithmetic.
    return checked_shape(list(shape), where=where, itemsize=dtype.itemsize), bool(fortran), dtype, f.tell()


def _local_data_offset(fh: io.BufferedReader, info: zipfile.ZipInfo, where: str) -> int:
    """Where a stored (uncompressed) member's bytes begin in the zip file."""
    fh.seek(info.header_offset)
    local = fh.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{where}: corrupt zip local header.")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len


def read_npz(context: ReadContext, path: str) -> list[Leaf]:
    """Leaves of an ``.npz`` from each member's .npy header; array bytes are never read here.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "a.npz")
    >>> np.savez(f, **{"Dense_0/kernel": np.zeros((2, 3), np.float32)})
    >>> [(l.name, l.row.shape, l.row.params) for l in read_npz(ReadContext().confined_to(f), f)]
    [('Dense_0/kernel', (2, 3), 6)]
    """
    fh = context.storage.open(path)
    try:
        zf = zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, OSError, EOFError, UnicodeDecodeError) as e:  # a name flagged UTF-8 that is not
        fh.close()
        raise CheckpointError(f"{path}: corrupt or truncated npz ({str(e)[:200]}).") from None
    leaves = []
    seen: set[str] = set()
    with zf, fh:
        for info in zf.infolist():
            if info.is_dir():
                continue
            where = f"{path}: member {info.filename!r}"
            if info.filename in seen:  # numpy.load and zipfile give the last one; a reader by name could not tell
                raise CheckpointError(f"{where} appears twice in the archive; the npz is corrupt or hostile.")
            seen.add(info.filename)
            if not info.filename.endswith(".npy"):
                raise CheckpointError(f"{where} is not a .npy array; not an npz checkpoint.")
            name = info.filename[: -len(".npy")]
            check_name(name, where=path)
            parts, sep = stored_path(name)
            try:
                with zf.open(info) as f:
                    shape, fortran, dtype, header_len = npy_header(f, where)
            except (zipfile.BadZipFile, OSError, EOFError, RuntimeError, NotImplementedError) as e:
                raise CheckpointError(f"{where}: cannot read this zip member ({e}).") from None
            if dtype.hasobject:
                leaves.append(Leaf(value_row(parts, sep=sep), key=name))
                continue
            size = math.prod(shape)
            if info.file_size != header_len + size * dtype.itemsize:
                raise CheckpointError(f"{where}: corrupt member ({info.file_size} bytes for shape {list(shape)} {dtype}).")
            row = array_row(parts, shape, dtype, sep=sep)
            if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
                offset = _local_data_offset(fh, info, where) + header_len
                reader: ArrayReader = FileReader(context, path, offset, shape, dtype, fortran=fortran)
            else:
                reader = ZipStreamReader(context, path, info.filename, header_len, shape, dtype, fortran)
            leaves.append(Leaf(row, reader, key=name))
    return leaves


NAMES_MEMBER = "names"
"""objax's ``save_var_collection`` (``objax.io.Checkpoint``): a ``names`` array and members ``0`` .. ``N-1``."""


def apply_names(leaves: list[Leaf], where: str, budget: float) -> tuple[list[Leaf], list[str]]:
    """An npz that stores its names apart (objax: ``np.savez(file, names=np.array(names), **{"0": ..., ...})``):
    member ``i`` is the variable ``names[i]`` (``(Sequential)[0](Linear).w``, kept as stored), and ``names`` is no
    parameter. Any other npz comes back as it is (haiku's ``scope/sub//param`` keys included). Also the notes."""
    by_key = {leaf.key: leaf for leaf in leaves}
    names_leaf = by_key.get(NAMES_MEMBER)
    names_shape = names_leaf.row.shape if names_leaf is not None else None
    if names_leaf is None or names_leaf.reader is None or names_shape is None or len(names_shape) != 1:
        return leaves, []
    if np.dtype(names_leaf.reader.dtype).kind not in "US":
        return leaves, []
    count = names_shape[0]
    if set(by_key) != {NAMES_MEMBER, *map(str, range(count))}:
        return leaves, []
    check_budget(np.dtype(names_leaf.reader.dtype).itemsize * count, where=where, what="the `names` array",
                 budget=budget)
    names = [str(n) for n in names_leaf.reader.read_all().tolist()]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{where}: the `names` array names one variable twice; not an objax checkpoint.")
    out = []
    for i, name in enumerate(names):
        check_name(name, where=where)
        parts, sep = stored_path(name)
        leaf = by_key[str(i)]
        out.append(dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=parts, sep=sep)))
    return out, [f"{where}: member `names` names the arrays `0`..`{count - 1}` (objax's save_var_collection): "
                 "read under those names."]


def _open(location: str, display: str, context: ReadContext) -> FileSource:
    leaves, notes = apply_names(read_npz(context, location), display, context.memory_budget)
    return FileSource(display, context, "npz", leaves, notes=notes)


def _claims(path: str, context: ReadContext) -> bool:
    head = file_head(context.storage, path, 4)
    if head in (b"PK\x03\x04", b"PK\x05\x06"):
        # A zip named like torch.save's output (pytorch_model.bin, *.pt) is torch's when it holds data.pkl.
        return not (path.lower().endswith(TORCH_SUFFIXES) and is_torch_zip(path, context.storage))
    return path.lower().endswith(".npz") and bool(head)


FORMAT = Format(
    name="npz",
    priority=30,
    claims=_claims,
    open=_open,
    description="an .npz file from numpy.savez",
)
