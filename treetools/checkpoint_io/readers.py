"""Block readers: one stored array handed out in bounded blocks, never whole; and the memory budget.

Every format's leaves carry an ``ArrayReader``; ``--stats``, ``--show``,
``diff --values``, ``verify`` and ``load_parameters`` read arrays only
through it. ``plan_blocks`` tiles an array into blocks aligned to its storage
chunks, so no chunk is decoded twice.

The memory budget is the most stored data one read may decode at once (one
storage chunk, one ``--show`` slice). It travels explicitly, in the
``ReadContext`` a format gives every reader it makes (``ArrayReader.context``):
a worker thread reads the budget, and the storage it reads through, from the
reader it holds.
"""

from __future__ import annotations

import abc
import itertools
import math
import os
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from treetools.checkpoint_io.context import DEFAULT_BLOCK_BYTES, DEFAULT_MEMORY_BUDGET, ReadContext
from treetools.checkpoint_io.steps import read_json_file
from treetools.shared.errors import CheckpointError
from treetools.shared.rows import human

Index = tuple[slice, ...]

class MemoryBudgetError(CheckpointError):
    """A read that would decode more than the memory budget at once (not damage: raise the budget)."""


def check_budget(nbytes: int, *, where: str, what: str, budget: float,
                 fix: str = "--memory-budget (or TREETOOLS_MEMORY_BUDGET_MB)") -> None:
    """Refuse to decode ``nbytes`` at once when that is over ``budget`` (one line naming ``fix``: the flag, or
    the library's argument).

    >>> check_budget(10, where="w", what="one storage chunk", budget=2**31)
    >>> check_budget(2**50, where="ckpt/params: `w`", what="one storage chunk", budget=2**31)
    Traceback (most recent call last):
    treetools.checkpoint_io.readers.MemoryBudgetError: ckpt/params: `w`: one storage chunk decodes to 1024.00 TiB, over
    the memory budget of 2.00 GiB; raise it with --memory-budget (or TREETOOLS_MEMORY_BUDGET_MB) if the machine has
    the memory.
    """
    if nbytes > budget:
        raise MemoryBudgetError(
            f"{where}: {what} decodes to {human(nbytes, 'B')}, over the memory budget of {human(budget, 'B')}; "
            f"raise it with {fix} if the machine has the memory."
        )


MAX_ARRAY_BYTES = 2**60
"""The largest array (in bytes, and along any one dimension) a checkpoint's metadata may declare: 1 EiB, beyond
any real checkpoint, and far inside the int64 arithmetic numpy and TensorStore do on sizes."""


def _count(d: Any, i: int, *, where: str, what: str) -> int:
    """Entry ``i`` of a shape or an offset list read from metadata, as an int: an integer >= 0 (not a bool, not a
    float such as ``1e999``), else one ``CheckpointError`` naming ``where``, ``what`` and the entry."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
        shown = repr(d) if isinstance(d, (int, float, str, bool, type(None), np.integer)) else type(d).__name__
        raise CheckpointError(f"{where}: corrupt {what} (entry {i} is {shown[:40]}, not an integer >= 0); "
                              "the metadata is damaged or hostile.")
    return int(d)


def checked_shape(values: Any, *, where: str, itemsize: int = 1, what: str = "shape") -> tuple[int, ...]:
    """A shape (or chunk shape) read from a checkpoint's metadata, validated where it is parsed.

    Every entry must be an integer >= 0 (not a float such as ``1e999``, not a
    bool), and no dimension nor the whole array (times ``itemsize``) may exceed
    ``MAX_ARRAY_BYTES``: a hostile header then never reaches arithmetic that
    overflows (a rank-20 array of 2^62 per dimension, ``10**400``).

    Raises:
      CheckpointError: naming ``where`` and what is wrong.

    >>> checked_shape([2, 3], where="w.zarray")
    (2, 3)
    >>> checked_shape([1e999], where="w/.zarray")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    treetools.shared.errors.CheckpointError: w/.zarray: corrupt shape (entry 0 is inf, not an integer >= 0); ...
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise CheckpointError(f"{where}: corrupt {what} ({type(values).__name__}, not a list of integers); "
                              "the metadata is damaged or hostile.")
    out = []
    total = max(1, int(itemsize))
    for i, d in enumerate(values):
        d = _count(d, i, where=where, what=what)
        total *= d if d else 1
        if d > MAX_ARRAY_BYTES or total > MAX_ARRAY_BYTES:
            raise CheckpointError(f"{where}: {what} declares more than 2**60 bytes (1 EiB, rank {len(values)}); "
                                  "no checkpoint holds that: the metadata is damaged or hostile.")
        out.append(d)
    return tuple(out)


