"""The block engine: every block of many stored arrays read once, on all cores, with bounded blocks in flight.

Every command that reads all of a checkpoint's data goes through here:
``inspect --stats``, ``diff --values`` (both sides of a leaf, block by block),
``verify``, ``convert``, ``load_parameters`` and ``restore_checkpoint``. Four ways in, one scheduler:

* ``reduce_blocks(jobs, start, fold)``: each job is a tuple of readers of one
  shape read with one block plan (one leaf for statistics and verify; the two
  sides of a leaf for a diff). The plan is cut into tasks of a few blocks;
  worker threads take tasks, read the task's blocks of every reader of the job
  (TensorStore reads them in parallel: each reader has its next block in
  flight while the current one is used) and ``fold`` them into a partial
  result per task. Partials come back per job in block order, so a result never
  depends on timing or on the number of threads.
* ``stream_blocks(readers)``: every block of every reader, in reader order and
  in plan order within a reader (C order: what a writer appends), read ahead on
  the worker threads with at most ``window`` blocks read and not yet consumed.
* ``read_arrays(readers)``: whole arrays (``load_parameters``), read in
  parallel, handed back in order.

Memory: a worker holds the blocks of its current task only (a TensorStore
reader one block ahead), so ``reduce_blocks`` peaks at about
``2 * readers per job * workers * block_bytes`` plus one storage chunk per
read in flight; ``stream_blocks`` at ``window + workers`` blocks, or two
stripes of whole stored chunks where one is larger (each within the memory
budget). Tasks carry indices, never data.

A fourth way in, ``read_regions(regions, then)``, is the restore's: each
region (one device's block of a leaf) read whole, once, in blocks of at most
``block_bytes`` on the worker threads, read ahead, and handed in order to
``then`` (which places it on its devices) in the calling thread.

Threads: numpy's ufuncs, TensorStore's decoding and file reads release the
GIL, so threads scale with cores. ``TREETOOLS_WORKERS`` sets the default
number of threads (else the cores this process may run on, ``taskset`` aware);
reads from a bucket use at least ``REMOTE_WORKERS`` (they wait on round trips,
not on a core).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

import numpy as np

from treetools.checkpoint_io.readers import (ArrayReader, Index, MemoryBudgetError, block_extent, check_budget,
                                             c_ordered, plan_blocks)
from treetools.checkpoint_io.share import Share, owners, pool

GROUP_BLOCKS = 4
"""Blocks of one job per task: enough to amortize opening a store, few enough to spread a big leaf over threads."""

REMOTE_WORKERS = 16
"""Threads when a reader reads from a bucket: round trips overlap (memory ~ 2 * 16 * block_bytes)."""

_A = TypeVar("_A")
_R = TypeVar("_R")


class Progress(Protocol):
    """What the engine reports to: ``treetools.checkpoint_tools.progress.Progress`` or anything with these two methods."""

    def start(self, label: str) -> None: ...

    def advance(self, nbytes: int) -> None: ...


def cores() -> int:
    """The cores this process may run on (``taskset`` and cgroup cpusets respected where the OS says)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


SMALL_BYTES = 16 * 2**20
"""Below this much data in all, one thread reads it: starting threads would cost more than they save."""


def _nbytes(readers: Iterable[ArrayReader]) -> int:
    return sum(math.prod(r.shape) * r.dtype.itemsize for r in readers)


def given_workers(readers: Iterable[ArrayReader]) -> int | None:
    """The threads the readers' context asks for (``ReadContext.workers``, ``TREETOOLS_WORKERS``), None if none."""
    return next((r.context.workers for r in readers if r.context is not None and r.context.workers), None)


def given_share(readers: Iterable[ArrayReader]) -> Share | None:
    """The share of a run of several processes the readers' context says this process has (None: alone)."""
    return next((r.context.share for r in readers if r.context is not None and r.context.share is not None), None)


def default_workers(readers: Iterable[ArrayReader] = ()) -> int:
    """Threads for reading ``readers``: their context's ``workers`` or the cores; at least ``REMOTE_WORKERS`` for
    a bucket.

    (More threads than cores for TensorStore, which decodes on threads of its own, measured 3-5% faster on
    2 cores and 20 MiB more peak memory for blocks: not taken; ``read_arrays``, whose arrays are the result,
    takes it.)
    """
    readers = list(readers)
    n = given_workers(readers) or cores()
    if any(r.remote for r in readers):
        n = max(n, REMOTE_WORKERS)
    return n


