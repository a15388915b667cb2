"""``convert`` at real sizes (issue 48, findings F2 and F3 of the 2026-11-28 scale report): each stored chunk of the
source is read once, and the peak memory of a multi-GB conversion, to safetensors, to Hugging Face shards and to
Orbax, stays a few blocks (or a few stripes of whole source chunks) above a tiny conversion's in the same process.

Outputs are checked with the other side's own readers (``safetensors.safe_open``, ``ocp.StandardCheckpointer``,
``ocp.CheckpointManager``), bit for bit. Multi-GB inputs are Orbax checkpoints of zeros (zstd chunks of a few
bytes).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from safetensors import safe_open

import treetools as tt
from treetools.checkpoint_io.formats._tensorstore import TensorStoreReader
from treetools.checkpoint_io.readers import InMemoryReader, block_extent, c_ordered
from treetools.checkpoint_io.stream import cores
from treetools.checkpoint_io.writers.orbax import c_order_chunk, write_orbax
from treetools.shared.settings import block_bytes_from

from tests._every_command import flat_arrays, run

rng = np.random.default_rng(48)


def _orbax_save(path, tree, chunk_byte_size=None):
    """Orbax's own save; ``chunk_byte_size`` makes Orbax cut each leaf into chunks of at most that many bytes."""
    c = ocp.StandardCheckpointer()
    save_args = None if chunk_byte_size is None else \
        {k: ocp.SaveArgs(chunk_byte_size=chunk_byte_size) for k in tree}
    c.save(os.path.abspath(path), tree, save_args=save_args)
    c.wait_until_finished()
    c.close()


def _chunk_of(path, name):
    """The stored chunk shape of one array of an Orbax checkpoint (zarr + OCDBT), through TensorStore itself."""
    store = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": "file://" + os.path.abspath(path),
                                                   "path": name}}).result()
    return tuple(store.chunk_layout.read_chunk.shape)


# ---------------------------------------------------------------------------------------------- chunks read once