def checked_offsets(values: Any, *, where: str, count: int, limit: int, what: str = "offsets") -> tuple[int, ...]:
    """Byte offsets read from a checkpoint's header, each validated by itself and by the data it points into.

    Each of the ``count`` entries must be an integer in ``[0, limit]`` (``limit``: the most there can be;
    safetensors passes ``MAX_ARRAY_BYTES`` and names a file shorter than its offsets as truncated itself);
    offsets are never multiplied together, so a real file of any size passes
    (a shard of 10 GB holds offsets near 10**10, whose product is past 2**60).

    Raises:
      CheckpointError: naming ``where`` and what is wrong.

    >>> checked_offsets([4, 2**33], where="w", count=2, limit=2**34)
    (4, 8589934592)
    >>> checked_offsets([0, 2**40], where="m.safetensors: tensor 'w'", count=2, limit=100, what="data_offsets")
    Traceback (most recent call last):
    treetools.shared.errors.CheckpointError: m.safetensors: tensor 'w': corrupt data_offsets (entry 1 is
    1,099,511,627,776, more than the 100 bytes there can be); the file is damaged or hostile.
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or len(values) != count:
        raise CheckpointError(f"{where}: corrupt {what} ({repr(values)[:40]}, not a list of {count} integers); "
                              "the metadata is damaged or hostile.")
    out = []
    for i, d in enumerate(values):
        d = _count(d, i, where=where, what=what)
        if d > limit:
            raise CheckpointError(f"{where}: corrupt {what} (entry {i} is {d:,}, more than the {limit:,} bytes "
                                  "there can be); the file is damaged or hostile.")
        out.append(d)
    return tuple(out)


JSON_EXPANSION = 8
"""Bytes of Python objects one byte of JSON metadata becomes once parsed (measured: 7.3 for an Orbax _METADATA)."""


LEAF_BYTES = 2560
"""Bytes one listed array costs once read, whatever its size (its row, its reader, a table row or a JSON object,
its statistics): measured 1.7 KiB for a metadata ``inspect`` and 2.4 KiB for ``--stats`` of 144,000 zero-size
tensors. A header listing more arrays than the memory budget holds at this rate is refused before they are made."""


def check_leaf_count(count: int, *, where: str, budget: float) -> None:
    """Refuse a header listing ``count`` arrays when holding them (``LEAF_BYTES`` each) is over ``budget``.

    >>> check_leaf_count(144_000, where="z.safetensors", budget=64 * 2**20)
    Traceback (most recent call last):
    treetools.checkpoint_io.readers.MemoryBudgetError: z.safetensors: 144,000 arrays listed (about 2.5 KiB each once
    read) decodes to 351.56 MiB, over the memory budget of 64.00 MiB; raise it with --memory-budget (or
    TREETOOLS_MEMORY_BUDGET_MB) if the machine has the memory.
    """
    check_budget(LEAF_BYTES * count, where=where, what=f"{count:,} arrays listed (about 2.5 KiB each once read)",
                 budget=budget)


def read_metadata(context: ReadContext, path: str, *, what: str) -> Any:
    """Parse a JSON metadata file (``steps.read_json_file``), held to the memory budget by what it will hold.

    A metadata file is parsed whole: a 15 MB ``_METADATA`` of 100,000 leaves is
    110 MiB of Python objects. Refused before reading when that is over the budget.

    Raises:
      MemoryBudgetError: over the budget (one line naming the file and the flag).
      CheckpointError, CheckpointNotFoundError: as ``read_json_file``.
    """
    storage = context.storage
    try:
        size = storage.getsize(path)
    except OSError:
        size = 0  # read_json_file names what is wrong
    check_budget(JSON_EXPANSION * size, where=path, what=f"{what} ({size:,} bytes), parsed whole,",
                 budget=context.memory_budget)
    return read_json_file(storage, path, what=what)


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, when the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def np_dtype(name: str) -> np.dtype:
    """A numpy dtype by name, including ml_dtypes ones (``bfloat16``, ``float8_e4m3fn``).

    A name read from a checkpoint is held to plain element types: a structured
    or sub-array dtype (``"(1073741824,)f8"``: one element of 8 GiB) is refused.

    Raises:
      TypeError: not a name of a plain element type (the message shows at most 40 characters of it).
    """
    if not isinstance(name, str):
        raise TypeError(f"dtype {type(name).__name__}, not a type name")
    try:
        dtype = np.dtype(name)
    except TypeError:
        import ml_dtypes

        kind = getattr(ml_dtypes, name, None) if name.isidentifier() else None
        if not isinstance(kind, type):
            raise TypeError(f"data type {name[:40]!r} not understood") from None
        dtype = np.dtype(kind)
    if dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(f"data type {name[:40]!r} is structured, not an element type")
    return dtype


def is_numeric(dtype: Any) -> bool:
    """Whether statistics and value comparisons apply: bool, int, float, complex, ml_dtypes floats."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or (dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes"))


