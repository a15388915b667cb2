"""The block engine (``treetools/checkpoint_io/stream.py``): what makes the streaming commands fast, pinned without a clock.

Every block of every reader read once; the sides of a diff in flight together;
work spread over threads; blocks in flight bounded; results independent of
the number of threads. Counted through the readers, never timed.
"""

from __future__ import annotations

import collections
import json
import threading
import weakref

import numpy as np
import pytest
from safetensors.numpy import save_file

import treetools as tt
from treetools.checkpoint_io.formats._tensorstore import TensorStoreReader
from treetools.checkpoint_io.readers import FileReader, InMemoryReader, plan_blocks
from treetools.checkpoint_io.stream import Failed, job_plan, ordered_map, read_arrays, reduce_blocks, stream_blocks
from treetools.shared.errors import CheckpointError
from treetools.checkpoint_tools.diff import diff_paths, value_diffs
from treetools.checkpoint_tools.report import inspect_path
from treetools.checkpoint_tools.verify import verify_path
from tests.test_inspect import write_run


class Counting(InMemoryReader):
    """An in-memory array that records every block read (index and thread) and how many are held at once."""

    def __init__(self, array, log, name, *, gate=None):
        super().__init__(array)
        self.log, self.name, self.gate = log, name, gate

    def read(self, index):
        if self.gate is not None:
            self.gate(self, index)
        self.log.append((self.name, tuple((s.start, s.stop) for s in index), threading.current_thread().name))
        return np.array(super().read(index))  # a copy: a fresh block, as a file read gives


class Held:
    """Blocks read and not yet used, counted across threads: ``reader(array)`` counts up, ``used(n)`` down."""

    def __init__(self):
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def reader(self, array):
        held = self

        class Tracked(InMemoryReader):
            def read(self, index):
                with held.lock:
                    held.now += 1
                    held.peak = max(held.peak, held.now)
                return np.array(super().read(index))

        return Tracked(array)

    def used(self, n=1):
        with self.lock:
            self.now -= n


