"""Flax's msgpack encoding, walked once from the file: the structure decoded, every array left where it lies.

Not a format (its name starts with ``_``): ``msgpack.py`` (Flax msgpack files,
and through it Flax's legacy checkpoint folders and Hugging Face sharded Flax
msgpack) and ``t5x.py`` (the ``checkpoint`` msgpack of T5X and of Orbax before
0.5) read their files with ``walk``.

``flax.serialization.msgpack_serialize`` writes a state dict as msgpack maps
(lists as arrays) with three ext types: 1 an ndarray, 2 a Python complex, 3 a
numpy scalar. An ndarray's ext payload is itself msgpack, ``[shape, dtype
name, raw C-order bytes]``, and an array over 1 GiB is split into flat chunks,
``{"__msgpack_chunked_array__": True, "shape": {"0": d0, ...}, "chunks": {"0":
flat array, ...}}``. msgpack has no index, so the file is walked front to back
once, following msgpack's format spec: headers are decoded, and each array's
payload is skipped, its offset kept. Arrays come back as ``FileReader``s that
read blocks from those offsets (as safetensors tensors are read): no copy of
the file, no ``msgpack.unpackb`` of a payload, memory within the budget's
blocks, and metadata of a large file without reading its arrays. Scalars,
strings and other small values are decoded as ``msgpack.unpackb(raw=False)``
would.

The walk is iterative (no recursion per level) and refuses a hostile file with
one ``CheckpointError`` line: a truncated file, a length past its end, a byte
msgpack never uses, nesting deeper than ``MAX_DEPTH`` (msgpack's own unpacker
stops at 1024), or more structure than the memory budget holds.
"""

from __future__ import annotations

import collections
import math
import struct
from typing import Any, Callable

import numpy as np

from treetools.checkpoint_io.context import DEFAULT_MEMORY_BUDGET, ReadContext
from treetools.checkpoint_io.readers import MAX_ARRAY_BYTES, FileReader, check_budget, np_dtype
from treetools.shared.errors import CheckpointError

MAX_DEPTH = 1024
"""Nesting deeper than this is refused (msgpack's own C unpacker refuses it too)."""

CHUNKED = "__msgpack_chunked_array__"
"""The marker of an array flax split into flat chunks (``flax.serialization._chunk``)."""

ExtType = collections.namedtuple("ExtType", "code data")
"""An ext value of a type Flax does not define, kept as ``msgpack.ExtType`` keeps it."""

_READ = 64 * 2**10  # bytes read at a time for headers: small values come with the header around them
_OBJECT_BYTES = 64  # about what one decoded value costs in Python, held to the memory budget
_LEAF_BYTES = 768
"""What one leaf (a value that is no map or list, and no map key) costs the command that shows it, held to the
budget as it is decoded: its ``Leaf`` and ``Row``, its reader, its entry in the JSON output (measured: 250,000
one-byte arrays in a 2 MB file grew ``inspect --format json`` by 156 MiB, about 650 bytes a leaf; a 1.3 MB file
of them held 188 MB against a 16 MB budget)."""
_NOTHING = object()
_INTS = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_LENGTH = {1: ">B", 2: ">H", 4: ">I"}
_NUMBERS = {0xCA: ">f", 0xCB: ">d", **_INTS}
_SIZED = {**{0xC4 + k: ("bin", 1 << k) for k in range(3)}, **{0xD9 + k: ("str", 1 << k) for k in range(3)},
          **{0xDC + k: ("array", 2 << k) for k in range(2)}, **{0xDE + k: ("map", 2 << k) for k in range(2)}}
"""Headers followed by a length: ``header byte -> (kind, bytes of the length)``."""


class MsgpackError(CheckpointError):
    """A file that is not well-formed Flax msgpack; ``reason`` says what was found at byte ``offset``.

    Constructed from its one-line message alone too (``open_source`` re-raises errors with the path as typed).
    """

    def __init__(self, message: str, *, offset: int = -1, reason: str = ""):
        super().__init__(message)
        self.offset, self.reason = offset, reason

    @classmethod
    def at(cls, where: str, offset: int, reason: str) -> "MsgpackError":
        return cls(f"{where}: corrupt or truncated Flax msgpack at byte {offset:,} ({reason}).", offset=offset,
                   reason=reason)