def bit_view(x: np.ndarray) -> np.ndarray:
    """``x``'s bit patterns, to compare exactly (NaN payloads, -0.0): one unsigned integer per element where
    one is as wide as an element, else its bytes (``size`` times as many entries as ``x``).

    >>> a, b = np.array([0.0, np.nan]), np.array([-0.0, np.nan])
    >>> (a == b).tolist(), (bit_view(a) == bit_view(b)).tolist()
    ([True, False], [False, True])
    """
    size = x.dtype.itemsize
    return x.view(f"u{size}") if size in (1, 2, 4, 8) else x.view(np.uint8)


def bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where two arrays of one dtype and shape are not bit-exact: a bool per element, C order (flat).

    Bit-exact, the one definition ``diff`` (``bit_identical``) and ``convert --verify`` use: the same dtype and,
    element by element, the same bytes. So NaNs with different payloads differ and two alike NaNs do not,
    ``-0.0`` differs from ``0.0``, and ``bfloat16`` or ``float8`` compare their own 2 or 1 bytes; an element wider
    than 8 bytes (``complex128``) differs where any of its bytes does.

    Raises:
      ValueError: the dtypes or shapes differ (cast one side first: ``convert`` compares a cast leaf with the
        same cast of its source).

    >>> bits_differ(np.array([0.0, np.nan, 1.0]), np.array([-0.0, np.nan, 1.0])).tolist()
    [True, False, False]
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"bit comparison of {a.dtype}{list(a.shape)} with {b.dtype}{list(b.shape)}: cast and "
                         "shape one side like the other first")
    bad = bit_view(np.ravel(a)) != bit_view(np.ravel(b))
    if bad.size != a.size:  # compared per byte: an element differs where any of its bytes does
        bad = np.any(bad.reshape(-1, a.dtype.itemsize), axis=1)
    return bad


def bit_identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are bit-exact (``bits_differ``): the same dtype and shape and every element's bytes the
    same; False for different dtypes or shapes.

    >>> bit_identical(np.array([np.nan]), np.array([np.nan])), bit_identical(np.zeros(1), -np.zeros(1))
    (True, False)
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return not bool(bits_differ(a, b).any())