def _tiles(log, name, shape, block_bytes, itemsize):
    got = sorted(ix for n, ix, _ in log if n == name)
    want = sorted(tuple((s.start, s.stop) for s in ix) for ix in plan_blocks(shape, block_bytes // itemsize))
    return got, want


def test_reduce_blocks_reads_every_block_of_every_reader_once_on_every_worker():
    log = []
    barrier = threading.Barrier(2, timeout=30)
    seen = set()

    def gate(reader, index):  # the first read on each thread waits for another thread: two must be reading
        me = threading.current_thread().name
        if me not in seen:
            seen.add(me)
            barrier.wait()

    arrays = {f"r{i}": np.arange(1000 * (i + 1), dtype=np.float32).reshape(-1, 10) for i in range(4)}
    readers = [Counting(a, log, n, gate=gate) for n, a in arrays.items()]
    parts = reduce_blocks([(r,) for r in readers], lambda j: [0.0], lambda acc, ix, bs: acc.__setitem__(
        0, acc[0] + float(bs[0].sum())), block_bytes=400, workers=2)
    assert [sum(p[0] for p in ps) for ps in parts] == [float(a.sum()) for a in arrays.values()]
    for n, a in arrays.items():
        got, want = _tiles(log, n, a.shape, 400, 4)
        assert got == want, n  # each block once: no block read twice, none skipped
    assert len({t for _, _, t in log}) == 2


def test_results_do_not_depend_on_the_number_of_threads():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((300, 70)).astype(np.float32) for _ in range(5)]
    runs = [reduce_blocks([(InMemoryReader(a),) for a in arrays], lambda j: [],
                          lambda acc, ix, bs: acc.append(float(np.sum(bs[0], dtype=np.float64))),
                          block_bytes=2000, workers=w) for w in (1, 2, 5)]
    assert runs[0] == runs[1] == runs[2]  # partials in block order, whatever finished first


def test_a_failing_job_is_failed_alone_and_other_errors_propagate():
    class Broken(InMemoryReader):
        def read(self, index):
            raise CheckpointError("broken chunk")

    good = InMemoryReader(np.ones(10))
    out = reduce_blocks([(Broken(np.ones(10)),), (good,)], lambda j: [0], lambda acc, ix, bs: None,
                        block_bytes=16, workers=2, errors=(CheckpointError,))
    assert isinstance(out[0], Failed) and "broken chunk" in str(out[0].error) and not isinstance(out[1], Failed)
    with pytest.raises(CheckpointError, match="broken chunk"):
        reduce_blocks([(Broken(np.ones(10)),)], lambda j: [0], lambda acc, ix, bs: None, block_bytes=16, workers=2)


def test_blocks_in_flight_are_bounded_by_the_workers():
    held = Held()
    arrays = [np.arange(4000.0) for _ in range(6)]
    jobs = [(held.reader(a), held.reader(a)) for a in arrays]  # pairs, as a diff reads them
    reduce_blocks(jobs, lambda j: None, lambda acc, ix, blocks: held.used(len(blocks)), block_bytes=800, workers=3)
    assert held.now == 0 and held.peak <= 2 * 3  # the two sides of the current block, per worker


class Alive:
    """Blocks alive (referenced anywhere) across threads, by a finalizer on each block a reader returns: what a
    process really holds, where ``Held`` counts what the fold has not used yet."""

    def __init__(self):
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def _gone(self):
        with self.lock:
            self.now -= 1

    def reader(self, array):
        alive = self

        class Tracked(InMemoryReader):
            def read(self, index):
                block = np.array(super().read(index))
                with alive.lock:
                    alive.now += 1
                    alive.peak = max(alive.peak, alive.now)
                weakref.finalize(block, alive._gone)
                return block

        return Tracked(array)


@pytest.mark.parametrize("sides", [1, 2])
def test_a_block_is_let_go_before_the_next_is_read(sides):
    # The engine keeps no reference to a block once its fold has it: a zip's reused result tuple, or a loop
    # variable kept over a yield, held each thread's last block while it read the next (two blocks per thread,
    # the peak RSS of --stats at 8 GiB 110 MiB where 128 MiB gave 68).
    alive = Alive()
    jobs = [tuple(alive.reader(np.arange(4000.0)) for _ in range(sides)) for _ in range(6)]
    reduce_blocks(jobs, lambda j: None, lambda acc, ix, blocks: None, block_bytes=800, workers=3)
    assert alive.now == 0 and alive.peak <= sides * 3, alive.peak  # the block(s) being folded, per worker
    alive = Alive()
    reduce_blocks([tuple(alive.reader(np.arange(4000.0)) for _ in range(sides))], lambda j: None,
                  lambda acc, ix, blocks: None, block_bytes=800, workers=1)
    assert alive.peak == sides  # one thread: one block of each side at a time


def test_the_two_sides_of_a_diff_are_read_side_by_side():
    # Side A's read of each block waits until side B's read of the same block has begun: reading the sides one
    # after the other would never get past the first block (the gate gives up after 30 s and the test fails).
    started = collections.defaultdict(threading.Event)
    log = []

    def gate(reader, index):
        key = tuple((s.start, s.stop) for s in index)
        started[(reader.name, key)].set()
        if reader.name == "a":
            assert started[("b", key)].wait(30), "side B was not being read while side A was"

    a = np.linspace(0, 1, 5000, dtype=np.float32)
    row = tt.ckpt.Leaf(tt.ckpt.array_row(("w",), a.shape, a.dtype), None)
    pairs = [(tt.ckpt.Leaf(row.row, Counting(a, log, "a", gate=gate)),
              tt.ckpt.Leaf(row.row, Counting(a + 1, log, "b", gate=gate)), "w")]
    (d,) = value_diffs(pairs, block_bytes=4000, workers=1)
    assert d.mismatched == a.size and d.max_abs_diff == pytest.approx(1.0)
    for side in "ab":
        got, want = _tiles(log, side, a.shape, 4000, 4)
        assert got == want, side


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, devices):
    return write_run(tmp_path_factory.mktemp("stream") / "run")


