"""AlphaFold 3's parameter file (``af3.bin.zst``), read without jax, haiku or alphafold3.

Written from the format's public source: google-deepmind/alphafold3,
``src/alphafold3/model/params.py`` at commit 37bff5f76e3fa79a6ea7dfad500bc66c8747fac6
(``encode_record``, ``_read_record``, ``read_records``, ``open_for_reading``,
``get_model_haiku_params``). The file is a zstd stream of records, back to back::

    header    struct '<5i': len(scope), len(name), len(dtype), len(shape), len(array bytes)
    scope     utf-8 (a haiku module path: ``diffuser/~/diffusion_head/...``)
    name      utf-8 (``weights``, ``scale``, ...)
    dtype     utf-8, ``str(arr.dtype)`` (``float32``, ``bfloat16``)
    shape     len(shape) x int32
    array     the C-order bytes, little-endian

and the loader builds ``params[scope][name] = array``: each record is the leaf
``<scope>/<name>`` (a later record of the same scope and name replaces the
earlier one, as the loader's dict does). Listing the leaves decompresses the
stream once, skipping array bytes; an array's data is read on request,
decompressing from the start of the stream up to it (a reader positioned past
it restarts; reading leaves in order, as every command does, is one pass).

Nothing a record declares is trusted beyond the bytes the stream holds: every
length is checked to be >= 0 and bounded, a dtype must be a plain number type
whose size times the shape is exactly the declared array length, the stream
must hold the whole record (else the file is truncated: one error), and the
stream may expand at most ``MAX_EXPANSION`` times the file's bytes (a zstd
"bomb" is refused, never decompressed to the end). zstd comes from the
``zstandard`` package (``pip install 'jax-treetools[af3]'``), the library the
loader uses; it is imported only when such a file is opened.

**Several files, one stream.** ``select_model_files`` also takes a model
folder and a model split into parts (``af3.0.bin.zst``, ``af3.1.bin.zst``...,
or ``af3.bin.zst.0``...; uncompressed ``af3.bin`` and ``af3.0.bin``), read
as one stream: the parts' bytes back to back (``_MultiFileIO``), decompressed
as a whole. PATH may be such a folder, any part (the whole set is read, with a
note), or the single file. Parts are put in the order of their numbers (the
loader sorts the paths as strings, the same order below 10 parts). An
uncompressed ``.bin`` is claimed only when its first record header parses.
"""

from __future__ import annotations

import io
import math
import os
import re
import struct
import threading
from typing import Any, Sequence

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.leaves import Leaf, array_row, check_name
from treetools.checkpoint_io.readers import FileReader, MemoryBudgetError, check_budget, checked_shape, is_numeric, np_dtype
from treetools.checkpoint_io.source import FileSource, Format, file_head
from treetools.shared.errors import CheckpointError
from treetools.shared.install import install_hint

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
SUFFIX = ".bin.zst"
HEADER = struct.Struct("<5i")
MAX_NAME_BYTES = 2**16
"""The longest scope, name or dtype a record may declare (real ones are tens of bytes)."""
MAX_RANK = 64
MAX_EXPANSION = 2**10
"""How many times its own size the stream may expand to: real parameters compress to about 0.9 of their size; a
stream that grows 1024-fold is a decompression bomb, refused."""
LEAF_COST = 1024
"""Bytes of memory one listed leaf holds (its row, reader and names), counted against the memory budget."""
_SKIP = 2**20
_WHAT = "AlphaFold 3 parameter file (a zstd stream of records)"


def _zstd() -> Any:
    try:  # only here: the library is needed for these files alone
        import zstandard
    except ImportError:
        raise CheckpointError(f"reading AlphaFold 3's .bin.zst parameters needs the zstandard package: "
                              f"{install_hint('af3')}.") from None
    return zstandard


class _Parts(io.RawIOBase):
    """The files of one model back to back, read forward as one file (the loader's ``_MultiFileIO``)."""

    def __init__(self, context: ReadContext, paths: Sequence[str]):
        self._context, self._paths = context, list(paths)
        self._index, self._file = 0, context.storage.open(self._paths[0], block_size=_SKIP)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while True:
            n = self._file.readinto(b)
            if n or self._index + 1 == len(self._paths):
                return n or 0
            self._file.close()
            self._index += 1
            self._file = self._context.storage.open(self._paths[self._index], block_size=_SKIP)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