class ArrayReader(abc.ABC):
    """Hands out one stored array in blocks; never the whole array at once.

    An abstract base: a subclass implements ``read(index)`` (random access),
    or derives from ``SequentialReader`` and implements ``blocks`` when the
    storage can only be streamed front to back. One that leaves its read out
    cannot be built (``TypeError``).
    """

    __slots__ = ()  # a subclass made by the hundred thousand (``FileReader``) may do without a ``__dict__``

    shape: tuple[int, ...]
    dtype: np.dtype
    context: ReadContext | None = None
    """How it reads (the memory budget, the block size) and through what storage: given by the format that
    makes it. None for an array already in memory."""
    chunk_shape: tuple[int, ...] | None = None
    sequential: bool = False
    """True when blocks must come in C order, front to back (a compressed zip member)."""
    storage_order: bool = False
    """True when ``storage_blocks`` reads faster than a block plan (Fortran-ordered data): statistics and
    verify read such a leaf in its own order, in one task."""
    c_order: bool = True
    """False when a sequential reader streams Fortran-ordered data."""
    remote: bool = False
    """True when blocks come from a bucket: reads wait on the network more than on a core."""

    @property
    def layout(self) -> tuple[int, ...] | None:
        """The box its reads are cheapest in: a stored chunk (``chunk_shape``), or, for data stored in C order with
        random access (a file, memory), a row (the first axis 1, the others whole: one contiguous run). A block made
        of whole such boxes reads each stored byte once. None where no box is (a front-to-back stream, Fortran
        order).

        >>> from treetools.checkpoint_io.readers import InMemoryReader
        >>> InMemoryReader(np.zeros((3, 4, 5))).layout
        (1, 4, 5)
        """
        if self.sequential or self.storage_order or not self.c_order:
            return None
        if self.chunk_shape is not None:
            return tuple(int(c) for c in self.chunk_shape)
        return (1, *(int(d) for d in self.shape[1:])) if len(self.shape) else ()

    @property
    def budget(self) -> float:
        """The most this reader decodes at once, in bytes (its context's memory budget)."""
        return self.context.memory_budget if self.context is not None else DEFAULT_MEMORY_BUDGET

    @property
    def block_bytes(self) -> int:
        """Bytes of stored data per block when it streams a whole array (its context's block size)."""
        return self.context.block_bytes if self.context is not None else DEFAULT_BLOCK_BYTES

    @abc.abstractmethod
    def read(self, index: Index) -> np.ndarray:
        """The block at ``index`` (a tuple of slices, one per axis) as a numpy array."""

    reads_async: bool = False
    """True when the reads ``reading`` begins run in the background (TensorStore decodes on its own threads)."""

    def reading(self) -> "Callable[[Index], Pending]":
        """A function that begins reading one block (``start(index).result()`` waits for it), for a series
        of blocks: a reader that reads asynchronously (``reads_async``) returns at once for each, so the
        blocks of several readers can be in flight together (both sides of a diff); by default each block
        is read when asked.
        """
        return lambda index: Ready(self.read(index))

    def blocks(self, plan: Iterable[Index]) -> Iterator[np.ndarray]:
        """The blocks of ``plan`` (index tuples of slices), in plan order."""
        for index in plan:
            yield self.read(index)

    def read_all(self) -> np.ndarray:
        """The whole array (``load_parameters``): one read where the storage allows random access."""
        if not self.sequential:
            return np.asarray(self.read(tuple(slice(None) for _ in self.shape)))
        if not math.prod(self.shape):
            return np.zeros(self.shape, self.dtype)
        flat = np.concatenate([np.ravel(b) for b in self.storage_blocks(self.block_bytes)])
        return flat.reshape(self.shape, order="C" if self.c_order else "F")

    def storage_blocks(self, max_bytes: int) -> Iterator[np.ndarray]:
        """Every element exactly once, in whatever order the storage reads fastest.

        Blocks are not in the array's logical layout when the storage is
        Fortran-ordered; statistics do not care.
        """
        return self.blocks(plan_blocks(self.shape, max(1, max_bytes // self.dtype.itemsize), self.chunk_shape))


class SequentialReader(ArrayReader):
    """An array its storage can only stream front to back (a compressed zip member): a subclass implements
    ``blocks`` for plans in C order (and may override ``storage_blocks``); it has no random access, so the
    engine reads it in one task, in order (``sequential``), and never calls ``read``."""

    __slots__ = ()
    sequential = True

    @abc.abstractmethod
    def blocks(self, plan: Iterable[Index]) -> Iterator[np.ndarray]:
        """The blocks of ``plan``, which must run front to back in C order."""

    def read(self, index: Index) -> np.ndarray:
        raise TypeError(f"{type(self).__name__} streams its array front to back (sequential): read it with "
                        "blocks() or read_all(), not read(index).")


class Pending(Protocol):
    """A block being read: ``result()`` waits for it (a ``concurrent.futures.Future`` is one)."""

    def result(self) -> np.ndarray: ...


class Ready:
    """A block already read."""

    def __init__(self, block: np.ndarray):
        self._block = block

    def result(self) -> np.ndarray:
        return self._block


def c_ordered(granule: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether blocks of whole ``granule`` boxes in C order are C-contiguous runs of ``shape``: the granule is 1 on
    the leading axes, then any size on one axis, then whole on every axis after it.

    >>> c_ordered((1, 4, 5), (3, 4, 5)), c_ordered((3, 1), (3, 4)), c_ordered((), ())
    (True, False, True)
    """
    g = [min(max(1, int(c)), int(n)) for c, n in zip(granule, shape)]
    k = next((i for i, c in enumerate(g) if c != 1), len(g))
    return all(c == int(n) for c, n in zip(g[k + 1:], list(shape)[k + 1:]))


def row_axis(sizes: Sequence[int], shape: Sequence[int]) -> int:
    """The axis where the rows of a block of ``sizes`` in ``shape`` end, each row one contiguous run of C-ordered
    data: the block's last partial axis (0 for a whole block).

    >>> row_axis((2, 3, 5), (4, 3, 5)), row_axis((4, 1, 5), (4, 3, 5)), row_axis((4, 3), (4, 3))
    (0, 1, 0)
    """
    return max((i for i, (n, full) in enumerate(zip(sizes, shape)) if n != full), default=0)


def row_firsts(starts: Sequence[int], sizes: Sequence[int], shape: Sequence[int], j: int) -> np.ndarray:
    """The flat element each row of the block at corner ``starts`` of ``sizes`` in C-ordered data of ``shape``
    starts at, rows in C order, a row running from axis ``j`` (``row_axis``) on.

    >>> row_firsts((1, 2), (2, 3), (4, 6), 1).tolist()
    [8, 14]
    """
    firsts = np.zeros(1, np.int64)
    for a, n, dim in zip(starts[:j], sizes[:j], shape[:j]):  # Horner: ((i0 * s1 + i1) * s2 + ...)
        firsts = (firsts[:, None] * int(dim) + np.arange(a, a + n, dtype=np.int64)).reshape(-1)
    return firsts * math.prod(shape[j:]) + (int(starts[j]) * math.prod(shape[j + 1:]) if j < len(shape) else 0)


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


class MissingReader(ArrayReader):
    """An array its file's header declares but whose bytes the file does not hold (a truncated download):
    listed with its shape and dtype, and every read of it is a one-line ``CheckpointError`` saying so.

    ``note`` is the file's one-line summary (the same object for every missing array of a file), shown once
    per file by the source that lists them (``missing_notes``).
    """

    __slots__ = ("shape", "dtype", "reason", "note")

    def __init__(self, shape: Sequence[int], dtype: np.dtype, *, reason: str, note: str):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.reason = reason
        self.note = note

    def read(self, index: Index) -> np.ndarray:
        raise CheckpointError(self.reason)


def missing_notes(readers: Iterable[Any]) -> list[str]:
    """One note per file that lacks data its header declares (``MissingReader.note``), in order."""
    return list(dict.fromkeys(r.note for r in readers if isinstance(r, MissingReader)))


SLAB_BYTES = 8 * 2**20
"""The most a raw-file reader reads at once to cut a non-contiguous block out of it (a scratch buffer, copied from
into the block and freed: what the block holds is its own elements only)."""

GAP_BYTES = 16 * 2**10
"""Bytes between two rows of a strided block over which a local file is read row by row (one ``preadv`` each,
only the block's bytes) rather than in slabs through the gaps (at most ``SLAB_BYTES`` and a block, then cut). Where
rows are closer, copying the gap costs less than a read call (measured on transposed TinyLlama leaves, rows of
8 KiB: slabs took 2.6 CPU s for the 1 GiB ``llama:hf:reference`` conversion where rows took 5.0 s, and 45 s where
rows took 99 s for 4 GiB of ``llama:hf:maxtext``). A bucket always reads slabs (a ranged GET costs far more than
the bytes it skips)."""


class FileReader(ArrayReader):
    """Raw array bytes at ``offset`` in a file (local or in a bucket), read one block at a time.

    Local blocks are read with ``os.preadv`` into a fresh buffer, not
    memory-mapped: a file truncated or rewritten under the reader gives a short
    read, which is a one-line ``CheckpointError``, where a mapping would kill the
    process with SIGBUS. Each read opens the file through the context's storage
    (``Storage.read_into``), so it must resolve inside the checkpoint it was
    found in. In a bucket each block is one ranged GET. Resident memory stays
    one block.

    ``segments`` stores the flat data in pieces at several places of the file
    (a Flax msgpack array over 1 GiB is saved as flat chunks): ``(file offset,
    elements)`` pairs, in order; by default one piece of all elements at ``offset``.
    """

    # Slots: a safetensors header may list 144,629 tensors, each a reader; a __dict__ each was 650 bytes.
    __slots__ = ("context", "_path", "_offset", "shape", "dtype", "_fortran", "_segments")
    context: ReadContext  # always given (ArrayReader's may be None)

    def __init__(self, context: ReadContext, path: str, offset: int, shape: Sequence[int], dtype: np.dtype, *,
                 fortran: bool = False, segments: Sequence[tuple[int, int]] | None = None):
        self.context = context
        self._path = path
        self._offset = int(offset)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._fortran = fortran
        pieces = segments if segments is not None else [(self._offset, math.prod(self.shape))]
        segs: list[tuple[int, int, int]] = []  # (first flat element, file offset, elements)
        first = 0
        for pos, count in pieces:
            segs.append((first, int(pos), int(count)))
            first += int(count)
        self._segments = tuple(segs)

    @property
    def _storage(self) -> Any:
        return self.context.storage

    @property
    def storage_order(self) -> bool:  # type: ignore[override]
        """Statistics read Fortran data in its own (transposed) order."""
        return self._fortran

    @property
    def remote(self) -> bool:  # type: ignore[override]
        return self.context.storage.remote

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Where the flat data lies: ``(file offset, elements)`` pairs, in order."""
        return [(offset, n) for _, offset, n in self._segments]

    def _fill(self, view: memoryview, pos: int) -> int:
        """Read into ``view`` from byte ``pos``; the number of bytes read (short at the end of the file)."""
        return self._storage.read_into(self._path, view, pos)

    def _pieces(self, start: int, count: int) -> Iterator[tuple[int, int, int]]:
        """Where ``count`` elements from flat element ``start`` lie: ``(first, last, file offset)`` runs of them,
        counted from ``start`` (one run unless the data is stored in segments)."""
        item = self.dtype.itemsize
        for first, offset, n in self._segments:
            lo, hi = max(start, first), min(start + count, first + n)
            if lo < hi:
                yield lo - start, hi - start, offset + (lo - first) * item

    def _fill_runs(self, runs: Iterable[tuple[memoryview, int]]) -> int:
        """Read each ``(view, pos)`` of ``runs`` in order (a local file: ``LocalStorage.read_runs``, the file opened
        once); how many were read whole. A subclass that reads elsewhere (its own ``_fill``) reads them one by one."""
        read_runs = getattr(self._storage, "read_runs", None)
        if type(self)._fill is FileReader._fill and read_runs is not None:
            return read_runs(self._path, runs)
        done = 0
        for view, pos in runs:
            if self._fill(view, pos) < len(view):
                break
            done += 1
        return done

    def _short(self, view: memoryview, pos: int) -> CheckpointError:
        got = self._fill(view, pos)
        return CheckpointError(f"{self._path}: the file ended at byte {pos + got:,}, before the data its header "
                               "promises; it is truncated, or changed while being read.")

    def _window_into(self, out: np.ndarray, start: int) -> None:
        """``out.size`` elements from flat element ``start`` into ``out`` (C-contiguous)."""
        view = out.reshape(-1).view(np.uint8).data  # not out.data: ml_dtypes (bfloat16...) have no buffer format
        item = self.dtype.itemsize
        for lo, hi, pos in self._pieces(start, out.size):
            part = view[lo * item:hi * item]
            if self._fill(part, pos) < len(part):
                raise self._short(part, pos)

    def _window(self, start: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
        """``count`` elements from flat element ``start``, as ``shape``."""
        out = np.empty(count, self.dtype)
        if count:
            self._window_into(out, start)
        return out.reshape(shape)

    def _region(self, starts: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        """The block at corner ``starts`` of ``sizes`` in C-ordered data of ``shape``, in a fresh array."""
        out = np.empty(sizes, self.dtype)
        if out.size:
            self._region_into(out, starts, shape)
        return out

    def _region_into(self, out: np.ndarray, starts: tuple[int, ...], shape: tuple[int, ...]) -> None:
        """Read the block at corner ``starts`` of ``out.shape`` (``out``: C-contiguous) into ``out``.

        One contiguous read when the block is a run of the flat data. Else,
        from a local file whose rows of the block lie more than ``GAP_BYTES``
        apart, one read per row of the block straight into ``out`` (a column
        band of a tall leaf, which a transposed leaf reads: only its own bytes
        are read). Else the block is read in slabs: whole rows of its first
        partial axis, up to ``SLAB_BYTES`` at a time into a scratch buffer (a
        column slice of a tall leaf is a few large reads, not one read per
        row: one ranged GET each in a bucket), then cut into ``out``. What is
        held beyond ``out`` is one slab at most; no read is larger than the block size (``block_bytes``) or a
        row, whichever is larger.
        """
        sizes, nd = out.shape, len(shape)
        k = 0  # leading axes of size one, then the first axis that may be partial
        while k < nd and sizes[k] == 1:
            k += 1
        if k == nd or all(sizes[j] == shape[j] for j in range(k + 1, nd)):
            self._window_into(out, int(np.ravel_multi_index(starts, shape)) if nd else 0)
            return
        j = row_axis(sizes, shape)  # the last partial axis: rows of the block end there
        inner = math.prod(shape[j + 1:])
        if (shape[j] - sizes[j]) * inner * self.dtype.itemsize > GAP_BYTES and not self.remote:
            self._rows_into(out, starts, shape, j)
            return
        row = math.prod(shape[k + 1:]) * self.dtype.itemsize  # one step along axis k, whole trailing axes
        group = max(1, min(SLAB_BYTES, self.block_bytes) // row)
        if group >= sizes[k]:  # the slab of all the block's rows fits: one contiguous read, then cut
            slab = self._region(starts[:k + 1] + (0,) * (nd - k - 1), sizes[:k + 1] + shape[k + 1:], shape)
            out[...] = slab[(slice(None),) * (k + 1) + tuple(slice(a, a + n) for a, n in zip(starts[k + 1:],
                                                                                          sizes[k + 1:]))]
            return
        for i in range(0, sizes[k], group):  # out[..., i:i + group, ...] is contiguous: the axes before k are one
            part = out[(slice(None),) * k + (slice(i, min(i + group, sizes[k])),)]
            self._region_into(part, starts[:k] + (starts[k] + i,) + starts[k + 1:], shape)

    def _rows_into(self, out: np.ndarray, starts: tuple[int, ...], shape: tuple[int, ...], j: int) -> None:
        """The block's rows (contiguous runs ending at its last partial axis ``j``), one read each, into ``out``."""
        run = out.shape[j] * math.prod(shape[j + 1:])
        firsts = row_firsts(starts, out.shape, shape, j)
        view = out.reshape(-1).view(np.uint8).data
        item, step = self.dtype.itemsize, run * self.dtype.itemsize

        def runs() -> Iterator[tuple[memoryview, int]]:  # made as read: a list of 100,000 views is 20 MB
            for r, first in enumerate(firsts.tolist()):
                for lo, hi, pos in self._pieces(first, run):
                    yield view[r * step + lo * item:r * step + hi * item], pos

        done = self._fill_runs(runs())
        for i, (part, pos) in enumerate(runs()):
            if i == done:
                raise self._short(part, pos)

    def read(self, index: Index) -> np.ndarray:
        if self._fortran:
            # Fortran data is the C-order data of the transposed shape: read the transposed block.
            starts, sizes = block_extent(index, self.shape)
            return self._region(starts[::-1], sizes[::-1], self.shape[::-1]).T
        starts, sizes = block_extent(index, self.shape)
        return self._region(starts, sizes, self.shape)

    def storage_blocks(self, max_bytes: int) -> Iterator[np.ndarray]:
        if not self._fortran:
            yield from super().storage_blocks(max_bytes)
            return
        # Fortran data is the C-order data of the transposed shape.
        rev = self.shape[::-1]
        for index in plan_blocks(rev, max(1, max_bytes // self.dtype.itemsize)):
            start, sizes = block_span(index, rev)
            yield self._window(start, math.prod(sizes), sizes)