def _extent(index, shape):
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _count_tensorstore(monkeypatch):
    """Record every block each TensorStore reader is asked for, by the reader's name (its ``where``)."""
    log = collections.defaultdict(list)
    real_reading, real_blocks = TensorStoreReader.reading, TensorStoreReader.blocks

    def reading(self):
        start = real_reading(self)

        def counted(index):
            log[self._where].append(_extent(index, self.shape))
            return start(index)
        return counted

    def blocks(self, plan):
        plan = list(plan)
        log[self._where].extend(_extent(index, self.shape) for index in plan)
        return real_blocks(self, plan)

    monkeypatch.setattr(TensorStoreReader, "reading", reading)
    monkeypatch.setattr(TensorStoreReader, "blocks", blocks)
    return log


def _sizes(root, steps):
    """Elements of every array of the given steps, by its reader's name."""
    source = tt.ckpt.open_source(str(root))
    return {leaf.reader._where: int(np.prod(leaf.reader.shape)) for step in steps
            for item in source.snapshot(step).items.values() for leaf in item.leaves if leaf.reader is not None}


def _each_block_once(log, sizes):
    for where, blocks in log.items():
        assert len(set(blocks)) == len(blocks), f"{where}: a block read twice"
        assert sum(int(np.prod([b - a for a, b in ix])) for ix in blocks) == sizes[where], f"{where}: not tiled"


def test_diff_values_reads_each_block_of_each_side_once(two_steps, monkeypatch):
    log = _count_tensorstore(monkeypatch)
    report = diff_paths(str(two_steps), str(two_steps), step_a=100, step_b=200, values=True, block_bytes=64)
    sizes = _sizes(two_steps, (100, 200))
    _each_block_once(log, sizes)
    assert len(log) == 2 * len(report.values) and set(log) <= set(sizes)  # both sides of every compared leaf
    assert any(len(blocks) > 1 for blocks in log.values())  # leaves of several blocks were compared too


def test_verify_and_stats_decode_each_block_once(two_steps, monkeypatch):
    log = _count_tensorstore(monkeypatch)
    assert verify_path(str(two_steps), step=200, block_bytes=64).ok
    sizes = _sizes(two_steps, (200,))
    _each_block_once(log, sizes)
    assert set(log) == set(sizes)
    log.clear()
    inspect_path(str(two_steps), step=200, stats=True, block_bytes=64)
    assert any(len(blocks) > 1 for blocks in log.values())
    _each_block_once(log, sizes)


def test_safetensors_diff_and_load_read_each_byte_once(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.w": rng.standard_normal((50, 30)).astype(np.float32) for i in range(6)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file({k: v + 1 for k, v in tensors.items()}, str(tmp_path / "b.safetensors"))
    reads = collections.Counter()
    real = FileReader._fill

    def fill(self, view, pos):
        reads[(self._path, pos, len(view))] += 1
        return real(self, view, pos)

    monkeypatch.setattr(FileReader, "_fill", fill)
    diff_paths(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), values=True, block_bytes=1024)
    for name in ("a", "b"):
        spans = sorted((pos, n) for (p, pos, n) in reads if p.endswith(f"{name}.safetensors"))
        assert all(c == 1 for c in reads.values())
        assert sum(n for _, n in spans) == sum(v.nbytes for v in tensors.values())  # every byte, once
        assert all(p0 + n0 <= p1 for (p0, n0), (p1, _) in zip(spans, spans[1:]))  # no overlap
    reads.clear()
    got = tt.load_parameters(tmp_path / "a.safetensors")
    assert sorted(n for (_, _, n) in reads) == sorted(v.nbytes for v in tensors.values())  # one read per tensor
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)


def test_load_parameters_reads_leaves_in_parallel():
    barrier = threading.Barrier(2, timeout=30)

    class Gated(InMemoryReader):
        def read_all(self):
            barrier.wait()  # two leaves must be read at once, or this waits forever
            return super().read_all()

    out = list(read_arrays([Gated(np.ones(3)), Gated(np.zeros(2))], workers=2))
    assert [a.tolist() for a in out] == [[1.0, 1.0, 1.0], [0.0, 0.0]]