def ordered_map(fn: Callable[[Any], _R], items: Iterable[Any], *, workers: int, window: float = math.inf,
                cost: Callable[[Any], float] | None = None, name: str = "treetools-read") -> Iterator[_R]:
    """``fn(item)`` for every item on ``workers`` threads, yielded in item order.

    At most ``window`` items (with ``cost``: items whose costs add up to at
    most ``window``, and always at least one) are submitted and not yet
    yielded: the bound on results held in memory. The next items are submitted
    as soon as the oldest result is taken. An exception of ``fn`` is raised in
    the caller when its item's turn comes; items not started by then are
    cancelled. With one worker, everything runs in the caller's thread.

    >>> list(ordered_map(lambda x: x * x, range(5), workers=3, window=2))
    [0, 1, 4, 9, 16]
    >>> list(ordered_map(lambda x: -x, [1, 5, 2], workers=2, window=4, cost=float))  # 5 alone: over the window
    [-1, -5, -2]
    """
    it = iter(items)
    if workers <= 1:
        for item in it:
            yield fn(item)
        return
    weigh = cost if cost is not None else (lambda item: 1)
    end = object()
    ahead = next(it, end)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    pending: collections.deque = collections.deque()
    held = 0.0

    def top_up() -> None:
        nonlocal ahead, held
        while ahead is not end and (not pending or held + weigh(ahead) <= window):
            pending.append((pool.submit(fn, ahead), weigh(ahead)))
            held += pending[-1][1]
            ahead = next(it, end)

    try:
        top_up()
        while pending:
            future, c = pending.popleft()
            result = future.result()
            held -= c
            top_up()
            yield result
    finally:
        for future, _ in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------- block plans and tasks


def own_order(reader: ArrayReader) -> bool:
    """Whether ``reader`` is fastest read in its own storage order (``storage_blocks``) rather than by a plan."""
    return reader.sequential or reader.storage_order


