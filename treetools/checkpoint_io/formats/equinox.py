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
such stream: it reads as a one-leaf file, shown as format ``npy`` (not
``equinox``), and is never offered as the checkpoint a path beside it meant.
Object arrays (pickles) are refused, never unpickled.
"""

from __future__ import annotations

import math

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats.npz import NpyHeaderError, npy_header
from treetools.checkpoint_io.leaves import Leaf, array_row
from treetools.checkpoint_io.readers import FileReader, is_numeric
from treetools.checkpoint_io.source import file_head, FileSource, Format
from treetools.shared.errors import CheckpointError

MAGIC = b"\x93NUMPY"
_WHAT = "Equinox file (eqx.tree_serialise_leaves: .npy arrays back to back)"


def read_eqx(context: ReadContext, path: str) -> list[Leaf]:
    """The leaves of an Equinox file, ``0``, ``1``, ... from each ``.npy`` header; no array data is read.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "m.eqx")
    >>> with open(f, "wb") as out:
    ...     np.save(out, np.ones((2, 3), np.float32)); np.save(out, np.int32(7))
    >>> [(leaf.name, leaf.row.shape, leaf.row.dtype) for leaf in read_eqx(ReadContext().confined_to(f), f)]
    [('0', (2, 3), 'float32'), ('1', (), 'int32')]
    """
    storage = context.storage
    try:
        size = storage.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}).") from None
    leaves: list[Leaf] = []
    pos = 0
    with storage.open(path, block_size=4096) as f:
        while pos < size:
            index = len(leaves)
            where = f"{path}: leaf {index} (byte {pos:,})"
            f.seek(pos)
            head = f.read(len(MAGIC))
            if head != MAGIC:
                if MAGIC.startswith(head):  # the file ends inside the next magic
                    raise CheckpointError(f"{path}: truncated {_WHAT}: leaf {index}'s header is cut short.")
                raise CheckpointError(f"{where}: corrupt {_WHAT}: no .npy array starts here.")
            f.seek(pos)
            try:
                shape, fortran, dtype, offset = npy_header(f, f"{where}: corrupt {_WHAT}:")
            except NpyHeaderError as e:
                if f.tell() >= size:  # the header itself was cut short
                    raise CheckpointError(f"{path}: truncated {_WHAT}: leaf {index}'s header is cut short.") from None
                raise e from None
            if dtype.hasobject:
                raise CheckpointError(f"{where}: an object array (a pickle); treetools never unpickles a checkpoint.")
            if not is_numeric(dtype):  # equinox saves arrays and scalars of numbers only
                raise CheckpointError(f"{where}: corrupt {_WHAT}: dtype {dtype.str} is not a number type.")
            end = offset + math.prod(shape) * dtype.itemsize
            if end > size:
                raise CheckpointError(
                    f"{path}: truncated {_WHAT}: leaf {index} ends at byte {end:,} but the file has {size:,} bytes; "
                    "the save did not finish or the copy was cut short."
                )
            reader = FileReader(context, path, offset, shape, dtype, fortran=fortran)
            leaves.append(Leaf(array_row((str(index),), shape, dtype), reader))
            pos = end
    return leaves


def _is_npy(location: str) -> bool:
    return location.lower().endswith(".npy")


def _open(location: str, display: str, context: ReadContext) -> FileSource:
    try:
        leaves = read_eqx(context, location)
    except CheckpointError as e:  # name the path as typed
        raise CheckpointError(str(e).replace(location, display, 1)) from None
    plain = len(leaves) == 1 and _is_npy(location)  # np.save's own file: an array, shown as what it is
    notes = [] if plain else [f"{display}: Equinox stores no leaf names (they live in the model): its leaves are "
                              "numbered in the order written; load_parameters(path, target=model) names them."]
    return FileSource(display, context, "npy" if plain else "equinox", leaves, positional=True, notes=notes)


FORMAT = Format(
    name="equinox",
    priority=36,
    claims=lambda path, context: file_head(context.storage, path, len(MAGIC)) == MAGIC,
    open=_open,
    description="an Equinox file from eqx.tree_serialise_leaves (.eqx: .npy arrays back to back); a lone .npy array "
                "reads as format npy",
    suggest=lambda location: not _is_npy(location),  # a .npy beside a path is data, not the checkpoint meant
)