def test_tensorstore_arrays_are_read_two_per_core_at_once(monkeypatch):
    # load_parameters of an Orbax step: TensorStore decodes on its own threads, so two whole-array reads per core are
    # in flight (0.58 -> 0.50 s for 512 MiB on 2 cores); other readers, one per core.
    import treetools.checkpoint_io.stream as stream

    monkeypatch.setattr(stream, "cores", lambda: 2)
    monkeypatch.delenv("TREETOOLS_WORKERS", raising=False)
    big = (5 * 2**20,)  # 20 MiB each as declared (over SMALL_BYTES in all); never allocated
    lock, now, peak = threading.Lock(), [0], {}

    class Declared(InMemoryReader):
        reads_async = False

        def __init__(self, tag):
            super().__init__(np.zeros(1, np.float32))
            self.tag, self.shape = tag, big

        def read_all(self):
            with lock:
                now[0] += 1
                peak[type(self).__name__] = max(peak.get(type(self).__name__, 0), now[0])
            threading.Event().wait(0.05)
            with lock:
                now[0] -= 1
            return np.full(1, self.tag)

    class Async(Declared):
        reads_async = True

    for cls, want in ((Async, 4), (Declared, 2)):
        out = list(read_arrays([cls(i) for i in range(12)]))
        assert [int(a[0]) for a in out] == list(range(12))  # in reader order
        assert peak[cls.__name__] == want, peak


def test_stream_blocks_comes_in_writer_order_with_bounded_read_ahead():
    held = Held()
    arrays = [np.arange(600, dtype=np.float32).reshape(20, 30) + 1000 * i for i in range(4)]
    out = []
    for i, index, block in stream_blocks([held.reader(a) for a in arrays], block_bytes=480, workers=3, window=4):
        held.used()
        out.append((i, block.copy()))
        assert block.flags.c_contiguous
    assert [i for i, _ in out] == sorted(i for i, _ in out)  # reader order
    for i, a in enumerate(arrays):  # C order within a reader: appending the blocks writes the array's bytes
        assert b"".join(b.tobytes() for j, b in out if j == i) == a.tobytes()
    assert held.peak <= 4 + 3  # the window plus one being read per worker


def test_contiguous_plans_follow_chunk_rows_when_they_fit():
    r = InMemoryReader(np.zeros((8, 6), np.float32))
    r.chunk_shape = (2, 3)
    plan = job_plan((r,), block_bytes=4 * 24, contiguous=True)  # 24 elements: two chunk rows of 12
    assert [(ix[0].start, ix[0].stop) for ix in plan] == [(0, 4), (4, 8)] and all(ix[1] == slice(None) for ix in plan)
    tiles = job_plan((r,), block_bytes=4 * 24)  # chunk-aligned tiles when contiguity is not asked
    assert all((ix[0].stop - ix[0].start) % 2 == 0 for ix in tiles)


def test_ordered_map_keeps_order_and_raises_in_turn():
    assert list(ordered_map(lambda x: -x, range(50), workers=4, window=3)) == [-x for x in range(50)]

    def boom(x):
        if x == 7:
            raise ValueError("seven")
        return x

    got = []
    with pytest.raises(ValueError, match="seven"):
        for x in ordered_map(boom, range(20), workers=3, window=5):
            got.append(x)
    assert got == list(range(7))


def test_json_of_a_diff_is_the_same_with_one_thread_or_many(two_steps, monkeypatch, capsys):
    from treetools.cli import main

    root = two_steps
    outs = []
    for w in ("1", "3"):
        monkeypatch.setenv("TREETOOLS_WORKERS", w)
        main(["diff", str(root), "--step", "100", "--step", "200", "--values", "--format", "json", "--chunk-mb", "0.004"])
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]


