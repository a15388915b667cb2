"""OCDBT databases (Orbax's and TensorStore's key-value store) bounded by what they store, before TensorStore reads
them.

Not a format (its name starts with ``_``): the checks ``_ts_folders.Pins`` runs on every OCDBT database before a
store is opened on it.

TensorStore decodes an OCDBT database's manifest and b-tree nodes whole (each is a zstd stream inside a small
header, ``tensorstore/kvstore/ocdbt/index.rst``). The manifest's ``max_decoded_node_bytes`` is what a *writer*
aims for when it splits nodes; a reader does not enforce it, and writers set it high (Orbax 0.12: 100,000,000), so
it bounds nothing. What does bound a node is its zstd stream as stored: every zstd block header says what the block
decodes to (a raw or RLE block, exactly) or the most it may (a compressed block: at most the frame's window, and
never more than 128 KiB, RFC 8878 3.1.1.2.4), so walking the block headers (3 bytes each, nothing decoded) gives
the most a node can decode to. ``check_database`` walks the manifests and every b-tree node of the version
TensorStore reads (the latest), each node's stored bytes read through the checkpoint's storage and its bound
checked against the budget, before TensorStore decodes it (interior nodes are then listed through
``tensorstore.ocdbt.dump`` to find their children).

The same walk says how big the leaves are that TensorStore looks chunks up in: looking up one chunk key scans
its leaf (measured: a read of N chunks in a database of K keys takes about N x K nanoseconds), which is what
``_tensorstore`` holds a read's chunk count to.

Standard library only at import time (``check_database`` imports tensorstore).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Collection, Iterator

from treetools.checkpoint_io.leaves import check_name
from treetools.checkpoint_io.readers import JSON_EXPANSION, check_budget
from treetools.checkpoint_io.steps import MAX_METADATA_BYTES
from treetools.checkpoint_io.formats._ts_kvstore import kvstore_spec
from treetools.checkpoint_io.storage import Storage
from treetools.shared.errors import CheckpointError

MANIFEST_MAGIC = 0x0CDB3A2A
VERSION_NODE_MAGIC = 0x0CDB1234
BTREE_NODE_MAGIC = 0x0CDB20DE
MANIFEST = "manifest.ocdbt"

ZSTD_MAGIC = 0xFD2FB528
ZSTD_BLOCK_MAX = 128 * 2**10
"""The most one zstd block decodes to (RFC 8878: ``Block_Maximum_Size``, also at most the frame's window)."""

_HEADER = 4 + 8  # magic (uint32 big-endian), length (uint64 little-endian); then version and compression varints
_CRC = 4


class Corrupt(ValueError):
    """A stored structure that does not parse as its format says."""


def zstd_bound(data: bytes | memoryview) -> int:
    """The most bytes the zstd stream ``data`` can decode to (and the decoder's window hold), read from its frame
    and block headers alone.

    Raises:
      Corrupt: ``data`` is not a sequence of zstd frames (or skippable frames), or a block breaks the format's
        limits.

    >>> zstd_bound(bytes.fromhex("28b52ffd" "2004" "230000" "41"))  # one frame of 4 bytes: one RLE block of "A"s
    8
    """
    view = memoryview(data).cast("B")
    pos, total = 0, 0
    while pos < len(view):
        if len(view) - pos < 4:
            raise Corrupt("a zstd stream ends inside a frame's magic number")
        magic = int.from_bytes(view[pos:pos + 4], "little")
        pos += 4
        if magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame: its length, then bytes no decoder looks at
            if len(view) - pos < 4:
                raise Corrupt("a skippable zstd frame without its length")
            pos += 4 + int.from_bytes(view[pos:pos + 4], "little")
            continue
        if magic != ZSTD_MAGIC:
            raise Corrupt(f"not a zstd frame (magic {magic:#010x})")
        decoded, window, pos = _frame(view, pos)
        total += decoded + min(window, decoded)  # what the frame decodes to, and the window the decoder keeps
    if pos != len(view):
        raise Corrupt("a zstd frame runs past the end of the stored data")
    return total


def _frame(view: memoryview, pos: int) -> tuple[int, int, int]:
    """``(the most the frame decodes to, its window, the position after it)`` for the frame header at ``pos``."""
    descriptor, window, pos = _frame_header(view, pos)
    decoded, pos = _frame_blocks(view, pos, min(window, ZSTD_BLOCK_MAX))
    if descriptor & 0x04:  # content checksum
        pos += 4
    return decoded, window, pos


def _frame_header(view: memoryview, pos: int) -> tuple[int, int, int]:
    """``(frame header descriptor, window size, position of the first block)`` of the frame at ``pos``."""
    if pos >= len(view):
        raise Corrupt("a zstd frame without its header")
    descriptor = view[pos]
    pos += 1
    single = bool(descriptor & 0x20)
    if descriptor & 0x08:
        raise Corrupt("a zstd frame header with its reserved bit set")
    fcs_size = (0, 2, 4, 8)[descriptor >> 6] or (1 if single else 0)
    dict_size = (0, 1, 2, 4)[descriptor & 0x03]
    window = 0
    if not single:
        if pos >= len(view):
            raise Corrupt("a zstd frame header cut short")
        exponent, mantissa = view[pos] >> 3, view[pos] & 0x07
        base = 1 << (10 + exponent)
        window = base + (base // 8) * mantissa
        pos += 1
    pos += dict_size
    if pos + fcs_size > len(view):
        raise Corrupt("a zstd frame header cut short")
    content = int.from_bytes(view[pos:pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    pos += fcs_size
    if single:
        window = content
    return descriptor, window, pos


def _frame_blocks(view: memoryview, pos: int, block_max: int) -> tuple[int, int]:
    """``(the most a frame's blocks decode to, the position after the last)``, its first block at ``pos``; a
    compressed block counts ``block_max``, the most it may decode to."""
    decoded = 0
    while True:
        if pos + 3 > len(view):
            raise Corrupt("a zstd block header cut short")
        header = int.from_bytes(view[pos:pos + 3], "little")
        pos += 3
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise Corrupt("a zstd block of the reserved type")
        if size > ZSTD_BLOCK_MAX:
            raise Corrupt(f"a zstd block of {size:,} bytes, over the format's {ZSTD_BLOCK_MAX:,}")
        stored = 1 if kind == 1 else size
        if pos + stored > len(view):
            raise Corrupt("a zstd block runs past the end of the stored data")
        pos += stored
        decoded += size if kind in (0, 1) else block_max  # raw and RLE: exactly; compressed: at most a block
        if last:
            return decoded, pos


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(view) or shift > 63:
            raise Corrupt("a varint cut short")
        byte = view[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if not byte & 0x80:
            return value, pos


def encoded_bound(raw: bytes, magic: int) -> int:
    """The most bytes decoding one encoded OCDBT structure (a manifest, a version tree or b-tree node) holds: its
    body as stored, or for a zstd body the most it decodes to (``zstd_bound``).

    Raises:
      Corrupt: not such a structure (its magic number, length or compression does not match).
    """
    view = memoryview(raw)
    if len(view) < _HEADER + 2 + _CRC:
        raise Corrupt(f"{len(view)} bytes, shorter than any encoded OCDBT structure")
    if int.from_bytes(view[:4], "big") != magic:
        raise Corrupt(f"magic number {bytes(view[:4]).hex()}, expected {magic:08x}")
    if int.from_bytes(view[4:12], "little") != len(view):
        raise Corrupt(f"its header says {int.from_bytes(view[4:12], 'little'):,} bytes, {len(view):,} stored")
    _, pos = _varint(view, _HEADER)  # version: TensorStore checks it
    compression, pos = _varint(view, pos)
    body = view[pos:len(view) - _CRC]
    if compression == 0:
        return len(body)
    if compression == 1:
        return zstd_bound(body)
    raise Corrupt(f"unknown compression format {compression}")


@dataclasses.dataclass(frozen=True)
class Database:
    """What one OCDBT database stores and what decoding it holds, as found by ``check_database``."""

    stored_bytes: int
    """Bytes of every file of the database (manifests, data files)."""
    node_bytes: int
    """The most any one manifest or node decodes to (bounded from its stored zstd stream)."""
    leaf_bytes: int
    """The most any one leaf of the b-tree decodes to: what TensorStore scans to look up one chunk."""
    nodes: int


_CHECKED: "collections.OrderedDict[tuple, tuple[Database, tuple, tuple]]" = collections.OrderedDict()
_CHECKED_LOCK = threading.Lock()


def _location(text: str, base_kind: str) -> tuple[str, int, int]:
    """``(path, offset, length)`` of a ``btreenode::d/<id>:<offset>:<length>`` location from ``tensorstore.ocdbt.dump``."""
    kind, sep, rest = text.partition("::")
    path, offset, length = rest.rsplit(":", 2) if sep and rest.count(":") >= 2 else ("", "-1", "-1")
    if kind != base_kind or not path or not offset.isdigit() or not length.isdigit():
        raise Corrupt(f"a node location {text[:200]!r} that does not parse")
    return path, int(offset), int(length)


def _identity(storage: Storage, paths: list[str]) -> tuple:
    out: list[tuple | None] = []
    for path in paths:
        try:
            st = storage.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_size, getattr(st, "st_ino", 0), getattr(st, "st_mtime_ns", 0), getattr(st, "st_ctime_ns", 0)))
    return tuple(out)


def check_database(storage: Storage, base: str, limit: float, *, shown: str | None = None) -> Database:
    """Refuse an OCDBT database any of whose manifests or b-tree nodes may decode to more than ``limit`` bytes.

    ``base`` is the database's folder as ``storage`` reads it (a pinned local folder's ``/proc/self/fd/N``, or a
    URL); ``shown`` names it in errors. Reads the manifests and the nodes of the latest version, never a value.
    A database found clean is remembered by the identity (size, inode, times) of every file the walk read.

    Raises:
      MemoryBudgetError: a manifest or node may decode to more than ``limit`` (one line naming it and the flag).
      CheckpointError: a manifest or node is corrupt, or names a file outside the database.
    """
    import tensorstore as ts

    shown = shown or base
    manifests = _manifests(storage, base)
    key_files = [os.path.join(base, m) for m in manifests]
    cache_key = (base if storage.remote else None, tuple(manifests), _identity(storage, key_files), limit)
    with _CHECKED_LOCK:
        hit = _CHECKED.get(cache_key)
    if hit is not None and _identity(storage, [os.path.join(base, rel) for rel in hit[1]]) == hit[2]:
        return hit[0]  # every file the walk read is as it was (by path relative to the database)
    if not manifests:
        return Database(0, 0, 0, 0)
    dump, node_bytes = _listed_manifests(storage, base, shown, manifests, limit)
    try:
        kv = ts.KvStore.open(kvstore_spec(storage, base)).result()
    except Exception as e:
        raise CheckpointError(f"{os.path.join(shown, MANIFEST)}: corrupt OCDBT manifest ({first_line(e)}).") from None
    # What the walk read, and the folders whose files make ``stored_bytes`` (a file added changes its folder).
    read: list[str] = [*key_files, *(f for f, _, _ in _walk(storage, base, shown))]
    leaf_bytes, nodes = 0, 0
    for node in dump.get("version_tree_nodes") or []:  # older versions: bounded, though the latest reads none
        loc = node.get("location") if isinstance(node, dict) else None
        if isinstance(loc, str):
            bound, path = _node(storage, base, shown, loc, "versionnode", VERSION_NODE_MAGIC, limit)
            node_bytes, nodes = max(node_bytes, bound), nodes + 1
            read.append(path)
    pending = _latest_root(dump)
    seen: set[str] = set()
    while pending:
        loc, height = pending.pop()
        if loc in seen:
            continue
        seen.add(loc)
        bound, path = _node(storage, base, shown, loc, "btreenode", BTREE_NODE_MAGIC, limit)
        node_bytes, nodes = max(node_bytes, bound), nodes + 1
        read.append(path)
        if height <= 0:
            leaf_bytes = max(leaf_bytes, bound)
            continue
        # An interior node is listed as Python objects to find its children: held to the budget as parsed JSON is.
        check_budget(JSON_EXPANSION * bound, where=f"{shown}: b-tree node {loc}", what="an interior node, listed,",
                     budget=limit)
        try:
            entries = ts.ocdbt.dump(kv, loc).result().get("entries") or []
        except Exception as e:
            raise CheckpointError(f"{shown}: corrupt OCDBT b-tree node {loc} ({first_line(e)}).") from None
        pending += [(e["location"], height - 1) for e in entries if isinstance(e, dict) and isinstance(e.get("location"), str)]
    files = _files(storage, base, shown)
    database = Database(sum(size for _, size in files), node_bytes, leaf_bytes, nodes)
    read = list(dict.fromkeys(read))
    relative = tuple(os.path.relpath(path, base) if not storage.remote else path[len(base):].lstrip("/")
                     for path in read)
    with _CHECKED_LOCK:
        _CHECKED[cache_key] = (database, relative, _identity(storage, read))
        while len(_CHECKED) > 1024:
            _CHECKED.popitem(last=False)
    return database


class NotPlain(Exception):
    """A b-tree ``values`` declines to read in one pass (it reads no differently from TensorStore's lookups only
    when well formed): its keys out of order, a key outside the range its parent gives it, a node that does
    not list, a value over the metadata limit or cut short."""


LISTED_PER_KEY = 32
"""Keys ``values`` lists per key it looks for (plus ``LISTED_ANYWAY``) before it leaves the lookups to TensorStore:
an item of a few arrays stored in many chunks is looked up array by array (measured per key: a lookup 35 us plus
about 1 ns per key of its leaf; a key listed, about 2 us)."""

LISTED_ANYWAY = 2**16


def values(storage: Storage, base: str, keys: Collection[bytes], limit: float, *, shown: str | None = None,
           arrays: Collection[bytes] = (), chunks: dict[bytes, dict[bytes, bytes] | None] | None = None,
           hold: int = 0) -> dict[bytes, bytes] | None:
    """The stored values of those of ``keys`` the latest version of the OCDBT database at ``base`` holds, read in
    one pass over its b-tree: each node read, bounded (as ``check_database`` bounds it) and listed once, and each
    value taken from its leaf entry (inline) or read from its data file.

    What TensorStore's own lookups of those keys give, one by one (each scans a b-tree leaf: a database's
    headers cost keys x leaf; here once for all). None when the tree is not plainly well formed (``NotPlain``)
    or a node is over the budget: then look the keys up through TensorStore, whose errors say what is wrong.
    For metadata (zarr headers): a value over ``MAX_METADATA_BYTES`` is declined too. None also when the version
    holds more than ``LISTED_PER_KEY`` keys per key asked for (and ``LISTED_ANYWAY``): listing them all would cost
    more than the lookups.

    With ``chunks`` (a dict filled in), the same pass also keeps the values stored inline under each prefix of
    ``arrays`` (an array's folder, ``name/``; a key belongs to the longest such prefix it starts with): ``chunks``
    maps the prefix to ``{key below it: value}``, or to None once one of its values is not inline or the values
    kept would pass ``hold`` bytes in all (that array's data is looked up through TensorStore).
    """
    import tensorstore as ts

    shown = shown or base
    wanted = set(keys)
    manifests = _manifests(storage, base)
    if not manifests or not wanted:
        return {}
    try:
        dump, _ = _listed_manifests(storage, base, shown, manifests, limit)
        if _latest_keys(dump) > LISTED_PER_KEY * len(wanted) + LISTED_ANYWAY:
            return None
        kv = ts.KvStore.open(kvstore_spec(storage, base)).result()
        found: dict[bytes, bytes] = {}
        set_arrays = set(arrays)
        # (node location, height, the prefix its keys are relative to, the range of full keys it may hold)
        pending: list[tuple[str, int, bytes, bytes, bytes | None]] = [(loc, h, b"", b"", None)
                                                                     for loc, h in _latest_root(dump)]
        while pending:
            loc, height, prefix, low, high = pending.pop()
            bound, _ = _node(storage, base, shown, loc, "btreenode", BTREE_NODE_MAGIC, limit)
            check_budget(JSON_EXPANSION * bound, where=f"{shown}: b-tree node {loc}", what="a b-tree node, listed,",
                         budget=limit)
            node = ts.ocdbt.dump(kv, loc).result()
            if node.get("height") != height:
                raise NotPlain(loc)
            entries = _entries(node, prefix, low, high)
            if height > 0:
                pending += _children(entries, prefix, height, high)
                continue
            for full, entry in entries:
                if full in wanted:
                    found[full] = _value(storage, base, shown, entry)
                elif chunks is not None and arrays:
                    hold = _keep_chunk(full, entry, set_arrays, chunks, hold)
        return found
    except Exception:  # NotPlain, a refusal, TensorStore's error: the lookups one by one will say what is wrong
        return None


def _keep_chunk(full: bytes, entry: dict, arrays: set[bytes], chunks: dict[bytes, dict[bytes, bytes] | None],
                hold: int) -> int:
    """Keep a leaf entry's inline value in ``chunks`` under the longest prefix of ``arrays`` its key starts with;
    the bytes that may still be kept."""
    prefix, at = None, full.rfind(b"/")
    while at >= 0 and prefix is None:
        prefix = full[:at + 1] if full[:at + 1] in arrays else None
        at = full.rfind(b"/", 0, at)
    if prefix is None:
        return hold
    kept = chunks.setdefault(prefix, {})
    if kept is None:
        return hold
    inline = entry.get("inline_value")
    if not isinstance(inline, bytes) or len(inline) + len(full) > hold:
        chunks[prefix] = None  # looked up through TensorStore, as before: what it kept is let go
        return hold + sum(len(k) + len(v) + len(prefix) for k, v in kept.items())
    kept[full[len(prefix):]] = inline
    return hold - len(full) - len(inline)


def _entries(node: dict, prefix: bytes, low: bytes, high: bytes | None) -> list[tuple[bytes, dict]]:
    """``(full key, entry)`` of a listed node, its keys strictly increasing and within ``[low, high)``."""
    out: list[tuple[bytes, dict]] = []
    for entry in node.get("entries") or []:
        key = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(key, bytes):
            raise NotPlain("an entry without its key")
        full = prefix + key
        if (out and full <= out[-1][0]) or full < low or (high is not None and full >= high):
            raise NotPlain(f"key {full[:200]!r} out of order or out of its node's range")
        out.append((full, entry))
    return out


def _children(entries: list[tuple[bytes, dict]], prefix: bytes, height: int,
              high: bytes | None) -> list[tuple[str, int, bytes, bytes, bytes | None]]:
    """The child nodes of an interior node's ``entries``: each holds the keys from its own up to the next's."""
    out = []
    for i, (full, entry) in enumerate(entries):
        common, loc = entry.get("subtree_common_prefix"), entry.get("location")
        if not isinstance(common, bytes) or not isinstance(loc, str) or not full.startswith(prefix + common):
            raise NotPlain("an interior entry without its child's location or common prefix")
        out.append((loc, height - 1, prefix + common, full, entries[i + 1][0] if i + 1 < len(entries) else high))
    return out


def _value(storage: Storage, base: str, shown: str, entry: dict) -> bytes:
    """A leaf entry's value: inline, or read from the data file its reference names (a metadata file's size at most)."""
    inline = entry.get("inline_value")
    if isinstance(inline, bytes):
        return inline
    path, offset, length = _location(str(entry.get("indirect_value")), "value")
    check_name(path, where=f"{shown}: OCDBT value {path[:200]!r}")
    if length > MAX_METADATA_BYTES:
        raise NotPlain("a value over the metadata limit")
    raw = storage.read_range(os.path.join(base, path), offset, length)
    if len(raw) != length:
        raise NotPlain("a value cut short")
    return bytes(raw)


def _listed_manifests(storage: Storage, base: str, shown: str, manifests: list[str], limit: float) -> tuple[dict, int]:
    """``(tensorstore.ocdbt.dump of the manifests, the most one decodes to)``: each read whole through ``storage``
    and bounded before TensorStore lists it from memory (the same bytes, and no second request in a bucket)."""
    import tensorstore as ts

    node_bytes = 0
    checked = ts.KvStore.open({"driver": "memory"}).result()
    for name in manifests:
        where = os.path.join(shown, name)
        raw = _read_whole(storage, os.path.join(base, name), where, limit)
        bound = _bound(raw, MANIFEST_MAGIC, where)
        # The manifest lists its versions: held as Python objects once tensorstore.ocdbt.dump parses them.
        check_budget(JSON_EXPANSION * bound, where=where, what="the OCDBT manifest, decoded and listed,",
                     budget=limit)
        node_bytes = max(node_bytes, bound)
        checked[name] = raw
    try:
        return ts.ocdbt.dump(checked).result(), node_bytes
    except Exception as e:  # tensorstore: a corrupt manifest
        raise CheckpointError(f"{os.path.join(shown, MANIFEST)}: corrupt OCDBT manifest ({first_line(e)}).") from None


def _latest_root(dump: dict) -> list[tuple[str, int]]:
    """``[(location of the root b-tree node, its height)]`` of the latest version TensorStore reads; [] when that
    version's tree is empty."""
    versions = [v for v in dump.get("versions") or [] if isinstance(v, dict)]
    latest = max(versions, key=lambda v: v.get("generation_number") or 0, default=None)
    root = (latest or {}).get("root") or {}
    height = int((latest or {}).get("root_height") or 0)
    return [(root["location"], height)] if isinstance(root.get("location"), str) else []


def _latest_keys(dump: dict) -> int:
    """The keys the latest version holds, as its manifest counts them (a count that does not parse: 0)."""
    versions = [v for v in dump.get("versions") or [] if isinstance(v, dict)]
    latest = max(versions, key=lambda v: v.get("generation_number") or 0, default=None)
    keys = (((latest or {}).get("root") or {}).get("statistics") or {}).get("num_keys")
    return keys if isinstance(keys, int) else 0


def _manifests(storage: Storage, base: str) -> list[str]:
    try:
        names = storage.listdir(base)
    except OSError:
        return []
    return sorted(n for n in names if n == MANIFEST or (n.startswith("manifest.") and len(n) == 25))


def _walk(storage: Storage, base: str, shown: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``storage.walk(base)``; a refusal (a symlink loop in the database's folder) names the folder as the
    checkpoint does (``shown``), not as the descriptor it was read through (``/proc/self/fd/5/d/up``)."""
    try:
        yield from storage.walk(base)
    except CheckpointError as e:
        if base == shown or base not in str(e):
            raise
        raise CheckpointError(str(e).replace(base, shown)) from None


def _files(storage: Storage, base: str, shown: str | None = None) -> list[tuple[str, int]]:
    """Every file of the database, with its size (the database's bytes on disk)."""
    out = []
    for folder, _, files in _walk(storage, base, shown or base):
        for name in files:
            path = os.path.join(folder, name)
            try:
                out.append((path, storage.getsize(path)))
            except OSError:
                continue
    return out


def _read_whole(storage: Storage, path: str, where: str, limit: float) -> bytes:
    try:
        size = storage.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read ({e.strerror or e}).") from None
    check_budget(min(size, MAX_METADATA_BYTES + 1), where=where, what="the OCDBT manifest, read whole,", budget=limit)
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where}: {size:,} bytes, over the {MAX_METADATA_BYTES:,}-byte limit for metadata; "
                              "the database is corrupt or hostile.")
    return storage.read_range(path, 0, size)


def _bound(raw: bytes, magic: int, where: str) -> int:
    try:
        return encoded_bound(raw, magic)
    except Corrupt as e:
        raise CheckpointError(f"{where}: corrupt OCDBT database ({e}).") from None


def _node(storage: Storage, base: str, shown: str, loc: str, kind: str, magic: int, limit: float) -> tuple[int, str]:
    """A node's decoded bound, checked against ``limit``, and the file holding it."""
    try:
        path, offset, length = _location(loc, kind)
    except Corrupt as e:
        raise CheckpointError(f"{shown}: corrupt OCDBT database ({e}).") from None
    check_name(path, where=f"{shown}: OCDBT node {loc[:200]!r}")
    where = f"{os.path.join(shown, path)} (a node at byte {offset:,})"
    check_budget(length, where=where, what="an OCDBT node, read whole,", budget=limit)
    file = os.path.join(base, path)
    try:
        raw = storage.read_range(file, offset, length)
    except CheckpointError as e:  # named by the descriptor it was read through: say it as the checkpoint does
        raise CheckpointError(f"{where}: cannot read the node ({str(e).rsplit(': ', 1)[-1].rstrip('.')}).") from None
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read the node ({e.strerror or e}).") from None
    if len(raw) != length:
        raise CheckpointError(f"{where}: the data file ends before the node's {length:,} bytes; it is truncated.")
    bound = _bound(raw, magic, where)
    check_budget(bound, where=where, what="an OCDBT b-tree node (bounded from its stored zstd blocks)", budget=limit)
    return bound, file


def first_line(e: BaseException) -> str:
    """The gist of an error: its first line, without TensorStore's appended spec dump."""
    text = str(e).strip().splitlines()
    return text[0].split(" [tensorstore_spec=", 1)[0] if text else type(e).__name__