def job_plan(readers: Sequence[ArrayReader], block_bytes: int, *, contiguous: bool = False) -> list[Index]:
    """The one block plan every reader of a job follows: aligned to the first reader's storage chunks.

    A reader that streams front to back (a compressed zip member) needs
    C-contiguous runs; so does ``contiguous`` (a writer appending bytes). Then
    blocks are stripes: whole bands of chunk rows along the first axis, every
    other axis whole. Such a stripe covers whole stored chunks and is one
    C-contiguous run, so each chunk is decoded once; a stripe is larger than
    ``block_bytes`` where one band of chunk rows is (an Orbax leaf stored as
    one chunk is one stripe), and the caller cuts it (``stream_blocks``). Only
    where one band is over the readers' memory budget are blocks plain
    C-contiguous runs across chunks (each such chunk is then decoded once per
    block that touches it).

    >>> from treetools.checkpoint_io.readers import InMemoryReader
    >>> r = InMemoryReader(np.zeros((8, 4), np.float32)); r.chunk_shape = (8, 4)
    >>> [ix[0] for ix in job_plan((r,), 32, contiguous=True)], len(job_plan((r,), 32))
    ([slice(0, 8, None)], 1)
    """
    first = readers[0]
    shape = tuple(first.shape)
    itemsize = max(r.dtype.itemsize for r in readers)
    max_elems = max(1, block_bytes // itemsize)
    if any(r.sequential for r in readers):
        return list(plan_blocks(shape, max_elems))
    granule = first.chunk_shape
    if contiguous and granule and shape:
        band = min(max(1, int(granule[0])), shape[0]) * math.prod(shape[1:])
        fits = band <= max_elems or band * itemsize <= min(r.budget for r in readers)
        granule = (granule[0],) + tuple(shape[1:]) if fits else None
    return list(plan_blocks(shape, max_elems, granule))


def box_plan(reader: ArrayReader, block_bytes: int, *, whole_chunks: bool = False) -> list[Index] | None:
    """For a writer of boxes (one with random access into its output: Orbax's chunks, a local file): blocks of
    whole ``reader.layout`` boxes, each at most ``block_bytes``, where C-order blocks would cross those boxes;
    else None (C order costs no more). Such boxes are stored chunks that are not C-ordered runs (a C-order block
    would decode each chunk it cuts, or read a stripe of them up to the memory budget), or a file's rows moved by
    rules (a transpose: each C-order block is a column band that reads a piece of every source row; blocks of
    whole source rows read each byte once). None too where one box is over ``block_bytes``, unless
    ``whole_chunks`` and the box is a stored chunk: then each block is one chunk (TensorStore decodes a chunk whole
    anyway; a stripe would hold a band of them), for a writer whose blocks need not fit a block. The blocks tile
    the leaf on a grid: every block has the first one's shape, cut at the leaf's end.

    >>> from treetools.checkpoint_io.readers import InMemoryReader
    >>> box_plan(InMemoryReader(np.zeros((4, 6))), 48) is None
    True
    >>> r = InMemoryReader(np.zeros((4, 6))); r.chunk_shape = (4, 2)
    >>> [tuple((s.start, s.stop) for s in ix) for ix in box_plan(r, 64)]
    [((0, 4), (0, 2)), ((0, 4), (2, 4)), ((0, 4), (4, 6))]
    """
    shape = tuple(int(d) for d in reader.shape)
    layout = reader.layout
    if layout is None or len(layout) != len(shape) or not math.prod(shape) or c_ordered(layout, shape):
        return None
    max_elems = max(1, block_bytes // reader.dtype.itemsize)
    plan = list(plan_blocks(shape, max_elems, layout))
    fits = math.prod(block_extent(plan[0], shape)[1]) <= max_elems
    return plan if fits or (whole_chunks and reader.chunk_shape is not None) else None


def _cut(index: Index, block: np.ndarray, shape: Sequence[int], max_elems: int
         ) -> Iterator[tuple[Index, np.ndarray]]:
    """A block read at ``index`` of an array of ``shape``, as C-ordered pieces of at most ``max_elems`` (views).

    >>> [(ix, b.tolist()) for ix, b in _cut((slice(2, 4),), np.array([5, 6]), (6,), 1)]
    [((slice(2, 3, None),), [5]), ((slice(3, 4, None),), [6])]
    """
    if block.size <= max_elems:
        yield index, block
        return
    corner, _ = block_extent(index, shape)
    for local in plan_blocks(block.shape, max_elems):
        moved = tuple(slice(c + a, c + b) for c, (a, b, _) in
                      zip(corner, (s.indices(n) for s, n in zip(local, block.shape))))
        yield moved, block[local]


@dataclasses.dataclass(frozen=True)
class Task:
    """Some blocks of one job: ``plan`` (index tuples), or None for the reader's own storage order (all of it)."""

    job: int
    plan: tuple[Index, ...] | None


def plan_tasks(jobs: Sequence[Sequence[ArrayReader]], block_bytes: int, *,
               group: int = GROUP_BLOCKS) -> list[Task]:
    """Tasks covering every block of every job once; the largest jobs first (so no big leaf starts last).

    A job of one reader that has its own storage order (a compressed npz
    member, Fortran-ordered data) is one task read in that order; any other
    job is cut into tasks of ``group`` blocks of its ``job_plan``.
    """
    sizes = [math.prod(readers[0].shape) * max(r.dtype.itemsize for r in readers) * len(readers) for readers in jobs]
    tasks: list[Task] = []
    for j in sorted(range(len(jobs)), key=lambda j: -sizes[j]):
        readers = jobs[j]
        if len(readers) == 1 and own_order(readers[0]):
            tasks.append(Task(j, None))
            continue
        plan = job_plan(readers, block_bytes)
        if any(r.sequential for r in readers):
            tasks.append(Task(j, tuple(plan)))
            continue
        tasks.extend(Task(j, tuple(plan[a:a + group])) for a in range(0, len(plan), group))
    return tasks


def task_blocks(readers: Sequence[ArrayReader], task: Task, block_bytes: int, io: ThreadPoolExecutor | None = None
                ) -> Iterator[tuple[Index | None, tuple[np.ndarray, ...]]]:
    """``(index, blocks)`` of one task: the block ``index`` of each reader, read side by side.

    With several readers (the two sides of a diff) every side's read of a
    block is in flight before any is waited for: TensorStore's own reads
    return at once (``ArrayReader.reading``; the next block's are issued too),
    other readers read the first side in this thread and the others on
    ``io``'s threads. One reader reads ahead by itself (TensorStore) or not at
    all. ``index`` is None in a reader's own storage order.
    """
    if task.plan is None:
        for block in readers[0].storage_blocks(block_bytes):
            yield None, (block,)
        return
    if len(readers) > 1 and not any(r.sequential for r in readers):
        yield from _side_by_side(readers, task.plan, io)
        return
    streams = [r.blocks(task.plan) for r in readers]
    try:
        # Not zip(): a zip reuses its result tuple, which holds the last blocks while the next are read (two
        # blocks per thread, not one); nor a loop variable kept over the yield, for the same reason.
        for index in task.plan:
            blocks = tuple(next(s) for s in streams)
            yield index, blocks
            del blocks
    finally:
        for s in streams:
            close = getattr(s, "close", None)
            if close is not None:
                close()


def _side_by_side(readers: Sequence[ArrayReader], plan: Sequence[Index], io: ThreadPoolExecutor | None
                  ) -> Iterator[tuple[Index, tuple[np.ndarray, ...]]]:
    starts: list[Callable[[Index], Any]] = []
    try:
        if all(r.reads_async for r in readers) or io is None:  # TensorStore: this block and the next in flight
            starts += [r.reading() for r in readers]
            pending = [start(plan[0]) for start in starts]
            for i, index in enumerate(plan):
                ahead = [start(plan[i + 1]) for start in starts] if i + 1 < len(plan) else []
                blocks = tuple(p.result() for p in pending)
                pending = ahead  # this block and the next in flight, never the one before
                yield index, blocks
                del blocks
            return
        # Readers that read when asked (files): the first side here, the others on helper threads, at once.
        starts += [r.reading() if r.reads_async else functools.partial(io.submit, r.read)  # type: ignore[call-arg]
                   for r in readers[1:]]  # (mypy reads a partial of Executor.submit as missing its function)
        for index in plan:
            others = [start(index) for start in starts]
            first = readers[0].read(index)
            blocks = (first, *(p.result() for p in others))
            del first, others  # held over the yield, these would keep this block alive while the next is read
            yield index, blocks
            del blocks
    finally:
        for start in starts:  # a reader's open store (TensorStore: and the folders pinned for it)
            close = getattr(start, "close", None)
            if close is not None:
                close()


# ---------------------------------------------------------------------------- the three ways in


@dataclasses.dataclass
class Failed:
    """A job whose read raised one of the ``errors`` given to ``reduce_blocks``; its other tasks were skipped."""

    error: BaseException


def completed(part: list[_A] | Failed) -> list[_A]:
    """One job's result of a ``reduce_blocks`` given no ``errors``, where a failure propagates and no job is
    ``Failed``: its partials (a ``Failed`` raises its error)."""
    if isinstance(part, Failed):
        raise part.error
    return part


def reduce_blocks(jobs: Sequence[Sequence[ArrayReader]], start: Callable[[int], _A],
                  fold: Callable[[_A, Index | None, tuple[np.ndarray, ...]], None], *,
                  block_bytes: int, workers: int | None = None, progress: Progress | None = None,
                  labels: Sequence[str] | None = None,
                  errors: tuple[type[BaseException], ...] = (), share: Share | None = None
                  ) -> list[list[_A] | Failed]:
    """Fold every block of every job into partial results, on all cores; per job, its partials in block order.

    Args:
      jobs: tuples of readers of one shape, read with one plan (``job_plan``).
      start: job number -> a fresh partial result (one per task).
      fold: ``fold(partial, index, blocks)`` adds one block of each reader of the job (``index`` is None
        in a reader's own storage order).
      block_bytes: bytes of stored data per block and reader.
      workers: threads (default ``default_workers``, or 1 below ``SMALL_BYTES`` of data); 1 runs in this thread.
      progress: advanced by each block's stored bytes (every reader's), started with ``labels[job]``.
      errors: exceptions that fail one job, not the call: that job's result is ``Failed`` and its
        remaining tasks are skipped. Others propagate (the first in task order), and so does a
        ``MemoryBudgetError`` always: it is no damage of one leaf but a flag to raise.
      share: this process's share of a run of several (default: the readers' context's, else alone): it reads
        the jobs ``treetools.checkpoint_io.share.owners`` gives it, and the results of all are pooled, so every process
        returns what one process alone returns.

    Returns:
      Per job: its partials in block order, or ``Failed``.

    >>> from treetools.checkpoint_io.readers import InMemoryReader
    >>> parts = reduce_blocks([(InMemoryReader(np.arange(10.0)),)], lambda j: [], lambda acc, ix, bs: acc.append(
    ...     float(bs[0].sum())), block_bytes=32, workers=2)
    >>> [sum(map(sum, p)) for p in parts]
    [45.0]
    """
    every = [r for readers in jobs for r in readers]
    if share is None:
        share = given_share(every)
    if share is not None and share.count > 1:
        return _shared(share, jobs, start, fold, block_bytes=block_bytes, workers=workers, progress=progress,
                       labels=labels, errors=errors)
    if workers is None:
        workers = default_workers(every) if _nbytes(every) >= SMALL_BYTES or any(r.remote for r in every) else 1
    tasks = plan_tasks(jobs, block_bytes)
    # Helper threads read the sides of a job side by side where a reader cannot read in the background.
    sides = any(len(readers) > 1 and not all(r.reads_async for r in readers) for readers in jobs)
    io = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="treetools-io") if sides else None
    failed: set[int] = set()
    started: set[int] = set()
    lock = threading.Lock()

    def run(task: Task) -> Any:
        if task.job in failed:
            return None
        readers = jobs[task.job]
        _announce(progress, labels, task.job, started, lock)
        partial = start(task.job)
        try:
            for index, blocks in task_blocks(readers, task, block_bytes, io):
                fold(partial, index, blocks)
                if progress is not None:
                    progress.advance(sum(b.size * b.dtype.itemsize for b in blocks))
                del blocks
        except errors as e:
            if isinstance(e, MemoryBudgetError):
                raise
            failed.add(task.job)
            return Failed(e)
        return partial

    try:
        return _gather(len(jobs), tasks, ordered_map(run, tasks, workers=min(workers, max(1, len(tasks)))))
    finally:
        if io is not None:
            io.shutdown(wait=True, cancel_futures=True)


def _announce(progress: Progress | None, labels: Sequence[str] | None, job: int, started: set[int],
              lock: threading.Lock) -> None:
    """``reduce_blocks``: start ``progress`` with the label of ``job`` at its first task."""
    if progress is None or labels is None:
        return
    with lock:
        if job not in started:
            started.add(job)
            progress.start(labels[job])


def _gather(n_jobs: int, tasks: Sequence[Task], parts: Iterable[Any]) -> list[Any]:
    """``reduce_blocks``' result: per job, the partials of its tasks (``parts``, in task order), or its ``Failed``.

    Tasks ran largest job first; within a job they ran (and are collected) in block order."""
    out: list[Any] = [[] for _ in range(n_jobs)]
    for task, part in zip(tasks, parts):
        if isinstance(out[task.job], Failed):
            continue
        if isinstance(part, Failed):
            out[task.job] = part
        elif part is not None:
            out[task.job].append(part)
    return out


def _shared(share: Share, jobs: Sequence[Sequence[ArrayReader]], start: Callable[[int], _A],
            fold: Callable[[_A, Index | None, tuple[np.ndarray, ...]], None], **kwargs: Any
            ) -> list[list[_A] | Failed]:
    """``reduce_blocks`` as one of ``share.count`` processes: the jobs ``owners`` gives this process, read as
    one process reads them (the same plan, tasks and merge order), then every process's results pooled: each
    process returns what one process alone would have."""
    sizes = [math.prod(readers[0].shape) * max(r.dtype.itemsize for r in readers) * len(readers) for readers in jobs]
    mine = [j for j, p in enumerate(owners(sizes, share.count)) if p == share.index]
    labels = kwargs.pop("labels", None)
    try:
        got = reduce_blocks([jobs[j] for j in mine], lambda i: start(mine[i]), fold, share=_ALONE,
                            labels=[labels[j] for j in mine] if labels is not None else None, **kwargs)
        mine_done: Any = dict(zip(mine, got))
    except Exception as e:  # raised everywhere after the pooling: the others must not wait for this process
        mine_done = e
    out: list[Any] = [None] * len(jobs)
    for found in pool(share, mine_done):
        if isinstance(found, Exception):
            raise found
        for j, result in found.items():
            out[j] = result
    missing = [j for j, result in enumerate(out) if result is None]
    if missing:
        raise RuntimeError(f"{len(missing)} job(s) read by no process of {share.count}: the processes disagree "
                           "about the checkpoint (each must read the same one)")
    return out


class _Alone:
    """The share of a process that reads everything itself (what ``_shared`` reads its own jobs with)."""

    index, count = 0, 1

    def allgather(self, payload: bytes) -> list[bytes]:
        return [payload]


_ALONE = _Alone()


def stream_blocks(readers: Sequence[ArrayReader], *, block_bytes: int, workers: int | None = None,
                  window: int | None = None, contiguous: bool = True, progress: Progress | None = None,
                  plans: Sequence[Sequence[Index] | None] | None = None) -> Iterator[tuple[int, Index, np.ndarray]]:
    """Every block of every reader as ``(reader number, index, block)``: readers in order, blocks in plan order.

    What a writer consumes (``convert``): with ``contiguous`` each block is a
    C-contiguous run of its array's elements, blocks in C order, so appending
    them writes the array. Reads follow ``job_plan``'s stripes (whole stored
    chunks, so each is decoded once) and a stripe over ``block_bytes`` is
    handed out cut into C-ordered pieces of at most ``block_bytes``. Reads
    run ahead on ``workers`` threads, at most ``window`` (default
    ``2 * workers``) blocks' worth of bytes read and not yet consumed, or one
    stripe when a stripe is larger: memory stays about
    ``(window + workers) * block_bytes``, or two stripes (one being consumed,
    the next read), each within the memory budget. A reader that streams
    front to back (a compressed npz member) is read in this thread when its
    turn comes. ``plans`` gives a reader's blocks instead of ``job_plan``
    (a writer of boxes: ``treetools.checkpoint_io.writers.orbax``); each such
    block comes whole.

    >>> from treetools.checkpoint_io.readers import InMemoryReader
    >>> [(i, b.tolist()) for i, _, b in stream_blocks([InMemoryReader(np.arange(3)), InMemoryReader(np.ones(2))],
    ...                                                block_bytes=16, workers=2)]
    [(0, [0, 1]), (0, [2]), (1, [1.0, 1.0])]
    """
    if workers is None:
        workers = default_workers(readers)
    window = window if window is not None else 2 * workers
    units: list[tuple[int, Index | None]] = []
    for_reader: dict[int, list[Index]] = {}
    whole: set[int] = set()
    for i, r in enumerate(readers):
        given = plans[i] if plans is not None and not r.sequential else None
        if given is not None:
            whole.add(i)
        for_reader[i] = list(given) if given is not None else job_plan((r,), block_bytes, contiguous=contiguous)
        if r.sequential:
            units.append((i, None))
        else:
            units.extend((i, index) for index in for_reader[i])

    def fetch(unit: tuple[int, Index | None]) -> np.ndarray | None:
        i, index = unit
        if index is None:
            return None  # streamed in order by the consumer
        return np.asarray(readers[i].read(index))

    def cost(unit: tuple[int, Index | None]) -> float:
        i, index = unit
        if index is None:
            return 0.0
        return math.prod(block_extent(index, readers[i].shape)[1]) * readers[i].dtype.itemsize

    workers = min(workers, max(1, len(units)))  # one block (a small leaf): read here, no threads started
    fetched = ordered_map(fetch, units, workers=workers, window=window * max(1, block_bytes), cost=cost)
    # Not zip(units, fetched), and no piece kept past its yield: a zip's reused result tuple, or the loop variable
    # of the last piece (a view of its stripe), would hold each stripe while the next is read.
    for i, index in units:
        block = next(fetched)
        if index is not None and block is not None:  # fetched: a block for each index, None when streamed
            max_elems = max(1, block_bytes // block.dtype.itemsize) if contiguous and i not in whole else block.size
            for ix, piece in _cut(index, block, readers[i].shape, max_elems):
                if progress is not None:
                    progress.advance(piece.size * piece.dtype.itemsize)
                yield i, ix, piece
                del piece
            del block
            continue
        for ix, b in zip(for_reader[i], readers[i].blocks(for_reader[i])):
            if progress is not None:
                progress.advance(b.size * b.dtype.itemsize)
            yield i, ix, b


def read_arrays(readers: Sequence[ArrayReader], *, workers: int | None = None) -> Iterator[np.ndarray]:
    """Each reader's whole array (``ArrayReader.read_all``), read in parallel, yielded in reader order.

    ``workers`` defaults to ``default_workers``, doubled for TensorStore readers (their reads wait on
    TensorStore's own threads). At most ``2 * workers`` arrays are read ahead of the one yielded.
    """
    if workers is None:
        small = _nbytes(readers) < SMALL_BYTES and not any(r.remote for r in readers)
        workers = 1 if small else default_workers(readers)
        if not small and readers and all(r.reads_async for r in readers):
            # TensorStore decodes on threads of its own and ours only wait: two whole-array reads in flight per
            # reading thread keep its threads busy between arrays (measured 0.58 -> 0.50 s for 512 MiB of zstd
            # Orbax on 2 cores). Whole arrays are the result, so no block is held beyond it. The same whether the
            # threads are the cores or given (TREETOOLS_WORKERS): setting it to the cores changes nothing.
            workers *= 2
    return ordered_map(lambda r: r.read_all(), readers, workers=min(workers, max(1, len(readers))),
                       window=2 * workers)


# ---------------------------------------------------------------------------- regions: one device's block each


def region_plan(reader: ArrayReader, index: Index, block_bytes: int) -> list[tuple[Index, Index]]:
    """The reads of one region of ``reader`` (``index``: one device's block): ``(index in the array, index in the
    region)`` pairs of at most ``block_bytes`` each, or one stored chunk where a chunk is larger (a block never
    splits a chunk), tiling the region in C order.

    >>> from treetools.checkpoint_io.readers import InMemoryReader
    >>> r = InMemoryReader(np.zeros((8, 4), np.float32))
    >>> [(a[0], b[0]) for a, b in region_plan(r, (slice(2, 6), slice(None)), 32)]
    [(slice(2, 4, None), slice(0, 2, None)), (slice(4, 6, None), slice(2, 4, None))]
    """
    corner, sizes = block_extent(index, reader.shape)
    whole = tuple(slice(a, a + n) for a, n in zip(corner, sizes))
    if math.prod(sizes) * reader.dtype.itemsize <= block_bytes:
        return [(whole, tuple(slice(0, n) for n in sizes))]
    out = []
    for local in plan_blocks(sizes, max(1, block_bytes // reader.dtype.itemsize), reader.chunk_shape):
        spans = [s.indices(n)[:2] for s, n in zip(local, sizes)]
        out.append((tuple(slice(c + a, c + b) for c, (a, b) in zip(corner, spans)),
                    tuple(slice(a, b) for a, b in spans)))
    return out


def _region(reader: ArrayReader, index: Index, block_bytes: int) -> np.ndarray:
    """One region read whole, in the reads ``region_plan`` gives (TensorStore: the next read in flight)."""
    plan = region_plan(reader, index, block_bytes)
    if len(plan) == 1:
        return np.asarray(reader.read(plan[0][0]))
    out = np.empty(block_extent(index, reader.shape)[1], reader.dtype)
    for (_, local), block in zip(plan, reader.blocks([ix for ix, _ in plan])):
        out[local] = block
        del block
    return out


def read_regions(regions: Sequence[tuple[ArrayReader, Index]], then: Callable[[int, np.ndarray], _R], *,
                 block_bytes: int, budget: float, workers: int | None = None,
                 names: Sequence[str] | None = None) -> Iterator[tuple[int, _R]]:
    """Each region (a reader and an index: the block one device holds) read once and handed to ``then`` in this
    thread; ``(region number, then's result)`` yielded in region order.

    The restore's way in (``restore_checkpoint``, ``load_parameters`` with a
    target): ``then`` places the block on its device(s), so a block is held
    on the host only between its read and its placing. Regions are read on
    ``workers`` threads (default: the readers' context's, else the cores,
    doubled for TensorStore as in ``read_arrays``, one thread below
    ``SMALL_BYTES``); each region is read in blocks of at most
    ``block_bytes`` (``region_plan``) into its own buffer; the blocks of one
    TensorStore leaf are read together, one chunk decoded once for all the
    blocks it holds (``_units``). ``then`` runs in the calling thread: what
    it allocates (device buffers) comes from one heap, reused from one
    restore to the next (on worker threads, glibc's per-thread heaps doubled
    the peak memory and the page faults of a restore).

    Host memory: at most ``2 * workers * block_bytes`` of regions are read
    and not yet placed (one region at a time where one is larger: a device
    block and the stored chunks decoded for it, as ``tt.memory_plan`` counts a
    restore), and never more than ``budget`` less the largest region. The
    regions of a reader that streams only front to back (a compressed npz
    member) are cut from its array read whole once.

    Raises:
      MemoryBudgetError: before anything is read, a region (or a front-to-back reader's whole array) over
        ``budget``, named by ``names[i]`` (default: the region number).

    >>> from treetools.checkpoint_io.readers import InMemoryReader
    >>> r = InMemoryReader(np.arange(6.0))
    >>> list(read_regions([(r, (slice(0, 3),)), (r, (slice(3, 6),))], lambda i, b: b.tolist(), block_bytes=16,
    ...                   budget=2**20, workers=2))
    [(0, [0.0, 1.0, 2.0]), (1, [3.0, 4.0, 5.0])]
    """
    sizes = []
    for i, (reader, index) in enumerate(regions):
        whole = reader.sequential
        sizes.append(math.prod(reader.shape if whole else block_extent(index, reader.shape)[1]) * reader.dtype.itemsize)
        check_budget(sizes[-1], where=names[i] if names is not None else f"region {i}", budget=budget,
                     what=("a compressed leaf read whole (it streams only front to back) to place it," if whole
                           else f"one device's block ({list(block_extent(index, reader.shape)[1])} {reader.dtype}), "
                           "held on the host to place it,"),
                     fix="read=tt.ReadOptions(memory_budget=...) (or TREETOOLS_MEMORY_BUDGET_MB)")
    readers = [r for r, _ in regions]
    if workers is None:
        workers = given_workers(readers)
        if workers is None:
            small = sum(sizes) < SMALL_BYTES and not any(r.remote for r in readers)
            workers = 1 if small else default_workers(readers) * (2 if readers and all(r.reads_async
                                                                                      for r in readers) else 1)
    largest = max(sizes, default=0)
    window = min(max(2 * workers * min(block_bytes, largest), largest), max(budget - largest, largest))
    units, costs = _units(regions, sizes, block_bytes, cap=int(max(largest, window // 2)))
    task = max(costs, default=0)
    if window < 2 * task:  # no room for a task read while another is handed on: one at a time, in this thread
        workers = 1

    def fetch(u: int) -> list[tuple[int, np.ndarray]]:
        numbers = units[u]
        reader = regions[numbers[0]][0]
        if reader.sequential:
            array = reader.read_all()
            return [(i, array[regions[i][1]]) for i in numbers]
        if len(numbers) == 1:
            return [(numbers[0], _region(reader, regions[numbers[0]][1], block_bytes))]
        start = reader.reading()  # TensorStore: every region's read in flight on one store, a chunk decoded once
        try:
            pending = [start(region_plan(reader, regions[i][1], block_bytes)[0][0]) for i in numbers]
            return [(i, np.asarray(p.result())) for i, p in zip(numbers, pending)]
        finally:
            close = getattr(start, "close", None)
            if close is not None:
                close()

    # Tasks read ahead within the window less the task being handed on.
    done = ordered_map(fetch, range(len(units)), workers=min(workers, max(1, len(units))), window=window - task,
                       cost=lambda u: costs[u], name="treetools-restore")
    for blocks in done:  # handed on in this thread: what ``then`` allocates comes from one heap, reused
        while blocks:
            i, block = blocks.pop(0)
            yield i, then(i, block)
            del block


def _units(regions: Sequence[tuple[ArrayReader, Index]], sizes: Sequence[int], block_bytes: int, *, cap: int
           ) -> tuple[list[tuple[int, ...]], list[int]]:
    """``read_regions``' tasks: region numbers read by one thread, and their bytes.

    Every region of a reader that streams front to back is one task (its
    array read whole once); consecutive regions of one TensorStore reader,
    each within ``block_bytes``, are one task of at most ``cap`` bytes whose
    reads are all in flight at once on one open store: the device blocks of
    a leaf resharded across its stored chunks (``P(None, "tp")`` from an FSDP
    save) then share each chunk's decoding instead of decoding it per block.
    Any other region is a task of its own.
    """
    units: list[tuple[int, ...]] = []
    costs: list[int] = []
    streamed: dict[int, int] = {}  # id(reader) -> its task
    for i, (reader, _) in enumerate(regions):
        if reader.sequential:
            if id(reader) in streamed:
                units[streamed[id(reader)]] += (i,)
                continue
            streamed[id(reader)] = len(units)
        elif (reader.reads_async and sizes[i] <= block_bytes and units and regions[units[-1][-1]][0] is reader
              and sizes[units[-1][-1]] <= block_bytes and costs[-1] + sizes[i] <= cap):
            units[-1] += (i,)
            costs[-1] += sizes[i]
            continue
        units.append((i,))
        costs.append(sizes[i])
    return units, costs