def test_every_streaming_command_reads_through_the_engine(two_steps, tmp_path, monkeypatch):
    import treetools.checkpoint_io.stream as stream
    import treetools.checkpoint_tools.diff as diff_module
    import treetools.checkpoint_tools.stats as stats_module
    import treetools.checkpoint_tools.verify as verify_module
    import treetools.checkpoint_jax.restore as restore_module

    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for module in (diff_module, stats_module, verify_module):
        monkeypatch.setattr(module, "reduce_blocks", counted(module.__name__, stream.reduce_blocks))
    monkeypatch.setattr(restore_module, "read_arrays", counted("load_parameters", stream.read_arrays))
    root = str(two_steps)
    inspect_path(root, step=200, stats=True)
    verify_path(root, step=200)
    diff_paths(root, root, step_a=100, step_b=200, values=True)
    tt.load_parameters(root, step=200)
    assert calls == {"treetools.checkpoint_tools.stats": 1, "treetools.checkpoint_tools.verify": 1, "treetools.checkpoint_tools.diff": 1,
                     "load_parameters": 1}  # once per command: every leaf in one engine call, not one per leaf


# ----------------------------------------------------------------------------- issue 24, point 7: progress per block


@pytest.mark.parametrize("command", ["stats", "verify", "diff"])
def test_every_long_command_advances_its_progress_bar_block_by_block(tmp_path, monkeypatch, command):
    # One 16 MiB leaf read in 1 MiB blocks: the bar moves at least 16 times (it jumped 0% -> 100% per leaf),
    # and ends at the bytes it announced.
    from safetensors.numpy import save_file

    from treetools.checkpoint_tools import progress as progress_module
    from treetools.checkpoint_tools.diff import diff_paths
    from treetools.checkpoint_tools.report import inspect_path
    from treetools.checkpoint_tools.verify import verify_path

    calls: list[tuple[int, int]] = []

    class Recording(progress_module.Progress):
        def advance(self, nbytes):
            super().advance(nbytes)
            calls.append((self.done, self.total))

    # inspect imports Progress when it computes statistics (metadata mode starts without it): patched at its source.
    for module in ("treetools.checkpoint_tools.progress", "treetools.checkpoint_tools.diff", "treetools.checkpoint_tools.verify"):
        monkeypatch.setattr(f"{module}.Progress", Recording)
    w = np.arange(4 * 2**20, dtype=np.float32).reshape(1024, 4096)  # 16 MiB
    save_file({"w": w}, str(tmp_path / "a.safetensors"))
    save_file({"w": w + 1}, str(tmp_path / "b.safetensors"))
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    if command == "stats":
        inspect_path(a, stats=True, block_bytes=2**20)
    elif command == "verify":
        assert verify_path(a, block_bytes=2**20).ok
    else:
        assert not diff_paths(a, b, values=True, block_bytes=2**20).identical
    sides = 2 if command == "diff" else 1
    assert len(calls) >= 16, len(calls)  # a diff advances once per block pair, by both sides
    assert calls[-1][0] == calls[-1][1] == sides * w.nbytes


# ----------------------------------------------------------------------------- issue 39, point 22: drawn per block


@pytest.mark.parametrize("command", ["verify", "diff"])
def test_the_bar_of_a_few_blocks_is_drawn_at_each_block(tmp_path, capsys, command):
    # A 4 MiB leaf read in 1 MiB blocks: the bar jumped from 0 % to the end (draws were skipped when they came
    # within 0.1 s of the last one); each block that moves the bar is drawn: 25, 50, 75, 100 %.
    import re

    from safetensors.numpy import save_file

    from treetools.checkpoint_tools.diff import diff_paths
    from treetools.checkpoint_tools.verify import verify_path

    w = np.arange(2**20, dtype=np.float32)  # 4 MiB
    save_file({"w": w}, str(tmp_path / "a.safetensors"))
    save_file({"w": w + 1}, str(tmp_path / "b.safetensors"))
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    if command == "verify":
        assert verify_path(a, block_bytes=2**20, progress=True).ok
    else:
        assert not diff_paths(a, b, values=True, block_bytes=2**20, progress=True).identical
    drawn = [float(x) for x in re.findall(r"\] +([\d.]+)%", capsys.readouterr().err)]
    assert [x for x in drawn if x] == [25.0, 50.0, 75.0, 100.0], drawn


