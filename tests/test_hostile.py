"""Hostile files and faults (issue 17's first list, the parts the checkpoint layer covers): one clear line, never a crash."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from flax import serialization

from treetools.cli import main
from treetools.checkpoint_tools.diff import diff_paths


def _safetensors(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _one_line_error(capsys, argv, code=1) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("treetools: error: ") and "internal error" not in err, err
    return err


def test_file_truncated_while_reading_is_an_error_not_sigbus(tmp_path):
    from safetensors.numpy import save_file

    f = tmp_path / "m.safetensors"
    save_file({"w": np.arange(2**20, dtype=np.float32)}, str(f))
    code = ("import os, sys\n"
            "from treetools.checkpoint_io import open_source\nfrom treetools.shared.errors import CheckpointError\n"
            f"leaf = open_source({str(f)!r}).snapshot().items['default'].leaves[0]\n"
            f"os.truncate({str(f)!r}, 4096)\n"
            "try:\n    [b.sum() for b in leaf.reader.storage_blocks(1 << 16)]\n"
            "except CheckpointError as e:\n    print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1000:])  # -7 would be SIGBUS
    assert "ERR" in proc.stdout and "truncated, or changed while being read" in proc.stdout


def test_nan_in_a_python_float_leaf_counts_as_nonfinite(tmp_path, capsys):
    f = tmp_path / "state.msgpack"
    f.write_bytes(serialization.to_bytes({"lr": float("nan"), "w": np.ones(2, np.float32)}))
    assert main(["inspect", str(f), "--fail-on-nonfinite"]) == 3
    assert "default/lr" in capsys.readouterr().err


def test_duplicate_and_overlapping_safetensors_entries_are_refused(tmp_path, capsys):
    dup = tmp_path / "dup.safetensors"
    raw = (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
           b' "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    dup.write_bytes(struct.pack("<Q", len(raw)) + raw + np.array([np.nan, 1.0], np.float32).tobytes())
    assert "appears twice" in _one_line_error(capsys, ["inspect", str(dup)])
    over = tmp_path / "over.safetensors"
    _safetensors(over, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    assert "share data bytes" in _one_line_error(capsys, ["inspect", str(over)])


def test_deeply_nested_header_is_a_sentence(tmp_path, capsys):
    f = tmp_path / "deep.safetensors"
    raw = b"{" + b'"a":[' * 100000 + b"]" * 100000 + b"}"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw)
    err = _one_line_error(capsys, ["inspect", str(f)])
    assert "deep.safetensors" in err and "RecursionError" not in err


def test_corrupt_deflate_stream_is_a_sentence(tmp_path, capsys):
    f = tmp_path / "w.npz"
    np.savez_compressed(f, w=np.random.default_rng(0).standard_normal(50000))
    data = bytearray(f.read_bytes())
    with zipfile.ZipFile(f) as zf:
        info = zf.infolist()[0]
    start = info.header_offset + 30 + len(info.filename) + len(info.extra) + 200
    data[start:start + 64] = bytes(64)
    f.write_bytes(bytes(data))
    err = _one_line_error(capsys, ["inspect", str(f), "--stats"])
    assert "w.npz" in err and "zlib" not in err.split(":")[2]


def test_terminal_escapes_and_newlines_in_names_are_escaped(tmp_path, capsys):
    f = tmp_path / "evil.safetensors"
    name = "x\x1b[2J\nforged row"
    _safetensors(f, {name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
    assert main(["inspect", str(f), "--leaves"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2J\\nforged row" in out
    assert not any(line.startswith("forged row") for line in out.splitlines())


def test_diff_is_exact_for_complex_and_large_int64(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    big = np.array([2**53, 2**60], np.int64)
    np.savez(a, z=np.array([1 + 1j, 2 + 0j], np.complex64), i=big)
    np.savez(b, z=np.array([1 + 2j, 2 + 0j], np.complex64), i=big + 1)
    report = diff_paths(str(a), str(b), values=True, atol=0, rtol=0)
    by = {v.path: v for v in report.values}
    assert by["z"].mismatched == 1 and by["z"].max_abs_diff == pytest.approx(1.0)
    assert by["i"].mismatched == 2 and not report.identical


def test_msgpack_nested_a_thousand_levels_deep_is_no_recursion_error(tmp_path):
    # msgpack itself unpacks up to about 1024 levels; walking the tree must not recurse per level.
    import msgpack

    tree = {"leaf": 1}
    for _ in range(900):
        tree = {"n": tree}
    (tmp_path / "deep.msgpack").write_bytes(msgpack.packb(tree))
    from treetools.checkpoint_io.opening import open_source

    source = open_source(str(tmp_path / "deep.msgpack"))
    (leaf,) = source.snapshot().items["default"].leaves
    assert len(leaf.path) == 901 and leaf.value == 1