class _Counting:
    """Every index ``TensorStoreReader.read`` is asked for, per array: how many reads touch each stored chunk."""

    def __init__(self, monkeypatch):
        self.reads: list[tuple[TensorStoreReader, tuple]] = []
        original = TensorStoreReader.read

        def read(reader, index):
            self.reads.append((reader, index))
            return original(reader, index)

        monkeypatch.setattr(TensorStoreReader, "read", read)

    def per_chunk(self, chunk_of) -> dict[tuple, int]:
        """``{(array, chunk grid position): reads touching it}`` for every read so far."""
        counts: dict[tuple, int] = {}
        for reader, index in self.reads:
            chunk = chunk_of(reader)
            starts, sizes = block_extent(index, reader.shape)
            ranges = [range(s // c, -(-(s + n) // c)) for s, n, c in zip(starts, sizes, chunk)]
            for pos in itertools.product(*ranges):
                key = (reader._where, pos)
                counts[key] = counts.get(key, 0) + 1
        return counts


@pytest.mark.parametrize("to", ["safetensors", "orbax"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk-leaves", "orbax-chunk_byte_size"])
def test_each_stored_chunk_is_read_once(tmp_path, monkeypatch, to, chunked):
    # Leaves of 1 MiB, blocks of 64 KiB. One chunk per leaf (Orbax's default) was read once per 64 KiB band
    # before: 16 reads of each chunk. With Orbax's own chunks of at most 128 KiB (chunk_byte_size: it splits the
    # largest axes, so a chunk is not whole rows), each chunk was read by every band crossing it.
    tree = {"w": rng.standard_normal((256, 1024), dtype=np.float32),
            "e": rng.standard_normal((64, 8, 512), dtype=np.float32),
            "b": rng.standard_normal(3000, dtype=np.float32)}
    _orbax_save(tmp_path / "src", tree, chunk_byte_size=2**17 if chunked else None)
    chunks = {k: _chunk_of(tmp_path / "src", k) for k in tree}
    if chunked:
        assert chunks["w"][1] < 1024  # Orbax cut the trailing axis too: a 64 KiB band of rows crosses chunks
    else:
        assert chunks == {k: v.shape for k, v in tree.items()}
    monkeypatch.setenv("TREETOOLS_CHUNK_BYTES", str(2**16))
    counting = _Counting(monkeypatch)
    dst = tmp_path / ("o.safetensors" if to == "safetensors" else "o")
    tt.convert(tmp_path / "src", dst, to=to)

    by_shape = {v.shape: chunks[k] for k, v in tree.items()}  # the shapes differ: a reader's chunk, from TensorStore
    counts = counting.per_chunk(lambda r: by_shape[tuple(r.shape)])
    expected = sum(math.prod(-(-n // c) for n, c in zip(v.shape, chunks[k])) for k, v in tree.items())
    assert len(counts) == expected  # every stored chunk read ...
    assert set(counts.values()) == {1}  # ... by exactly one read
    if chunked and to == "safetensors":
        # Chunks that are not C-ordered runs (Orbax cut `w`'s rows), over a block: a local file takes each one at
        # its place, so a read is one chunk, never a stripe of them (up to the memory budget) as a writer in C
        # order needs.
        cut = [k for k, v in tree.items() if not c_ordered(chunks[k], v.shape)]
        assert "w" in cut
        for reader, index in counting.reads:
            chunk = by_shape[tuple(reader.shape)]
            if not c_ordered(chunk, reader.shape):
                starts, sizes = block_extent(index, reader.shape)
                assert math.prod(-(-(s + n) // c) - s // c for s, n, c in zip(starts, sizes, chunk)) == 1, index
    if to == "safetensors":
        with safe_open(dst, "np") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
    else:
        got = flat_arrays(ocp.StandardCheckpointer().restore(os.path.abspath(dst)))
    assert sorted(got) == sorted(tree)
    for k, v in tree.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k


# ---------------------------------------------------------------------------------------------- Orbax output


def test_orbax_output_is_read_identically_by_orbax_and_stored_in_c_order_chunks_of_a_block(tmp_path, monkeypatch):
    tree = {"dense": {"kernel": rng.standard_normal((300, 70), dtype=np.float32)},
            "embed": rng.standard_normal((2, 3, 1000)).astype(np.float16),
            "count": np.asarray(7, np.int64), "bias": np.arange(5, dtype=np.int32)}
    _orbax_save(tmp_path / "src", tree)
    monkeypatch.setenv("TREETOOLS_CHUNK_BYTES", "4096")
    assert tt.convert(tmp_path / "src", tmp_path / "o", to="orbax", verify=True).ok
    assert tt.convert(tmp_path / "src", tmp_path / "run", to="orbax", dst_step=3, verify=True).ok
    want = flat_arrays(tree)

    def same(got):
        got = flat_arrays(got)
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k

    same(ocp.StandardCheckpointer().restore(os.path.abspath(tmp_path / "o")))
    with ocp.CheckpointManager(os.path.abspath(tmp_path / "run")) as m:
        same(m.restore(3)["params"])  # no args: the handler recorded in the step's metadata
    with ocp.CheckpointManager(os.path.abspath(tmp_path / "run")) as m:
        same(m.restore(3, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"])
    same(tt.load_parameters(tmp_path / "o"))
    # _METADATA is what Orbax's StandardCheckpointer writes for the same tree.
    _orbax_save(tmp_path / "ref", tree)
    assert json.loads((tmp_path / "o" / "_METADATA").read_text()) == \
        json.loads((tmp_path / "ref" / "_METADATA").read_text())
    # Chunks: C-contiguous runs of at most a block (whole rows along the leading axes).
    assert _chunk_of(tmp_path / "o", "dense.kernel") == (14, 70)  # 14 rows of 280 bytes: 3,920 <= 4,096
    assert _chunk_of(tmp_path / "o", "embed") == (1, 2, 1000)  # a row of 2,000 bytes: two per chunk
    assert c_order_chunk((300, 70), 4, 4096) == (14, 70)


def test_orbax_output_in_blocks_of_one_byte(tmp_path):
    # --block-size 1 is a block size like any (each chunk one element): Orbax's save refused it with its own
    # "target_byte_size=1 must be >= 4" and a traceback (found by a review); now the output is Orbax's save of
    # the same arrays.
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(5, dtype=np.int16),
            "c": np.asarray(3.5)}
    np.savez(tmp_path / "s.npz", **tree)
    assert tt.convert(tmp_path / "s.npz", tmp_path / "o", to="orbax", block_bytes=1, verify=True).ok
    got = flat_arrays(ocp.StandardCheckpointer().restore(os.path.abspath(tmp_path / "o")))
    assert sorted(got) == sorted(tree)
    for k, v in tree.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


def test_a_read_failing_inside_orbaxs_save_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    # The leaves are read inside Orbax's save, on its thread: the reader's own one-line error comes out, not
    # Orbax's wrapping of it, and no destination (nor temporary) is left.
    _orbax_save(tmp_path / "src", {"a": np.ones(300, np.float32), "b": np.zeros(7, np.int32)})
    original = TensorStoreReader.read

    def read(reader, index):
        if tuple(reader.shape) == (7,):
            raise tt.CheckpointError(f"{reader._where}: cannot read array data (a damaged chunk).")
        return original(reader, index)

    monkeypatch.setattr(TensorStoreReader, "read", read)
    for extra in ([], ["--dst-step", "5"]):
        rc, _, err = run("convert", tmp_path / "src", tmp_path / "o", "--to", "orbax", *extra)
        assert rc == 1 and err.count("\n") == 1 and "a damaged chunk" in err and "`b`" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_stored_chunk_over_the_memory_budget_is_refused_with_one_line(tmp_path, capsys):
    _orbax_save(tmp_path / "src", {"a": np.ones(2**18, np.float32)})  # one chunk of 1 MiB
    rc, _, err = run("convert", tmp_path / "src", tmp_path / "o", "--to", "orbax", "--memory-budget-mb", "0.5")
    assert rc == 1 and err.count("\n") == 1 and "memory budget" in err and "--memory-budget" in err, err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------- memory


LEAF = (4096, 4096)  # float32: 64 MiB
LEAF_BYTES = 4 * LEAF[0] * LEAF[1]

# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child of pytest would start at pytest's peak.
_CHILD = """
import json, sys
import treetools as tt
def peak_kib():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
tiny_src, tiny_dst, src, dst, options = sys.argv[1:6]
options = json.loads(options)
tt.convert(tiny_src, tiny_dst, **options)
tiny = peak_kib()
tt.convert(src, dst, **options)
print(tiny, peak_kib())
"""


def _peak_growth_mib(tmp_path, src, dst, env=None, **options) -> float:
    """Peak RSS of a child converting ``src`` over its peak after a tiny conversion, in MiB."""
    tiny_dst = tmp_path / ("tiny.safetensors" if dst.name.endswith(".safetensors") else f"tiny-{dst.name}")
    shutil.rmtree(tiny_dst, ignore_errors=True)
    if tiny_dst.is_file():
        tiny_dst.unlink()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "tiny"), str(tiny_dst), str(src), str(dst),
                           json.dumps(options)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "MALLOC_MMAP_THRESHOLD_": str(2**20),
                               **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    tiny_kib, big_kib = map(int, proc.stdout.split())
    print(f"peak RSS {src.name} -> {dst.name} {options}: tiny {tiny_kib // 1024} MiB, big {big_kib // 1024} MiB")
    return (big_kib - tiny_kib) / 1024


def _zeros_orbax(path, leaves, block_bytes):
    """An Orbax checkpoint of ``leaves`` float32 zero leaves of ``LEAF``, written by Orbax's save (through
    ``write_orbax``) from zero-stride arrays: chunks of ``block_bytes`` (a whole leaf: one chunk per leaf, as
    Orbax stores an unsharded leaf), each a few bytes of zstd."""
    zeros = np.broadcast_to(np.float32(0), LEAF)
    write_orbax(str(path), [(("layers", f"{i:02d}", "w"), InMemoryReader(zeros)) for i in range(leaves)],
                block_bytes=block_bytes)


def test_multi_gb_convert_to_orbax_safetensors_and_shards_holds_a_few_blocks(tmp_path):
    # 2.25 GiB (36 leaves of 64 MiB, over 2**31 bytes) of zeros, stored as Orbax stores unsharded leaves: one
    # chunk each. The block engine holds its read-ahead, 3 blocks per core (8 MiB each), and here stripes of
    # whole source chunks, 64 MiB each: the one being written, the next one read, and TensorStore's buffer of
    # the chunk it decodes into it. Before: --to orbax held the item three times over (and refused it above
    # the 2 GiB budget); the safetensors writer decoded each 64 MiB chunk 8 times.
    _orbax_save(tmp_path / "tiny", {"a": np.ones(4, np.float32)})  # the same readers and imports, 16 bytes
    _zeros_orbax(tmp_path / "src", 36, LEAF_BYTES)
    assert _chunk_of(tmp_path / "src", "layers.00.w") == LEAF
    nbytes = 36 * LEAF_BYTES
    block = block_bytes_from(os.environ.get("TREETOOLS_CHUNK_BYTES"))
    blocks_mib = 3 * cores() * block / 2**20
    stripes_mib = 3 * LEAF_BYTES / 2**20
    slack = 32  # TensorStore's encode buffers of the chunks being written, allocator rounding

    grown = _peak_growth_mib(tmp_path, tmp_path / "src", tmp_path / "orbax", to="orbax")
    assert grown < blocks_mib + stripes_mib + slack, f"--to orbax of 2.25 GiB held {grown:.0f} MiB more than a tiny one"
    meta = ocp.StandardCheckpointer().metadata(os.path.abspath(tmp_path / "orbax"))  # Orbax's own view of it
    assert len(tt.flatten(getattr(getattr(meta, "item_metadata", meta), "tree", meta))) == 36
    for name in ("layers.00.w", "layers.35.w"):  # TensorStore itself, a leaf at a time (not 2.25 GiB at once)
        store = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "path": name,
                                                       "base": "file://" + str(tmp_path / "orbax")}}).result()
        assert store.shape == LEAF and not store.read().result().any()
        assert math.prod(store.chunk_layout.read_chunk.shape) * 4 <= block  # the output reads back in blocks

    shards = tmp_path / "hf"
    grown = _peak_growth_mib(tmp_path, tmp_path / "src", shards, shard_size="1GB")
    assert grown < blocks_mib + stripes_mib + slack, f"to shards held {grown:.0f} MiB more than a tiny one"
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == nbytes and len(set(index["weight_map"].values())) == 3
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(shards / shard, "np") as f:  # the writer's own reader, a tensor at a time
            for k in f.keys():
                t = f.get_tensor(k)
                assert t.shape == LEAF and t.dtype == np.float32 and not t.any(), k
    shutil.rmtree(shards)

    one = tmp_path / "one.safetensors"
    grown = _peak_growth_mib(tmp_path, tmp_path / "src", one)
    assert grown < blocks_mib + stripes_mib + slack, f"to one file held {grown:.0f} MiB more than a tiny one"
    with safe_open(one, "np") as f:
        assert len(f.keys()) == 36 and not f.get_tensor("layers.35.w").any()
    with open(one, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    assert one.stat().st_size == 8 + header + nbytes
    one.unlink()