class _Cursor:
    """A position in the file and a small window of bytes read around it (``_READ`` at a time)."""

    def __init__(self, f: Any, size: int, where: str, data: bytes = b""):
        self.f, self.size, self.where = f, size, where
        self.buf, self.base, self.i = data, 0, 0

    def pos(self) -> int:
        return self.base + self.i

    def corrupt(self, what: str, at: int | None = None) -> MsgpackError:
        return MsgpackError.at(self.where, self.pos() if at is None else at, what)

    def need(self, n: int) -> int:
        """Make ``n`` bytes from here readable; their index in ``self.buf``; the position moves past them."""
        if self.i + n <= len(self.buf):
            self.i += n
            return self.i - n
        start = self.pos()
        if start + n > self.size or self.f is None:
            raise self.corrupt(f"{n:,} bytes needed, the file ends at byte {self.size:,}")
        try:
            self.f.seek(start)
            data = self.f.read(max(n, _READ))
        except OSError as e:
            raise CheckpointError(f"{self.where}: cannot read ({e.strerror or e}).") from None
        if len(data) < n:
            raise self.corrupt("the file ended early; it is truncated, or changed while being read")
        self.buf, self.base, self.i = data, start, n
        return 0

    def unpack(self, fmt: str, n: int) -> Any:
        j = self.need(n)  # first: it may read a new window into self.buf
        return struct.unpack_from(fmt, self.buf, j)[0]

    def byte(self) -> int:
        j = self.need(1)
        return self.buf[j]

    def take(self, n: int) -> bytes:
        j = self.need(n)
        return bytes(self.buf[j:j + n])

    def skip(self, n: int) -> None:
        end = self.pos() + n
        if end > self.size:
            raise self.corrupt(f"{n:,} bytes of data promised, the file ends at byte {self.size:,}")
        if self.i + n <= len(self.buf):
            self.i += n
        else:
            self.buf, self.base, self.i = b"", end, 0


