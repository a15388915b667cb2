"""Shared pieces of the checkpoint readers: errors, leaves, block plans.

A reader turns a checkpoint into ``Leaf``s: a ``treetools.table.Row`` built
from metadata alone, plus (for arrays) an ``ArrayReader`` that can hand out
the array in bounded blocks. Nothing here reads array data by itself.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from treetools.table import Row, dtype_name

Index = tuple[slice, ...]

DEFAULT_CHUNK_BYTES = 8 * 2**20
"""Default block budget for ``--stats`` and ``diff --values`` (bytes of source data)."""


class CheckpointError(ValueError):
    """A known problem with a checkpoint: missing, not a checkpoint, corrupt or unreadable.

    The CLI prints it as one ``treetools: error: ...`` line and exits 1.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def require_file(path: str, *, what: str) -> None:
    """Refuse what is not a regular file before opening it: reading a FIFO would block forever.

    >>> require_file("/", what="Orbax _METADATA")
    Traceback (most recent call last):
    ...
    treetools.inspect._base.CheckpointError: /: not a regular file (a folder); cannot read it as Orbax _METADATA.
    """
    if os.path.isfile(path):
        return
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: {what} is missing.")
    raise CheckpointError(f"{path}: not a regular file ({file_kind(path)}); cannot read it as {what}.")


def file_kind(path: str) -> str:
    """``a folder``, ``a FIFO``, ``a broken symlink``...: what stands at ``path`` instead of a file."""
    import stat

    if os.path.islink(path) and not os.path.exists(path):
        return f"a broken symlink to {os.readlink(path)!r}"
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def require_regular_tree(folder: str) -> None:
    """Refuse a folder holding anything but files and folders (a FIFO, a broken symlink) before a reader opens it."""

    def fail(e: OSError) -> None:
        raise CheckpointError(f"{e.filename}: cannot list folder ({e.strerror or e}).")

    for root, _dirs, files in os.walk(folder, onerror=fail):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: not a regular file ({file_kind(path)}); cannot read this checkpoint.")


def chunk_bytes_from_env(default: int = DEFAULT_CHUNK_BYTES) -> int:
    """The block budget: ``TREETOOLS_CHUNK_BYTES`` when set, else ``default``."""
    raw = os.environ.get("TREETOOLS_CHUNK_BYTES")
    if not raw:
        return default
    try:
        value = int(float(raw))
    except ValueError:
        raise CheckpointError(f"`TREETOOLS_CHUNK_BYTES` must be a number of bytes, got {raw!r}.") from None
    if value < 1024:
        raise CheckpointError(f"`TREETOOLS_CHUNK_BYTES` must be at least 1024, got {value}.")
    return value


def check_name(name: str, *, where: str) -> None:
    """Refuse a stored name that would point outside the checkpoint.

    A name is refused when it is absolute or has a ``..`` part (``/`` or ``\\``
    separated): such a key could make a reader open files outside PATH.
    """
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts:
        raise CheckpointError(f"{where}: key {name!r} tries to escape the checkpoint folder; refusing to read it.")


def dotted_to_path(name: str) -> str:
    """``model.layers.0.weight`` -> ``model/layers/0/weight`` (torch-style names as path strings)."""
    return name.replace(".", "/")


def np_dtype(name: str) -> np.dtype:
    """A numpy dtype by name, including ml_dtypes ones (``bfloat16``, ``float8_e4m3fn``)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def is_numeric(dtype: Any) -> bool:
    """Whether statistics and value comparisons apply: bool, int, float, complex, ml_dtypes floats."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or (dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes"))


class ArrayReader:
    """Hands out one stored array in blocks; never the whole array at once.

    Subclasses implement ``read(index)`` for random access, or override
    ``blocks`` when the storage can only be streamed front to back.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...] | None = None
    sequential: bool = False
    """True when blocks must come in C order, front to back (a compressed zip member)."""
    c_order: bool = True
    """False when a sequential reader streams Fortran-ordered data."""

    def read(self, index: Index) -> np.ndarray:
        raise NotImplementedError

    def blocks(self, plan: Iterable[Index]) -> Iterator[np.ndarray]:
        """The blocks of ``plan`` (index tuples of slices), in plan order."""
        for index in plan:
            yield self.read(index)

    def storage_blocks(self, max_bytes: int) -> Iterator[np.ndarray]:
        """Every element exactly once, in whatever order the storage reads fastest.

        Blocks are not in the array's logical layout when the storage is
        Fortran-ordered; statistics do not care.
        """
        return self.blocks(plan_blocks(self.shape, max(1, max_bytes // self.dtype.itemsize), self.chunk_shape))


NO_VALUE: Any = type("NoValue", (), {"__repr__": lambda self: "NO_VALUE"})()
"""The value of a non-array leaf that the metadata does not carry."""


def jsonable(value: Any) -> Any:
    """A non-array leaf's value as JSON can hold it (numpy scalars as Python numbers, others as text)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


@dataclasses.dataclass
class Leaf:
    """One leaf of a checkpoint: its row (metadata) and, for arrays, a reader.

    ``value`` holds a non-array leaf's value when the metadata carries it
    (JSON items, scalars in a msgpack), else ``NO_VALUE``.
    """

    row: Row
    reader: ArrayReader | None = None
    value: Any = NO_VALUE


def array_row(path: str, shape: Sequence[int], dtype: Any, *, sharding: Any = None) -> Row:
    """The row of one stored array, from its metadata alone: params and bytes follow from shape and dtype.

    >>> array_row("w", (2, 3), np.float16).bytes
    12
    """
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    size = math.prod(shape)
    return Row(path=path, shape=shape, dtype=dtype_name(dtype), params=size, bytes=size * dtype.itemsize,
               sharding=sharding)


