"""The Flax msgpack walker (``treetools/checkpoint_io/formats/_msgpack.py``): flax's own trees, hostile files, memory.

The truth is ``flax.serialization.msgpack_restore`` of the same bytes: the
walker must give the same tree, with each array left in the file (a
``FileReader`` at its offset) instead of copied.
"""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from flax import serialization
from hypothesis import given, settings
from hypothesis import strategies as st

import treetools as tt
from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.storage import LocalStorage
from treetools.checkpoint_io.formats import _msgpack
from treetools.checkpoint_io.formats._msgpack import MAX_DEPTH, MsgpackError, walk
from treetools.checkpoint_io.readers import FileReader, MemoryBudgetError
from treetools.shared.errors import CheckpointError


def same(got, want, where="") -> None:
    """``got`` (from the walker) equals ``want`` (from flax), arrays read back from the file."""
    if isinstance(got, FileReader):
        want = np.asarray(want)
        value = got.read_all()
        assert value.dtype == want.dtype and value.shape == want.shape, where
        assert value.tobytes() == want.tobytes(), where  # the same bits (NaN payloads, -0.0)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}/{i}")
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got.tobytes() == want.tobytes(), where
    elif isinstance(want, float) and np.isnan(want):
        assert isinstance(got, float) and np.isnan(got), where
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def walked(tmp_path, data: bytes, name="t.msgpack"):
    path = tmp_path / name
    path.write_bytes(data)
    return walk(ReadContext().confined_to(str(path)), str(path))


def odd_tree():
    import ml_dtypes

    rng = np.random.default_rng(0)
    return {
        "params": {"Dense_0": {"kernel": rng.standard_normal((3, 5), np.float32), "bias": np.zeros(5, np.float32)},
                   "bf16": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
                   "f8": np.arange(6, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).reshape(2, 3),
                   "c64": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64),
                   "zero_d": np.array(2.5, np.float64), "empty": np.zeros((0, 4), np.int32),
                   "bools": np.array([True, False]), "u8": np.arange(7, dtype=np.uint8)},
        "empty_dict": {}, "nested": {"a": {"b": {"c": {}}}},
        "step": 12, "neg": -70000, "big": 2**63 - 1, "lr": 1e-3, "nan": float("nan"), "flag": True,
        "none": None, "name": "ünïcode", "long": "x" * 300, "raw": b"\x00\xff" * 40,
        "np_scalar_f32": np.float32(1.5), "np_scalar_i64": np.int64(-3), "cplx": complex(1.0, -2.0),
        "list": [1, [2.0, "three", [None]], {"k": np.ones(2, np.int16)}],
    }


def test_flax_trees_walk_to_what_flax_restores(tmp_path):
    tree = odd_tree()
    data = serialization.msgpack_serialize(tree)  # lists stay msgpack arrays here
    same(walked(tmp_path, data), serialization.msgpack_restore(data))
    state = serialization.to_bytes(tree)  # to_state_dict turns lists into {"0": ...} maps
    same(walked(tmp_path, state, "s.msgpack"), serialization.msgpack_restore(state))


def test_big_arrays_chunked_by_flax_are_one_array_over_their_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 1000)  # flax chunks arrays over this many bytes
    w = np.arange(3 * 700, dtype=np.float32).reshape(3, 700)  # 8400 bytes: 9 chunks of 250 elements
    data = serialization.to_bytes({"w": w, "small": np.ones(3, np.float32)})
    tree = walked(tmp_path, data)
    reader = tree["w"]
    assert isinstance(reader, FileReader) and reader.shape == (3, 700) and len(reader.segments) == 9
    np.testing.assert_array_equal(reader.read_all(), w)
    np.testing.assert_array_equal(reader.read((slice(1, 3), slice(240, 260))), w[1:3, 240:260])  # across chunks
    same(tree, serialization.msgpack_restore(data))


def test_arrays_are_left_in_the_file_and_metadata_reads_only_headers(tmp_path, monkeypatch):
    w = np.random.default_rng(1).standard_normal((4, 2**20), np.float32)  # 16 MiB in four 4 MiB leaves
    path = tmp_path / "big.msgpack"
    path.write_bytes(serialization.to_bytes({f"l{i}": {"w": w[i]} for i in range(4)}))
    read = []
    real_open = LocalStorage.open

    def counting_open(self, p, **kw):
        f = real_open(self, p, **kw)
        real_read = f.read
        f.read = lambda n=-1: read.append(len(data := real_read(n))) or data  # noqa: B023
        return f

    monkeypatch.setattr(LocalStorage, "open", counting_open)
    source = tt.ckpt.open_source(str(path))
    leaves = source.snapshot().items["default"].leaves
    assert [leaf.row.shape for leaf in leaves] == [(2**20,)] * 4
    assert sum(read) < 5 * 64 * 2**10, read  # one 64 KiB window around each header, never a payload
    np.testing.assert_array_equal(leaves[2].reader.read((slice(5, 9),)), w[2, 5:9])


@given(st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30))
@settings(max_examples=150, deadline=None)
def test_any_plain_msgpack_walks_like_msgpack_unpackb(value):
    data = msgpack.packb(value, use_bin_type=True)
    got = _msgpack.walk_bytes(data)
    want = msgpack.unpackb(data, raw=False, strict_map_key=False)
    same(got, want)