class _Walker:
    """Decodes one msgpack object front to back; arrays become ``FileReader``s at their offsets."""

    def __init__(self, cur: _Cursor, path: str, context: ReadContext | None,
                 object_hook: Callable[[dict], Any] | None):
        self.cur, self.path, self.context, self.object_hook = cur, path, context, object_hook
        self.held = 0  # bytes of Python objects and values decoded so far (estimated), held to the budget
        self.limit = context.memory_budget if context is not None else DEFAULT_MEMORY_BUDGET

    def hold(self, nbytes: int, what: str) -> None:
        self.held += nbytes
        if self.held > self.limit:  # compared here first: this runs for every map and list
            check_budget(self.held, where=self.cur.where, what=what, budget=self.limit)

    def _context(self) -> ReadContext:
        if self.context is None:  # walk_bytes: bytes in memory name no file to read an array from
            raise self.cur.corrupt("an array in msgpack data held in memory")
        return self.context

    def header(self) -> tuple[str, Any]:
        """One msgpack header: ``("value", v)`` for a scalar or string, ``("map"|"array", n)``,
        ``("bin", n)`` (payload not read) or ``("ext", (code, n))`` (payload not read)."""
        cur = self.cur
        i = cur.i
        if i < len(cur.buf):  # the common case, inline: the header's first byte is in the window
            b = cur.buf[i]
            cur.i = i + 1
        else:
            b = cur.byte()
        if b <= 0x7F:
            return "value", b
        if b >= 0xE0:
            return "value", b - 0x100
        if b <= 0x8F:
            return "map", b & 0x0F
        if b <= 0x9F:
            return "array", b & 0x0F
        if b <= 0xBF:
            return "value", self.text(b & 0x1F)
        return self._typed_header(b)

    def _typed_header(self, b: int) -> tuple[str, Any]:
        """``header`` of the first bytes 0xc0-0xdf: nil, booleans, numbers, and what a length or a size follows."""
        cur = self.cur
        if b == 0xC0:
            return "value", None
        if b in (0xC2, 0xC3):
            return "value", b == 0xC3
        if b in _NUMBERS:
            fmt = _NUMBERS[b]
            return "value", cur.unpack(fmt, struct.calcsize(fmt))
        if b in _SIZED:
            kind, width = _SIZED[b]
            n = cur.unpack(_LENGTH[width], width)
            return ("value", self.text(n)) if kind == "str" else (kind, n)
        if b in (0xC7, 0xC8, 0xC9):
            n = cur.unpack(_LENGTH[1 << (b - 0xC7)], 1 << (b - 0xC7))
            return "ext", (cur.unpack(">b", 1), n)
        if 0xD4 <= b <= 0xD8:
            return "ext", (cur.unpack(">b", 1), 1 << (b - 0xD4))
        raise cur.corrupt("byte 0xc1, which msgpack never uses", cur.pos() - 1)

    def walk_value(self, kind: str, v: Any) -> Any:
        """The value whose header ``(kind, v)`` was just read: a scalar or string as is; a map or array walked."""
        if kind == "value":
            return v
        if kind == "ext":
            return self.ext(*v)
        raise self.cur.corrupt(f"a record value that is a {kind}, not the bytes of a msgpack value")

    def past_end(self, n: int) -> None:
        """Refuse a length that runs past the end of the file before anything is held for it."""
        if self.cur.pos() + n > self.cur.size:
            raise self.cur.corrupt(f"{n:,} bytes needed, the file ends at byte {self.cur.size:,}")

    def text(self, n: int) -> str:
        cur = self.cur
        i = cur.i
        if i + n <= len(cur.buf):  # the common case, inline: a short key within the window
            cur.i = i + n
            try:
                return cur.buf[i:i + n].decode("utf-8")
            except UnicodeDecodeError:
                raise cur.corrupt("a string that is not UTF-8") from None
        self.past_end(n)
        if n > _READ:
            self.hold(n, "a string in this Flax msgpack")
        raw = self.cur.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.cur.corrupt("a string that is not UTF-8") from None

    def blob(self, n: int, what: str) -> bytes:
        self.past_end(n)
        if n > _READ:
            self.hold(n, what)
        return self.cur.take(n)

    def walk(self, *, whole: bool = True) -> Any:
        """The whole object: dicts, lists, scalars, strings; arrays as ``FileReader``s.

        ``whole``: the object must end where the data ends (else one object is read and the cursor left after it:
        a record of a stream)."""
        cur = self.cur
        stack: list[list[Any]] = []  # [container, entries left, is a map, pending key]
        while True:
            kind, v = self.header()
            if kind in ("map", "array"):
                if self._open(kind, v, stack):
                    continue
                value = self.finish({}) if kind == "map" else []
            elif kind == "bin":
                value = self.blob(v, "a byte string in this Flax msgpack")
            elif kind == "ext":
                value = self.ext(*v)
            else:
                value = v
            if not (stack and stack[-1][2] and stack[-1][3] is _NOTHING):  # a leaf, not a map key
                self.hold(_LEAF_BYTES, "the structure of this Flax msgpack")
            done = self._hand(value, stack)
            if done is not _NOTHING:
                if whole and cur.pos() != cur.size:
                    raise cur.corrupt(f"{cur.size - cur.pos():,} bytes of extra data after the object")
                return done

    def _open(self, kind: str, n: int, stack: list[list[Any]]) -> bool:
        """A ``map``/``array`` header of ``n`` entries: opened on ``stack`` (True), or False when it is empty."""
        cur = self.cur
        if n * (2 if kind == "map" else 1) > cur.size - cur.pos():  # each entry takes a byte at least
            raise cur.corrupt(f"a {kind} of {n:,} entries in {cur.size - cur.pos():,} bytes")
        self.hold(n * _OBJECT_BYTES, "the structure of this Flax msgpack")
        if not n:
            return False
        if len(stack) >= MAX_DEPTH:
            raise cur.corrupt(f"nested more than {MAX_DEPTH} levels deep")
        stack.append([{} if kind == "map" else [], n, kind == "map", _NOTHING])
        return True

    def _hand(self, value: Any, stack: list[list[Any]]) -> Any:
        """Hand ``value`` to the open containers on ``stack``, closing those it completes: the whole object once
        the outermost closes (or ``value`` itself when none is open), else ``_NOTHING``."""
        while stack:
            frame = stack[-1]
            if frame[2] and frame[3] is _NOTHING:
                if not (value is None or isinstance(value, (str, int, float, bytes))):
                    raise self.cur.corrupt(f"a map key that is a {type(value).__name__}")
                frame[3] = value
                return _NOTHING
            if frame[2]:
                frame[0][frame[3]] = value
                frame[3] = _NOTHING
            else:
                frame[0].append(value)
            frame[1] -= 1
            if frame[1]:
                return _NOTHING
            stack.pop()
            value = self.finish(frame[0]) if frame[2] else frame[0]
        return value

    def finish(self, node: dict) -> Any:
        """A map once decoded: a chunked big array becomes one array; then the caller's hook."""
        value: Any = self.unchunk(node) if node.get(CHUNKED) is True else node
        return self.object_hook(value) if self.object_hook is not None and isinstance(value, dict) else value

    def unchunk(self, node: dict) -> FileReader:
        shape_d: Any = node.get("shape")  # a missing one fails below as a wrong one does
        chunks_d: Any = node.get("chunks")
        try:
            shape = tuple(int(shape_d[str(i)]) for i in range(len(shape_d)))
            chunks = [chunks_d[str(i)] for i in range(len(chunks_d))]
        except (KeyError, TypeError, ValueError):
            raise self.cur.corrupt("a chunked array without its numbered shape and chunks") from None
        if not chunks or not all(isinstance(c, FileReader) and len(c.shape) == 1 for c in chunks):
            raise self.cur.corrupt("a chunked array whose chunks are not flat arrays")
        dtype = chunks[0].dtype
        if any(c.dtype != dtype for c in chunks) or any(d < 0 for d in shape) or sum(
                c.shape[0] for c in chunks) != math.prod(shape):
            raise self.cur.corrupt(f"a chunked array whose chunks do not make its shape {list(shape)}")
        self.indexable(shape, dtype)
        segments = [s for c in chunks for s in c.segments]
        return FileReader(self._context(), self.path, segments[0][0], shape, dtype, segments=segments)

    def ext(self, code: int, n: int) -> Any:
        cur = self.cur
        end = cur.pos() + n
        if end > cur.size:
            raise cur.corrupt(f"an ext value of {n:,} bytes past the end of the file")
        if code not in (1, 3):
            data = self.blob(n, "an ext value in this Flax msgpack")
            if code != 2:
                return ExtType(code, data)
            try:
                real, imag = walk_bytes(data, where=cur.where)
                return complex(real, imag)
            except (CheckpointError, TypeError, ValueError):
                raise cur.corrupt("a complex number that is not a pair of numbers") from None
        offset, shape, dtype = self.ndarray(end)
        if code == 1:
            self.cur.skip(end - offset)
            return FileReader(self._context(), self.path, offset, shape, dtype)
        # A numpy scalar (flax packs np.generic as a 0-d array): small, decoded here as flax does.
        data = self.blob(end - offset, "a numpy scalar in this Flax msgpack")
        return np.frombuffer(data, dtype=dtype).reshape(shape)[()]

    def ndarray(self, end: int) -> tuple[int, tuple[int, ...], np.dtype]:
        """The header of an ndarray ext payload, ``[shape, dtype name, bytes]``: where its bytes start
        (the cursor is left there), its shape and dtype, checked against the payload's length."""
        cur = self.cur
        kind, n = self.header()
        if (kind, n) != ("array", 3):
            raise cur.corrupt("an array ext that is not [shape, dtype, data]")
        kind, rank = self.header()
        if kind != "array" or rank > 64:
            raise cur.corrupt("an array ext whose shape is not a short list")
        shape = []
        for _ in range(rank):
            kind, d = self.header()
            if kind != "value" or not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise cur.corrupt("an array ext whose shape holds something other than sizes")
            shape.append(d)
        kind, name = self.header()
        if kind == "bin" and name <= 64:
            name = cur.take(name).decode("ascii", "replace")
        elif kind != "value" or not isinstance(name, str):
            raise cur.corrupt("an array ext without a dtype name")
        try:
            dtype = np_dtype(name)
        except (TypeError, ValueError, AttributeError):
            raise cur.corrupt(f"an array ext of unknown dtype {name[:40]!r}") from None
        if dtype.hasobject or dtype.itemsize == 0:
            raise cur.corrupt(f"an array ext of dtype {dtype} (objects cannot be stored inline)")
        kind, length = self.header()
        if kind != "bin":
            raise cur.corrupt("an array ext without its data bytes")
        offset = cur.pos()
        if length != math.prod(shape) * dtype.itemsize or offset + length != end:
            raise cur.corrupt(f"an array ext of {length:,} data bytes for shape {shape} {dtype}", offset)
        self.indexable(shape, dtype)
        return offset, tuple(shape), dtype

    def indexable(self, shape: Any, dtype: np.dtype) -> None:
        """Refuse a shape no reader could hand out: a dimension over ``MAX_ARRAY_BYTES`` (2^60), or a zero-size
        array numpy cannot build (``[0, 2**64 - 1]``, ``[2**32, 0, 2**32]``: numpy's own bound on the product of
        the dimensions), which its data bytes (none) do not bound. A zero-size array numpy holds is read as one."""
        if any(d > MAX_ARRAY_BYTES for d in shape):
            raise self.cur.corrupt(f"an array of shape {list(shape)}: a dimension over 2^60")
        if not math.prod(shape):
            try:
                np.empty(tuple(shape), dtype)  # zero bytes: nothing allocated
            except (ValueError, OverflowError):
                raise self.cur.corrupt(f"a zero-size array of shape {list(shape)}, more than numpy can "
                                       "index") from None