class _Stream:
    """The (decompressed) stream of a model's files, read forward from a position; a read behind it starts over.

    One per model, shared by its leaves' readers (a lock keeps their reads whole).
    """

    def __init__(self, context: ReadContext, paths: Sequence[str], size: int, *, compressed: bool = True):
        self._context, self._paths, self._size, self._compressed = context, list(paths), size, compressed
        self._path = self._paths[0] if len(self._paths) == 1 else f"{self._paths[0]} (+{len(self._paths) - 1} parts)"
        self._lock = threading.Lock()
        self._file: Any = None
        self._reader: Any = None
        self.pos = 0

    def _restart(self) -> None:
        self.close()
        self._file = _Parts(self._context, self._paths)
        self._reader = (_zstd().ZstdDecompressor().stream_reader(io.BufferedReader(self._file, _SKIP),
                                                                 read_across_frames=True)
                        if self._compressed else self._file)
        self.pos = 0

    def close(self) -> None:
        for handle in (self._reader, self._file):
            if handle is not None:
                handle.close()
        self._reader = self._file = None

    def _read_into(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            try:
                n = self._reader.readinto(view[got:])
            except Exception as e:  # zstandard.ZstdError: corrupt or truncated compressed data
                raise CheckpointError(f"{self._path}: corrupt {_WHAT}: zstd could not decompress it ({e}).") from None
            if not n:
                break
            got += n
            self.pos += n
            self._check_expansion()
        return got

    def _check_expansion(self) -> None:
        if self._compressed and self.pos > MAX_EXPANSION * max(self._size, _SKIP):
            raise CheckpointError(
                f"{self._path}: the {self._size:,}-byte file decompresses to over {self.pos:,} bytes (more than "
                f"{MAX_EXPANSION} times its size): not AlphaFold 3 parameters but a decompression bomb; refusing it.")

    def skip(self, count: int) -> int:
        """Move ``count`` bytes forward; the bytes skipped (fewer at the end of the stream)."""
        buf = memoryview(bytearray(min(count, _SKIP)))
        done = 0
        while done < count:
            n = self._read_into(buf[:min(len(buf), count - done)])
            if not n:
                break
            done += n
        return done

    def read(self, count: int) -> bytes:
        buf = bytearray(count)
        return bytes(buf[:self._read_into(memoryview(buf))])

    def read_into(self, view: memoryview, pos: int) -> int:
        """Bytes ``pos:pos+len(view)`` of the decompressed stream into ``view``; the count read."""
        with self._lock:
            if self._reader is None or pos < self.pos:
                self._restart()
            if self.skip(pos - self.pos) < pos - self.pos:
                return 0
            return self._read_into(view)

    def __enter__(self) -> "_Stream":
        self._restart()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _RecordReader(FileReader):
    """One record's array, read from the decompressed stream (``FileReader``'s blocks, over ``_Stream``)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: _Stream, context: ReadContext, path: str, offset: int, shape: Sequence[int],
                 dtype: np.dtype):
        super().__init__(context, path, offset, shape, dtype)
        self._stream = stream

    def _fill(self, view: memoryview, pos: int) -> int:
        return self._stream.read_into(view, pos)


def _text(data: bytes, where: str, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: corrupt {_WHAT}: the {what} is not UTF-8 text.") from None


def read_af3(context: ReadContext, path: str | Sequence[str], *, compressed: bool = True) -> list[Leaf]:
    """The leaves of an AlphaFold 3 parameter file (or of its parts, one stream), ``<scope>/<name>``, from the
    record headers (array bytes are skipped, not kept). tests/test_format_af3.py writes such files with the
    loader's own ``encode_record`` layout and ``zstandard`` (no example here: the package is an optional extra).
    """
    storage = context.storage
    paths = [path] if isinstance(path, str) else list(path)
    try:
        size = sum(storage.getsize(p) for p in paths)
    except OSError as e:
        raise CheckpointError(f"{e.filename or paths[0]}: cannot read ({e.strerror or e}).") from None
    stream = _Stream(context, paths, size, compressed=compressed)
    path = stream._path
    found: dict[tuple[str, str], Leaf] = {}
    index = 0
    with stream:
        while True:
            where = f"{path}: record {index} (byte {stream.pos:,} of the decompressed stream)"
            header = stream.read(HEADER.size)
            if not header:
                break
            if len(header) < HEADER.size:
                raise CheckpointError(f"{where}: truncated {_WHAT}: the stream ends inside a record's header.")
            lengths = HEADER.unpack(header)
            scope_len, name_len, dtype_len, rank, nbytes = lengths
            if min(lengths) < 0 or max(scope_len, name_len, dtype_len) > MAX_NAME_BYTES or rank > MAX_RANK:
                raise CheckpointError(f"{where}: corrupt {_WHAT}: impossible lengths {list(lengths)} (scope, name, "
                                      "dtype, rank, array bytes).")
            head_len = scope_len + name_len + dtype_len + 4 * rank
            head = stream.read(head_len)
            if len(head) < head_len:
                raise CheckpointError(f"{where}: truncated {_WHAT}: the stream ends inside a record's names.")
            scope = _text(head[:scope_len], where, "scope")
            name = _text(head[scope_len:scope_len + name_len], where, "name")
            dtype_name = _text(head[scope_len + name_len:scope_len + name_len + dtype_len], where, "dtype")
            dims = struct.unpack(f"<{rank}i", head[scope_len + name_len + dtype_len:])
            for part in (scope, name):
                check_name(part, where=where)
            leaf_where = f"{path}: `{scope}/{name}`"
            try:
                dtype = np_dtype(dtype_name)
            except (TypeError, ValueError) as e:  # ValueError: numpy's own refusal of "(1073741824,)f8"
                raise CheckpointError(f"{leaf_where}: corrupt {_WHAT}: dtype {dtype_name[:40]!r}: {e}.") from None
            if dtype.hasobject or not is_numeric(dtype):
                raise CheckpointError(f"{leaf_where}: corrupt {_WHAT}: dtype {dtype_name[:40]!r} is not a number type.")
            dtype = dtype.newbyteorder("<") if dtype.byteorder not in ("|", "<") else dtype
            shape = checked_shape(list(dims), where=leaf_where, itemsize=dtype.itemsize)
            if math.prod(shape) * dtype.itemsize != nbytes:
                raise CheckpointError(
                    f"{leaf_where}: corrupt {_WHAT}: {dtype_name}{list(shape)} is {math.prod(shape) * dtype.itemsize:,} "
                    f"bytes but the record declares {nbytes:,}.")
            offset = stream.pos
            if stream.skip(nbytes) < nbytes:
                raise CheckpointError(
                    f"{leaf_where}: truncated {_WHAT}: the record declares {nbytes:,} array bytes from byte "
                    f"{offset:,}, but the stream ends at byte {stream.pos:,}; the download or copy was cut short.")
            found.pop((scope, name), None)  # the loader's dict: a later record replaces an earlier one
            found[(scope, name)] = Leaf(array_row((scope, name), shape, dtype),
                                        _RecordReader(stream, context, paths[0], offset, shape, dtype))
            index += 1
            check_budget(len(found) * LEAF_COST, where=path, what=f"the list of its {len(found):,} records",
                         budget=context.memory_budget)
    if not found:
        raise CheckpointError(f"{path}: an empty {_WHAT}: it holds no record.")
    return list(found.values())


PATTERNS = (  # the loader's select_model_files, in its order: (pattern, compressed)
    (re.compile(r"(?P<model>.*)\.(?P<part>[0-9]+)\.bin\.zst"), True),
    (re.compile(r"(?P<model>.*)\.bin\.zst\.(?P<part>[0-9]+)"), True),
    (re.compile(r"(?P<model>.*)\.(?P<part>[0-9]+)\.bin"), False),
    (re.compile(r"(?P<model>.*)\.bin\.zst"), True),
    (re.compile(r"(?P<model>.*)\.bin"), False),
)


def _model_files(storage: Any, folder: str, names: Sequence[str], want: str | None = None
                 ) -> tuple[list[str], bool] | None:
    """The files of the model in ``folder`` (the one named ``want``, else the only one), in part order, and
    whether they are compressed; None when none matches. Several models in one folder: an error, as the loader's."""
    for pattern, compressed in PATTERNS:
        models: dict[str, list[tuple[int, str]]] = {}
        for name in names:
            match = pattern.fullmatch(name)
            if match:
                part = int(match.group("part")) if "part" in pattern.groupindex else 0
                models.setdefault(match.group("model"), []).append((part, name))
        if want is not None:
            models = {k: v for k, v in models.items() if k == want}
        models = {k: v for k, v in models.items()  # positive evidence in each model's first part
                  if _starts_like(storage, os.path.join(folder, min(v)[1]), compressed)}
        if len(models) > 1:
            raise CheckpointError(f"{folder or '.'}: holds several AlphaFold 3 models ({', '.join(sorted(models))}); "
                                  "give PATH as one of their files.")
        if models:
            (parts,) = models.values()
            return [os.path.join(folder, name) for _, name in sorted(parts)], compressed
    return None


def _starts_like(storage: Any, path: str, compressed: bool) -> bool:
    """Positive evidence: zstd's magic, or (uncompressed) a first record header that parses."""
    head = file_head(storage, path, HEADER.size + 3 * MAX_NAME_BYTES // 256)
    if compressed:
        return head[:len(ZSTD_MAGIC)] == ZSTD_MAGIC
    if len(head) < HEADER.size:
        return False
    scope_len, name_len, dtype_len, rank, nbytes = HEADER.unpack(head[:HEADER.size])
    if not (0 < scope_len <= 256 and 0 < name_len <= 64 and 0 < dtype_len <= 16 and 0 <= rank <= 8 and nbytes >= 0):
        return False
    names = head[HEADER.size:HEADER.size + scope_len + name_len + dtype_len]
    try:
        np_dtype(names[scope_len + name_len:].decode("ascii"))
        names.decode("utf-8")
    except (UnicodeDecodeError, TypeError, ValueError):
        return False
    return True


def _select(location: str, context: ReadContext) -> tuple[list[str], bool, str | None] | None:
    """What PATH reads: its model's files, compressed or not, and a note when PATH is a folder or one part."""
    storage = context.storage
    if storage.isdir(location):
        try:
            names = [n for n in sorted(storage.listdir(location)) if storage.isfile(os.path.join(location, n))]
        except OSError:
            return None
        found = _model_files(storage, location, names)
        if found is None:
            return None
        return found[0], found[1], f"read the AlphaFold 3 model {', '.join(os.path.basename(p) for p in found[0])}"
    base, folder = os.path.basename(location), os.path.dirname(location)
    for pattern, compressed in PATTERNS:
        match = pattern.fullmatch(base)
        if not match:
            continue
        if "part" not in pattern.groupindex:
            return ([location], compressed, None) if _starts_like(storage, location, compressed) else None
        names = [n for n in sorted(storage.listdir(folder or ".")) if storage.isfile(os.path.join(folder, n))]
        found = _model_files(storage, folder, names, want=match.group("model"))
        if found is None or location not in found[0]:  # a part whose first part is not AlphaFold 3's
            return None
        return found[0], compressed, (f"{base} is part {match.group('part')} of a model in {len(found[0])} parts; "
                                      f"read them all, as one stream")
    return None


def _claims(location: str, context: ReadContext) -> bool:
    try:
        return _select(location, context) is not None
    except CheckpointError:
        return True  # several models in one folder: claimed, so that opening it says so


def _open(location: str, display: str, context: ReadContext) -> FileSource:
    selected = _select(location, context)
    if selected is None:
        raise CheckpointError(f"{display}: no AlphaFold 3 parameter file (af3.bin.zst, af3.N.bin.zst...) here.")
    paths, compressed, note = selected
    try:
        leaves = read_af3(context, paths, compressed=compressed)
    except MemoryBudgetError:
        raise
    except CheckpointError as e:  # name the path as typed
        raise CheckpointError(str(e).replace(location, display, 1)) from None
    return FileSource(display, context, "af3", leaves, notes=[f"{display}: {note}."] if note else [])


FORMAT = Format(
    name="af3",
    priority=37,
    claims=_claims,
    open=_open,
    description="an AlphaFold 3 parameter file (af3.bin.zst: a zstd stream of scope/name array records)",
)