def test_every_truncation_is_one_line_error(tmp_path):
    data = serialization.to_bytes({"a": {"w": np.arange(6.0).reshape(2, 3)}, "s": "text", "n": [1, 2.5, None]})
    path = tmp_path / "cut.msgpack"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as e:
            walk(ReadContext().confined_to(str(path)), str(path))
        assert "\n" not in str(e.value) and "cut.msgpack" in str(e.value), cut


def test_random_damage_is_a_checkpoint_error_or_a_tree_never_a_crash(tmp_path):
    data = bytearray(serialization.to_bytes(odd_tree()))
    rng = np.random.default_rng(7)
    path = tmp_path / "hit.msgpack"
    for _ in range(300):
        hit = bytearray(data)
        for pos in rng.integers(0, len(hit), size=rng.integers(1, 4)):
            hit[pos] = int(rng.integers(0, 256))
        path.write_bytes(bytes(hit))
        try:
            walk(ReadContext().confined_to(str(path)), str(path))
        except CheckpointError as e:
            assert "\n" not in str(e)


@pytest.mark.parametrize("case, words", [
    (b"\xc1", "0xc1"),
    (b"\xdf\xff\xff\xff\xff", "entries in 0 bytes"),  # a map of 4 billion entries, and nothing after
    (b"\x81\xa1k\xc6\xff\xff\xff\xf0", "bytes needed"),  # a 4 GB byte string in a 9-byte file
    (b"\x81\x91\x01\x02", "map key that is a list"),
    (b"\x80\x80", "extra data"),
    (msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb(((10,), "float32", b"\0" * 8)))}), "8 data bytes"),
    (msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb(((2,), "object", b"\0" * 16)))}), "dtype"),
    (msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb(((-2,), "float32", b"")))}), "sizes"),
    (msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb([1, 2]))}), "[shape, dtype, data]"),
    (msgpack.packb({"w": {"__msgpack_chunked_array__": True, "shape": {"0": 5}, "chunks": {"0": 1}}}), "chunked"),
])
def test_hostile_files_are_one_line(tmp_path, case, words):
    with pytest.raises(MsgpackError) as e:
        walked(tmp_path, case)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_nesting_is_iterative_and_bounded(tmp_path):
    deep = b"\x81\xa1n" * (MAX_DEPTH - 1) + b"\x81\xa1n\x01"
    tree = walked(tmp_path, deep)
    for _ in range(MAX_DEPTH):
        tree = tree["n"]
    assert tree == 1
    with pytest.raises(MsgpackError, match=f"nested more than {MAX_DEPTH} levels deep"):
        walked(tmp_path, b"\x91" * 100_000 + b"\x01")


def test_structure_is_held_to_the_memory_budget(tmp_path):
    path = tmp_path / "m.msgpack"
    path.write_bytes(msgpack.packb({"many": list(range(20_000))}))  # 60 KB that decode to about 1.3 MB
    with pytest.raises(MemoryBudgetError, match="structure of this Flax msgpack"):
        walk(ReadContext(memory_budget=2**16).confined_to(str(path)), str(path))
    assert len(walk(ReadContext().confined_to(str(path)), str(path))["many"]) == 20_000


_PEAK = (
    "import resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
    "assert p.returncode in (0, 1), p.stderr[-2000:]\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
)


def _peak(argv: list[str], env: dict) -> int:
    proc = subprocess.run([sys.executable, "-c", _PEAK, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip())


@pytest.mark.parametrize("command", [["inspect", "{f}", "--stats"], ["verify", "{f}"], ["diff", "{f}", "{f}", "--values"]])
def test_peak_memory_of_a_64_mb_msgpack_grows_by_blocks_not_by_the_file(tmp_path, command):
    rng = np.random.default_rng(0)
    big, tiny = tmp_path / "big.msgpack", tmp_path / "tiny.msgpack"
    big.write_bytes(serialization.to_bytes({"params": {f"l{i}": rng.standard_normal((1024, 1024), np.float32)
                                                       for i in range(16)}, "step": 1}))  # 64 MiB
    tiny.write_bytes(serialization.to_bytes({"params": {"l0": np.ones(4, np.float32)}, "step": 1}))
    chunk, workers = 2**20, 2
    env = {**os.environ, "TREETOOLS_CHUNK_BYTES": str(chunk), "TREETOOLS_WORKERS": str(workers)}
    run = lambda f: _peak([sys.executable, "-m", "treetools", *[a.format(f=f) for a in command]], env)  # noqa: E731
    growth = run(big) - run(tiny)  # the same command and imports on a tiny file: what the data adds
    # The engine holds about 2 blocks per reader per worker, plus each thread's scratch of a few MiB.
    sides = 2 if command[0] == "diff" else 1
    assert growth < 2 * sides * workers * chunk + 8 * 2**20, f"{command[0]}: +{growth / 2**20:.1f} MiB"
    assert growth < big.stat().st_size / 4


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_truncated_file_given_by_a_relative_path_is_one_line(tmp_path, monkeypatch, capsys, command):
    from treetools.cli import main

    data = serialization.to_bytes({"params": {"w": np.ones((64, 64), np.float32)}})
    (tmp_path / "cut.msgpack").write_bytes(data[: len(data) // 2])
    monkeypatch.chdir(tmp_path)
    assert main([command, "cut.msgpack"]) == 1
    captured = capsys.readouterr()
    line = "cut.msgpack: corrupt or truncated Flax msgpack at byte"
    if command == "verify":  # damage is a problem of the checkpoint, listed on stdout
        assert f"problem: {line}" in captured.out and not captured.err
    else:
        err = captured.err.strip()
        assert err.count("\n") == 0 and err.startswith(f"treetools: error: {line}")