def walk(context: ReadContext, path: str, *, object_hook: Callable[[dict], Any] | None = None) -> Any:
    """The object in a Flax msgpack file, walked once: arrays as ``FileReader``s at their offsets, never read.

    Args:
      context: read through ``context.storage``; the decoded structure and values are held to its memory budget,
        and every array reader gets it.
      path: a local path or a ``gs://``/``s3://`` URL.
      object_hook: called on each decoded map (after chunked arrays are joined), as msgpack's ``object_hook``.

    Raises:
      MsgpackError: (a ``CheckpointError``) the file is not well-formed msgpack (one line, with the byte offset).
      CheckpointError: the file cannot be read.

    >>> import numpy as np, tempfile, os
    >>> from flax.serialization import to_bytes
    >>> f = os.path.join(tempfile.mkdtemp(), "s.msgpack")
    >>> _ = open(f, "wb").write(to_bytes({"w": np.arange(3.0), "step": 7}))
    >>> tree = walk(ReadContext().confined_to(f), f)
    >>> tree["step"], tree["w"].shape, tree["w"].read_all().tolist()
    (7, (3,), [0.0, 1.0, 2.0])
    """
    try:
        size = context.storage.getsize(path)
        f = context.storage.open(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}).") from None
    with f:
        return _Walker(_Cursor(f, size, path), path, context, object_hook).walk()


