"""Equinox ``eqx.tree_serialise_leaves`` files (``.eqx``), read without jax or equinox.

``tree_serialise_leaves(path, model)`` writes the model's array-like leaves
(arrays, numpy and Python scalars), in jax's flatten order, as ``.npy`` streams
back to back (equinox/_serialisation.py, ``default_serialise_filter_spec``:
``np.save`` / ``jnp.save`` of each; other leaves write nothing). There is no
index and no name: the names live in the user's model. So the leaves are
``0``, ``1``, ... in the order written, each with the shape and dtype of its
``.npy`` header, and its data read on request at its offset (``FileReader``).
``load_parameters(path, target=model)`` names them as
``eqx.tree_deserialise_leaves(path, like)`` does: the target's array leaves,
in flatten order, are the file's leaves in its order (``Item.positional``).

bfloat16 is stored as 2-byte void (``<V2``), as ``jnp.save`` writes it; it is
read back as bfloat16, as ``jnp.load`` does. A single ``.npy`` file is one
such stream: it reads as a one-leaf file. Object arrays (pickles) are refused,
never unpickled.
"""

from __future__ import annotations

import ast
import math
import struct
from typing import Any

import numpy as np

from treetools.ckpt import storage
from treetools.ckpt.readers import FileReader, np_dtype
from treetools.ckpt.source import FileSource, Format, Leaf, array_row, file_head
from treetools.errors import CheckpointError

MAGIC = b"\x93NUMPY"
_HEAD = 4096  # bytes read at each stream's start: the magic, the version, the header (numpy pads it to 64 bytes)
_MAX_HEADER = 10**6  # numpy's own limit on a header's length (np.lib.format's max_header_size)
_WHAT = "Equinox file (eqx.tree_serialise_leaves: .npy arrays back to back)"


def _dtype(descr: Any, where: str) -> np.dtype:
    """The dtype of a header's ``descr``; ``<V2`` is bfloat16 (``jnp.save``'s way of writing it)."""
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: corrupt {_WHAT}: dtype {descr!r} is not a numpy dtype.") from None
    if dtype.hasobject:
        raise CheckpointError(f"{where}: holds an object array (a pickle); treetools never unpickles a checkpoint.")
    if dtype.kind == "V" and dtype.itemsize == 2 and dtype.fields is None:
        return np_dtype("bfloat16")
    return dtype


def _header(path: str, pos: int, size: int, index: int) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """``(shape, dtype, fortran_order, data offset)`` of the ``.npy`` stream starting at byte ``pos``."""
    where = f"{path}: leaf {index} (byte {pos:,})"
    head = storage.read_range(path, pos, _HEAD)
    if not head.startswith(MAGIC):
        raise CheckpointError(f"{where}: corrupt {_WHAT}: no .npy stream starts here; the file is damaged.")
    if len(head) < 10:
        raise CheckpointError(f"{path}: truncated {_WHAT}: leaf {index}'s header is cut short.")
    major = head[6]
    if major == 1:
        length, start = struct.unpack("<H", head[8:10])[0], 10
    elif major in (2, 3) and len(head) >= 12:
        length, start = struct.unpack("<I", head[8:12])[0], 12
    else:
        raise CheckpointError(f"{where}: corrupt {_WHAT}: unknown .npy version {major}.")
    if length > _MAX_HEADER:
        raise CheckpointError(f"{where}: corrupt {_WHAT}: a .npy header of {length:,} bytes.")
    if start + length > len(head):
        head = storage.read_range(path, pos, start + length)
    if start + length > len(head):
        raise CheckpointError(f"{path}: truncated {_WHAT}: leaf {index}'s header is cut short.")
    text = head[start:start + length].decode("latin1")
    try:  # numpy writes a Python dict literal: parsed as a literal, never evaluated
        meta = ast.literal_eval(text)
        shape = tuple(int(d) for d in meta["shape"])
        fortran = bool(meta["fortran_order"])
        descr = meta["descr"]
        if any(d < 0 for d in shape):
            raise ValueError("a negative dimension")
    except (ValueError, SyntaxError, KeyError, TypeError, MemoryError, RecursionError) as e:
        raise CheckpointError(f"{where}: corrupt {_WHAT}: unreadable .npy header ({type(e).__name__}).") from None
    dtype = _dtype(descr, where)
    offset = pos + start + length
    end = offset + math.prod(shape) * dtype.itemsize
    if end > size:
        raise CheckpointError(
            f"{path}: truncated {_WHAT}: leaf {index} ends at byte {end:,} but the file has {size:,} bytes; the save "
            "did not finish or the copy was cut short."
        )
    return shape, dtype, fortran, offset


def read_eqx(path: str) -> list[Leaf]:
    """The leaves of an Equinox file, ``0``, ``1``, ... from each ``.npy`` header; no array data is read.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "m.eqx")
    >>> with open(f, "wb") as out:
    ...     np.save(out, np.ones((2, 3), np.float32)); np.save(out, np.int32(7))
    >>> [(leaf.name, leaf.row.shape, leaf.row.dtype) for leaf in read_eqx(f)]
    [('0', (2, 3), 'float32'), ('1', (), 'int32')]
    """
    try:
        size = storage.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}).") from None
    leaves: list[Leaf] = []
    pos = 0
    while pos < size:
        index = len(leaves)
        shape, dtype, fortran, offset = _header(path, pos, size, index)
        leaves.append(Leaf(array_row((str(index),), shape, dtype), FileReader(path, offset, shape, dtype, fortran=fortran)))
        pos = offset + math.prod(shape) * dtype.itemsize
    return leaves


def _open(location: str, display: str) -> FileSource:
    try:
        leaves = read_eqx(location)
    except CheckpointError as e:  # name the path as typed
        raise CheckpointError(str(e).replace(location, display, 1)) from None
    source = FileSource(display, "equinox", leaves, positional=True)
    if len(leaves) > 1 or not display.endswith(".npy"):
        source.notes.append(f"{display}: Equinox stores no leaf names (they live in the model): its leaves are "
                            "numbered in the order written; load_parameters(path, target=model) names them.")
    return source


FORMAT = Format(
    name="equinox",
    priority=36,
    claims=lambda path: file_head(path, len(MAGIC)) == MAGIC,
    open=_open,
    description="an Equinox file from eqx.tree_serialise_leaves (.eqx: .npy arrays back to back; a .npy is one)",
)