def test_the_bar_is_rate_limited_without_skipping_a_step_it_shows(monkeypatch):
    # 100,000 tiny advances with the clock standing still: drawn once per cell of the bar it moves (30), not
    # 100,000 times; with the clock moving, the finer percentage is drawn too, at most every 0.1 s.
    import io

    from treetools.checkpoint_tools import progress as progress_module

    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    bar = progress_module.Progress(100_000, stream=stream, enabled=True)
    for _ in range(100_000):
        bar.advance(1)
    frames = stream.getvalue().split("\r")[1:]
    cells = [f.split("]")[0].count("#") for f in frames]
    assert len(frames) <= 31 and sorted(set(cells) - {0}) == list(range(1, 31)), cells  # (and 0.1 % once)
    assert frames[-1].startswith("[" + "#" * 30 + "] 100.0%"), frames[-1]
    stream = io.StringIO()
    bar = progress_module.Progress(1000, stream=stream, enabled=True)
    for _ in range(10):  # 0.1 % each, 0.06 s apart: the first drawn, then one every 0.12 s
        now[0] += 0.06
        bar.advance(1)
    frames = stream.getvalue().split("\r")[1:]
    assert [f.split("]")[1].split()[0] for f in frames] == ["0.1%", "0.3%", "0.5%", "0.7%", "0.9%"], frames


class ThreadShare:
    """``count`` shares of one run, each used by its own thread; ``allgather`` meets at a barrier."""

    def __init__(self, index, count, board):
        self.index, self.count, self.board = index, count, board

    def allgather(self, payload):
        slots, barrier = self.board
        slots[self.index] = payload
        barrier.wait()
        got = list(slots)
        barrier.wait()  # nobody writes the next round's payload before every process has read this one
        return got


@pytest.mark.parametrize("count", [2, 3])
def test_processes_each_read_a_share_and_all_get_every_result(count):
    # Jobs of different sizes over `count` shares: each job is read by one share only, and every share returns
    # exactly what one process alone returns (same partials, same block order).
    sizes = [5000, 300, 4000, 7, 2500, 1200, 900]
    arrays = [np.random.default_rng(i).standard_normal(n) for i, n in enumerate(sizes)]

    def fold(acc, ix, blocks):
        acc.append(float(blocks[0].sum()))

    alone = reduce_blocks([(InMemoryReader(a),) for a in arrays], lambda j: [], fold, block_bytes=800, workers=2)
    board = ([None] * count, threading.Barrier(count))
    logs = [[] for _ in range(count)]
    results = [None] * count

    def process(p):
        jobs = [(Counting(a, logs[p], j),) for j, a in enumerate(arrays)]
        results[p] = reduce_blocks(jobs, lambda j: [], fold, block_bytes=800, workers=2,
                                   share=ThreadShare(p, count, board))

    threads = [threading.Thread(target=process, args=(p,)) for p in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == alone for r in results)
    read_by = [{name for name, _, _ in log} for log in logs]
    assert sorted(j for names in read_by for j in names) == list(range(len(arrays)))  # each job by one share
    load = [sum(sizes[j] for j in names) for names in read_by]
    assert max(load) - min(load) <= max(sizes)  # shared by bytes


def test_an_error_in_one_process_reaches_every_process():
    # A process whose read raises must not leave the others waiting in the pooling: all raise it.
    class Broken(InMemoryReader):
        def read(self, index):
            raise MemoryError("no memory for this block")

    board = ([None] * 2, threading.Barrier(2))
    raised = [None, None]

    def process(p):
        jobs = [(Broken(np.ones(100)),), (InMemoryReader(np.ones(90)),)]
        try:
            reduce_blocks(jobs, lambda j: None, lambda *a: None, block_bytes=80, workers=1,
                          share=ThreadShare(p, 2, board))
        except MemoryError as e:
            raised[p] = str(e)

    threads = [threading.Thread(target=process, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert raised == ["no memory for this block"] * 2