def walk_records(context: ReadContext, path: str) -> list[tuple[list[Any], Any]]:
    """The records of a msgpack stream of ``[key, bytes]`` pairs whose bytes are themselves msgpack (EasyLM's
    ``StreamingCheckpointer``: each record ``packer.pack((key_path, flax.serialization.to_bytes(value)))``):
    ``(key, value)`` each, the value walked in place (arrays as ``FileReader``s at their offsets).

    Raises:
      MsgpackError: the file is not such a stream (one line, with the byte offset).
    """
    try:
        size = context.storage.getsize(path)
        f = context.storage.open(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}).") from None
    records: list[tuple[list[Any], Any]] = []
    with f:
        cur = _Cursor(f, size, path)
        walker = _Walker(cur, path, context, None)
        while cur.pos() < size:
            at = cur.pos()
            kind, n = walker.header()
            if (kind, n) != ("array", 2):
                raise cur.corrupt("a record that is not a [key, value] pair", at)
            key = walker.walk(whole=False)
            walker.hold(_OBJECT_BYTES * 4, "the records of this msgpack stream")
            kind, n = walker.header()
            if kind != "bin":
                value = walker.walk_value(kind, n)
            else:
                start = cur.pos()
                walker.past_end(n)
                inner = _Cursor(f, start + n, path)
                inner.base = start
                sub = _Walker(inner, path, context, None)
                sub.held, sub.limit = walker.held, walker.limit
                value = sub.walk()
                walker.held = sub.held
                cur.skip(n)
            records.append((key, value))
    return records


def walk_bytes(data: bytes, *, where: str = "msgpack") -> Any:
    """The object in msgpack ``data`` already in memory (no arrays expected: they would name no file)."""
    return _Walker(_Cursor(None, len(data), where, data), where, None, None).walk()