def value_row(path: str) -> Row:
    """The row of a non-array leaf (a scalar, a string, an object array): no shape, nothing counted."""
    return Row(path=path, shape=None, dtype=None, params=0, bytes=0)


def tree_leaves(tree: Any, *, where: str) -> list[Leaf]:
    """Leaves of a tree already in memory (a Flax msgpack, an Orbax JSON item), after refusing escaping keys.

    Arrays get an ``InMemoryReader``; other leaves keep their value.
    """
    from treetools.paths import leaves_with_paths
    from treetools.table import rows_from_tree

    pairs = leaves_with_paths(tree)
    for p, _ in pairs:
        check_name(p, where=where)
    return [Leaf(row, InMemoryReader(value)) if row.shape is not None else Leaf(row, value=value)
            for row, (_, value) in zip(rows_from_tree(tree), pairs)]


@dataclasses.dataclass
class Snapshot:
    """One checkpoint (one step): item name -> leaves, in stored order."""

    step: int | None
    items: dict[str, list[Leaf]]
    record_sharding: bool = False
    """Whether the format stores shardings (so a missing one means "not sharded")."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Diagnostics for stderr (e.g. an item kind the inspector skips)."""


def plan_blocks(shape: Sequence[int], max_elems: int, granule: Sequence[int] | None = None) -> Iterator[Index]:
    """Index tuples that tile ``shape`` in C order, each of at most ``max_elems`` elements.

    Blocks are whole multiples of ``granule`` (a storage chunk shape) so that
    no chunk is decoded twice; without a granule every block is one C-contiguous
    run of elements (what a front-to-back stream needs). A block never holds
    less than one granule, even when one granule exceeds ``max_elems``.

    >>> [tuple((s.start, s.stop) for s in ix) for ix in plan_blocks((4, 3), 6)]
    [((0, 2), (None, None)), ((2, 4), (None, None))]
    """
    shape = tuple(int(d) for d in shape)
    nd = len(shape)
    if nd == 0 or 0 in shape:
        yield tuple(slice(None) for _ in shape)
        return
    g = tuple(min(max(1, int(c)), s) for c, s in zip(granule, shape)) if granule else (1,) * nd
    for k in range(nd):
        unit = math.prod(g[:k]) * g[k] * math.prod(shape[k + 1:])
        if unit <= max_elems:
            break
    step = max(1, max_elems // unit) * g[k]
    import itertools

    prefixes = itertools.product(*(range(0, shape[i], g[i]) for i in range(k)))
    rest = (slice(None),) * (nd - k - 1)
    for prefix in prefixes:
        head = tuple(slice(p, min(p + g[i], shape[i])) for i, p in enumerate(prefix))
        for a in range(0, shape[k], step):
            yield head + (slice(a, min(a + step, shape[k])),) + rest


def block_extent(index: Index, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The start corner and the shape of the block ``index`` selects in ``shape``."""
    starts, sizes = [], []
    for s, n in zip(index, shape):
        start, stop, _ = s.indices(n)
        starts.append(start)
        sizes.append(max(0, stop - start))
    return tuple(starts), tuple(sizes)


def block_span(index: Index, shape: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """The flat C-order offset where the block ``index`` starts in ``shape``, and the block's shape.

    >>> block_span((slice(2, 4), slice(None)), (4, 3)), block_span((), ())
    ((6, (2, 3)), (0, ()))
    """
    starts, sizes = block_extent(index, shape)
    return (int(np.ravel_multi_index(starts, shape)) if math.prod(shape) else 0), sizes


class InMemoryReader(ArrayReader):
    """An array already in memory (Flax msgpack materializes its arrays)."""

    def __init__(self, array: np.ndarray):
        self._array = np.asarray(array)
        self.shape = tuple(self._array.shape)
        self.dtype = self._array.dtype

    def read(self, index: Index) -> np.ndarray:
        return self._array[index]


class MemmapReader(ArrayReader):
    """Raw array bytes at ``offset`` in a file, mapped one block at a time.

    Each block maps only its own byte range and unmaps it afterwards, so the
    pages it touched leave the process: resident memory stays one block, not
    the whole file.
    """

    def __init__(self, path: str, offset: int, shape: Sequence[int], dtype: np.dtype, *, fortran: bool = False):
        self._path = path
        self._offset = int(offset)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._fortran = fortran

    def _window(self, start: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
        if count == 0:
            return np.zeros(shape, self.dtype)
        mm = np.memmap(self._path, dtype=self.dtype, mode="r", offset=self._offset + start * self.dtype.itemsize,
                       shape=(count,))
        try:
            return np.array(mm).reshape(shape)
        finally:
            del mm

    def read(self, index: Index) -> np.ndarray:
        if self._fortran:
            # Logical C-order blocks are strided in a Fortran layout: map the
            # whole array for this block only, copy the block, unmap.
            mm = np.memmap(self._path, dtype=self.dtype, mode="r", offset=self._offset, shape=self.shape, order="F")
            try:
                return np.array(mm[index])
            finally:
                del mm
        start, sizes = block_span(index, self.shape)
        return self._window(start, math.prod(sizes), sizes)

    def storage_blocks(self, max_bytes: int) -> Iterator[np.ndarray]:
        if not self._fortran:
            yield from super().storage_blocks(max_bytes)
            return
        # Fortran data is the C-order data of the transposed shape.
        rev = self.shape[::-1]
        for index in plan_blocks(rev, max(1, max_bytes // self.dtype.itemsize)):
            start, sizes = block_span(index, rev)
            yield self._window(start, math.prod(sizes), sizes)
