"""treetools convert / tt.convert: every readable format to safetensors and Orbax, checked with the other side's
own readers (safetensors.safe_open / load_file, ocp.StandardCheckpointer().restore), bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import flax.serialization
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from safetensors import safe_open

import treetools as tt
from treetools.checkpoint_io import writers  # noqa: F401  (the package imports without jax)
from treetools.checkpoint_io.stream import cores
from treetools.shared.settings import block_bytes_from
from treetools.checkpoint_io.writers import safetensors as st_writer
from treetools.cli import main

from tests._t5x_writer import save_t5x

rng = np.random.default_rng(0)


def _params(npz=False):
    """A small tree with every dtype class a checkpoint holds: float32, bfloat16 (float16 for npz, which cannot
    hold bfloat16), int32, a scalar, a stacked leaf, non-finite values."""
    return {
        "Dense_0": {"kernel": rng.standard_normal((8, 16), dtype=np.float32), "bias": np.zeros(16, np.float32)},
        "embed": {"embedding": rng.standard_normal((10, 8)).astype(np.float16 if npz else ml_dtypes.bfloat16)},
        "layers": {"w": rng.standard_normal((3, 4, 5), dtype=np.float32)},
        "count": np.asarray(7, np.int32),
        "nan": np.array([np.nan, -np.inf, 1.0], np.float32),
    }


def _flat(tree, sep="/"):
    out = {}
    for keys, v in flax.traverse_util.flatten_dict(tree).items():
        out[sep.join(keys)] = np.asarray(v)
    return out


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _assert_tree_equal(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert _same_bits(got[k], want[k]), k


def _orbax_save(path, tree):
    c = ocp.StandardCheckpointer()
    c.save(os.path.abspath(path), tree)
    c.wait_until_finished()
    c.close()


def _tree_hash(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))} if path.is_dir() else {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}


# ---------------------------------------------------------------------------------------------- round trips


def test_orbax_to_safetensors_to_orbax_round_trip_bit_for_bit(tmp_path):
    params = _params()
    _orbax_save(tmp_path / "orbax", params)
    before = _tree_hash(tmp_path / "orbax")
    report = tt.convert(tmp_path / "orbax", tmp_path / "model.safetensors", verify=True)
    assert report.ok and report.verified and report.format == "orbax"
    # the other side's own readers: safetensors' load_file and safe_open
    loaded = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    _assert_tree_equal(loaded, _flat(params, sep="."))
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("Dense_0.kernel")[2:4].tolist() == params["Dense_0"]["kernel"][2:4].tolist()
    # and back: dotted names nest again, Orbax's own restore reads it
    report = tt.convert(tmp_path / "model.safetensors", tmp_path / "back", to="orbax", verify=True)
    assert report.ok and report.layout == "checkpoint"
    restored = ocp.StandardCheckpointer().restore(os.path.abspath(tmp_path / "back"))
    _assert_tree_equal(_flat(restored), _flat(params))
    assert _tree_hash(tmp_path / "orbax") == before  # nothing written under SRC
    # treetools inspect reads it too
    assert tt.inspect_path(tmp_path / "back").to_json()["checkpoints"][0]["items"]["default"]["total_params"] == \
        sum(np.asarray(v).size for v in _flat(params).values())


def test_msgpack_npz_and_t5x_to_safetensors_equal_bit_for_bit(tmp_path):
    params, npz = _params(), _params(npz=True)
    (tmp_path / "state.msgpack").write_bytes(flax.serialization.to_bytes({"params": params, "step": 3}))
    np.savez(tmp_path / "w.npz", **_flat(npz))
    save_t5x(tmp_path / "t5x", 5, {"target": params, "state": {"step": np.int32(5)}}, target_elements=16)
    for src, tree in (("state.msgpack", params), ("w.npz", npz), ("t5x", params)):
        report = tt.convert(tmp_path / src, tmp_path / f"{src}.safetensors", verify=True)
        assert report.ok and not report.skipped, (src, report.problems, report.skipped)
        _assert_tree_equal(safetensors.numpy.load_file(tmp_path / f"{src}.safetensors"), _flat(tree, sep="."))
    assert report.step == 5 and report.item == "target"


def test_names_are_paths_with_dots_and_rules_apply(tmp_path):
    params = _params(npz=True)
    np.savez(tmp_path / "w.npz", **_flat(params))
    rules = tt.Rules(drop=["^nan$"], unstack=["^layers"], rename=[(r"^layers/(\d+)/w$", r"model.layers.\1.weight")],
                     transpose=[(r"kernel$", (1, 0))], dtype="float16")
    report = tt.convert(tmp_path / "w.npz", tmp_path / "out.safetensors", rules=rules, verify=True)
    assert report.ok and report.dropped == ["nan"]
    got = safetensors.numpy.load_file(tmp_path / "out.safetensors")
    assert sorted(got) == ["Dense_0.bias", "Dense_0.kernel", "count", "embed.embedding", "model.layers.0.weight",
                           "model.layers.1.weight", "model.layers.2.weight"]
    assert _same_bits(got["Dense_0.kernel"], params["Dense_0"]["kernel"].T.astype(np.float16))
    assert _same_bits(got["model.layers.1.weight"], params["layers"]["w"][1].astype(np.float16))
    assert _same_bits(got["count"], params["count"])  # integers keep their dtype under dtype=
    assert _same_bits(got["embed.embedding"], params["embed"]["embedding"].astype(np.float16))


def test_large_transposed_and_unstacked_leaves_stream_in_small_blocks(tmp_path):
    w = rng.standard_normal((4, 300, 70), dtype=np.float32)
    np.savez(tmp_path / "w.npz", stacked=w)
    rules = tt.Rules(unstack=["stacked"], transpose=[("stacked", (1, 0))])
    report = tt.convert(tmp_path / "w.npz", tmp_path / "o.safetensors", rules=rules, block_bytes=1024, verify=True)
    assert report.ok
    got = safetensors.numpy.load_file(tmp_path / "o.safetensors")
    for i in range(4):
        assert _same_bits(got[f"stacked.{i}"], np.ascontiguousarray(w[i].T))


# ---------------------------------------------------------------------------------------------- Hugging Face folders


def test_sharded_folder_matches_its_index_and_transformers_layout(tmp_path):
    tensors = {f"model.layers.{i}.weight": rng.standard_normal((64, 64), dtype=np.float32) for i in range(5)}
    tensors["model.norm.weight"] = np.ones(64, ml_dtypes.bfloat16)
    tensors["lm_head.weight"] = rng.standard_normal((200, 64), dtype=np.float32)  # 51,200 B: over a shard, alone
    safetensors.numpy.save_file(tensors, tmp_path / "src.safetensors")
    shard = 40_000  # two 16 KiB layers per shard
    report = tt.convert(tmp_path / "src.safetensors", tmp_path / "hf", shard_size=shard, verify=True,
                        metadata={"format": "flax", "note": "x"})
    assert report.ok and report.layout == "folder"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    n = len(report.files) - 1
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(report.files)
    assert sorted(set(index["weight_map"].values())) == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    total = 0
    seen = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / "hf" / name, "np") as f:
            assert f.metadata() == {"format": "flax", "note": "x"}
            keys = list(f.keys())
            size = sum(f.get_tensor(k).nbytes for k in keys)
            assert size <= shard or len(keys) == 1
            for k in keys:
                seen[k] = f.get_tensor(k)
                total += seen[k].nbytes
    assert index["metadata"]["total_size"] == total == sum(t.nbytes for t in tensors.values())
    assert {k: v for k, v in index["weight_map"].items()} == {k: report.rows[[r.name for r in report.rows].index(k)].file
                                                              for k in tensors}
    _assert_tree_equal(seen, tensors)
    # greedy in the source order, as huggingface_hub's split_state_dict_into_shards_factory: a tensor over the
    # shard size goes alone into a shard of its own at once, while the current shard goes on filling
    groups = st_writer.shard_groups([st_writer.Tensor(k, v) for k, v in tensors.items()], shard)
    assert [[t.name for t in g] for g in groups] == [
        ["model.layers.0.weight", "model.layers.1.weight"], ["model.layers.2.weight", "model.layers.3.weight"],
        ["lm_head.weight"], ["model.layers.4.weight", "model.norm.weight"]]
    # treetools reads the folder, and the index, as the sharded format
    assert tt.open_source(tmp_path / "hf").format == "safetensors-sharded"


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    np.savez(tmp_path / "w.npz", a=np.ones(3, np.float32))
    report = tt.convert(tmp_path / "w.npz", tmp_path / "hf", verify=True)
    assert report.ok and os.listdir(tmp_path / "hf") == ["model.safetensors"] == report.files
    assert tt.open_source(tmp_path / "hf").format == "safetensors"  # a Hugging Face folder of one file


def test_headers_are_aligned_and_hold_no_gaps(tmp_path):
    tree = {"a": np.ones(3, np.int8), "b": np.ones(5, np.float64), "c": np.ones(7, ml_dtypes.bfloat16),
            "d": np.ones((), np.float32), "e": np.zeros((0, 4), np.float32), "f": np.array([True, False])}
    (tmp_path / "s.msgpack").write_bytes(flax.serialization.to_bytes(tree))
    assert not tt.convert(tmp_path / "s.msgpack", tmp_path / "o.safetensors").skipped
    raw = (tmp_path / "o.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    spans = sorted((e["data_offsets"], k) for k, e in header.items() if k != "__metadata__")
    ends = 0
    for (begin, end), k in spans:
        assert begin == ends  # contiguous, as the safetensors library requires
        assert (8 + n + begin) % np.dtype(tree[k].dtype).itemsize == 0  # each tensor aligned to its item size
        ends = end
    assert 8 + n + ends == len(raw)
    _assert_tree_equal(safetensors.numpy.load_file(tmp_path / "o.safetensors"), tree)


# ---------------------------------------------------------------------------------------------- Orbax output


def test_orbax_manager_step_is_restored_by_orbax_and_treetools(tmp_path):
    params = _params(npz=True)
    np.savez(tmp_path / "w.npz", **_flat(params))
    report = tt.convert(tmp_path / "w.npz", tmp_path / "run", to="orbax", dst_step=100, verify=True)
    assert report.ok and report.layout == "step"
    with ocp.CheckpointManager(os.path.abspath(tmp_path / "run")) as m:
        assert m.all_steps() == [100]
        restored = m.restore(100, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]
    _assert_tree_equal(_flat(restored), _flat(params))
    _assert_tree_equal(tt.flatten(tt.load_parameters(tmp_path / "run")), _flat(params))
    with pytest.raises(tt.CheckpointError, match="already has step 100"):
        tt.convert(tmp_path / "w.npz", tmp_path / "run", to="orbax", dst_step=100)
    tt.convert(tmp_path / "w.npz", tmp_path / "run", to="orbax", dst_step=200)
    assert tt.open_source(tmp_path / "run").steps == [100, 200]


# ---------------------------------------------------------------------------------------------- safety


def test_existing_destination_needs_overwrite_and_is_replaced_whole(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.ones(3, np.float32))
    np.savez(tmp_path / "b.npz", y=np.zeros(2, np.float32))
    for dst, kw in (("o.safetensors", {}), ("hf", {}), ("orb", {"to": "orbax"})):
        tt.convert(tmp_path / "a.npz", tmp_path / dst, **kw)
        with pytest.raises(tt.CheckpointError, match="exists; pass --overwrite"):
            tt.convert(tmp_path / "b.npz", tmp_path / dst, **kw)
        tt.convert(tmp_path / "b.npz", tmp_path / dst, overwrite=True, **kw)
        assert [leaf.name for leaf in tt.open_source(tmp_path / dst).snapshot().items["default"].leaves] == ["y"]
    assert sorted(os.listdir(tmp_path)) == ["a.npz", "b.npz", "hf", "o.safetensors", "orb"]  # no temporaries left


def test_nothing_is_written_under_the_source(tmp_path, capsys):
    _orbax_save(tmp_path / "ckpt", _params())
    before = _tree_hash(tmp_path / "ckpt")
    for dst in (tmp_path / "ckpt" / "out.safetensors", tmp_path / "ckpt", tmp_path):
        with pytest.raises(tt.CheckpointError, match="nothing is ever written under"):
            tt.convert(tmp_path / "ckpt", dst, overwrite=True)
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path), "--overwrite"]) == 1
    assert _tree_hash(tmp_path / "ckpt") == before


def test_dry_run_prints_the_mapping_and_writes_nothing(tmp_path, capsys):
    np.savez(tmp_path / "w.npz", **{"layers/w": np.ones((2, 3, 4), np.float32), "step": np.int64(3)})
    code = main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "hf"), "--dry-run", "--unstack", "^layers",
                 "--transpose", "w$=1,0", "--drop", "^step$", "--dtype", "bfloat16", "--shard-size", "30"])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "hf").exists()
    lines = out.splitlines()
    assert lines[0].split() == ["source", "->", "name", "shape", "dtype", "file", "rules"]
    assert lines[1].split() == ["layers/w[0]", "->", "layers.0.w", "(2,", "3,", "4)", "->", "(4,", "3)", "float32",
                                "->", "bfloat16", "model-00001-of-00002.safetensors", "unstack", "[0],", "transpose",
                                "(1,", "0),", "cast", "bfloat16"]
    assert "model-00002-of-00002.safetensors" in lines[2] and lines[3].split() == ["step", "(dropped)", "drop"]
    assert lines[-1].startswith("dry run:") and "nothing written" in lines[-1]


def test_dry_run_marks_every_leaf_a_rule_touches(tmp_path, capsys):
    # Issue 47 (19): a transpose showed only where the shape changed (`(2, 3) -> (3, 2)`); a square matrix's
    # transpose, and a rename, showed nothing. The `rules` column names every op on every leaf.
    np.savez(tmp_path / "w.npz", **{"a/w": np.ones((4, 4), np.float32), "a/b": np.ones(4, np.float32),
                                    "c/w": np.ones((2, 3), np.float32), "d/e": np.ones(2, np.float32)})
    for extra, file in (([], "model.safetensors"), (["--to", "orbax"], None)):
        assert main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "out"), "--dry-run", "--transpose", "w$=1,0",
                     "--rename", "a/b=>bias", *extra]) == 0
        rows = {line.split()[0]: " ".join(line.split()) for line in capsys.readouterr().out.splitlines()[1:5]}
        at = f" {file}" if file else ""
        # The square matrix keeps its shape: only the column says it is transposed.
        assert rows["a/w"] == f"a/w -> {'a.w' if file else 'a/w'} (4, 4) float32{at} transpose (1, 0)"
        assert rows["c/w"] == f"c/w -> {'c.w' if file else 'c/w'} (2, 3) -> (3, 2) float32{at} transpose (1, 0)"
        assert rows["a/b"] == f"a/b -> bias (4,) float32{at} rename"
        assert rows["d/e"] == f"d/e -> {'d.e' if file else 'd/e'} (2,) float32{at}"  # untouched: nothing
    data = tt.convert(str(tmp_path / "w.npz"), str(tmp_path / "out"), dry_run=True, rules=tt.Rules(
        transpose={"w$": (1, 0)}, rename={"^a/b$": "bias"})).to_json()
    assert {t["source"]: t["ops"] for t in data["tensors"]} == {
        "a/w": ["transpose (1, 0)"], "a/b": ["rename"], "c/w": ["transpose (1, 0)"], "d/e": []}


def test_verify_finds_a_difference_and_the_cli_exits_1(tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "w.npz", a=np.arange(10, dtype=np.float32), b=np.ones(3, np.float32))
    real = st_writer.tensor_blocks

    def damaged(tensors, block_bytes):
        for tensor, block in real(tensors, block_bytes):
            yield tensor, (block + 1 if tensor.name == "a" else block)

    monkeypatch.setattr(st_writer, "tensor_blocks", damaged)
    code = main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "o.safetensors"), "--verify"])
    out = capsys.readouterr().out
    assert code == 1
    assert "problem: `a`: 10 of 10 elements differ from the source (first at (0,))" in out
    assert out.rstrip().endswith("verify: FAILED: 1 problem.")


def test_verify_takes_a_big_endian_source_as_its_little_endian_copy(tmp_path, monkeypatch):
    # Safetensors is little-endian: a big-endian npz source is written byte-swapped, the same values. verify said
    # "holds float32[2, 3], expected float32[2, 3]" (the dtypes differ only in byte order); a real difference in
    # the values is still found.
    src = {"a": np.arange(6, dtype=">f4").reshape(2, 3), "b": np.array([1.5, np.nan, -0.0], ">f8")}
    np.savez(tmp_path / "w.npz", **src)
    report = tt.convert(tmp_path / "w.npz", tmp_path / "o.safetensors", verify=True)
    assert report.ok and report.problems == []
    with safe_open(tmp_path / "o.safetensors", "np") as f:
        for k, v in src.items():
            assert f.get_tensor(k).dtype == v.dtype.newbyteorder("<") and f.get_tensor(k).tobytes() == \
                v.astype(v.dtype.newbyteorder("<")).tobytes(), k
    real = st_writer.tensor_blocks

    def damaged(tensors, block_bytes):
        for tensor, block in real(tensors, block_bytes):
            yield tensor, (block * 2 if tensor.name == "a" else block)

    monkeypatch.setattr(st_writer, "tensor_blocks", damaged)
    report = tt.convert(tmp_path / "w.npz", tmp_path / "o2.safetensors", verify=True)
    assert report.problems == ["`a`: 5 of 6 elements differ from the source (first at (0, 1))."], report.problems


def test_cli_usage_errors_exit_2_and_known_errors_exit_1(tmp_path, capsys):
    np.savez(tmp_path / "w.npz", a=np.ones(3, np.float32))
    src, dst = str(tmp_path / "w.npz"), str(tmp_path / "o.safetensors")
    for bad in (["--rename", "no-arrow"], ["--rename", "x(=>y"], ["--transpose", "w=a,b"], ["--dtype", "nope"],
                ["--cast", "a=int7"], ["--rules", str(tmp_path / "missing.toml")], ["--shard-size", "5XB"],
                ["--to", "orbax"], ["--dst-step", "3"], ["--metadata", "novalue"], ["--step", "-2"]):
        assert main(["convert", src, dst, *bad]) == 2, bad
    assert not os.path.exists(dst)
    capsys.readouterr()
    assert main(["convert", src, dst, "--drop", "nomatch"]) == 1  # rules that do not fit the checkpoint: known error
    assert "matches no leaf" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.npz"), dst]) == 1
    assert main(["convert", src, dst, "--metadata", "format=mlx", "--metadata", "k=v=w"]) == 0
    with safe_open(dst, "np") as f:
        assert f.metadata() == {"format": "mlx", "k": "v=w"}


@pytest.mark.parametrize("name", ["out.npz", "model.msgpack", "pytorch_model.bin", "w.NPY", "m.weights.h5"])
def test_a_dst_named_like_a_file_convert_does_not_write_is_a_usage_error(tmp_path, capsys, name):
    # `convert SRC out.npz` wrote a Hugging Face *folder* named out.npz; now: exit 2, naming DST and the fix.
    np.savez(tmp_path / "w.npz", a=np.ones(3, np.float32))
    src, dst = str(tmp_path / "w.npz"), str(tmp_path / name)
    capsys.readouterr()
    assert main(["convert", src, dst]) == 2
    assert capsys.readouterr().err == (
        f"treetools convert: error: {dst} names a {os.path.splitext(name)[1]} file, which convert does not write: "
        "end it in .safetensors (one safetensors file), or name a folder (Hugging Face shards; Orbax with --to "
        "orbax).\n")
    assert main(["convert", src, dst, "--to", "orbax"]) == 2
    assert capsys.readouterr().err == (f"treetools convert: error: --to orbax writes a folder; {dst} names a "
                                       f"{os.path.splitext(name)[1]} file: name a folder instead.\n")
    with pytest.raises(tt.UsageError, match=re.escape(dst)):
        tt.convert(src, dst, dry_run=True)
    assert not os.path.exists(dst) and sorted(os.listdir(tmp_path)) == ["w.npz"]
    # A folder name (no file suffix) and a .safetensors file are what convert writes.
    assert main(["convert", src, str(tmp_path / "out"), "--dry-run"]) == 0
    assert main(["convert", src, str(tmp_path / "out.safetensors"), "--dry-run"]) == 0


def test_step_all_is_one_usage_line_exit_2_checked_once_in_the_library(tmp_path, capsys):
    # Issue 36: `convert CKPT out.safetensors --step all` ended in a TypeError traceback (the CLI compared "all" < 0).
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "run", async_save=False)
    for step in (1, 2):
        tt.save_checkpoint(mngr, step, {"params": {"w": np.full(3, step, np.float32)}})
    mngr.close()
    dst = tmp_path / "o.safetensors"
    assert main(["convert", str(tmp_path / "run"), str(dst), "--step", "all"]) == 2
    cap = capsys.readouterr()
    assert (cap.out, cap.err) == ("", "treetools convert: error: --step all (`step='all'`): convert writes one step; "
                                      "pick one (--step N, or latest).\n")
    # The same check is the library's: one exception type, a ValueError, raised before anything is read or written.
    for bad in ({"step": "all"}, {"to": "orbax"}, {"dst_step": 3}, {"shard_size": "5XB"}, {"to": "zip"}):
        with pytest.raises(tt.UsageError) as e:
            tt.convert(str(tmp_path / "run"), str(dst), **bad)
        assert isinstance(e.value, ValueError) and "\n" not in str(e.value), bad
    assert not dst.exists()
    assert main(["convert", str(tmp_path / "run"), str(dst), "--step", "1"]) == 0
    assert safetensors.numpy.load_file(dst)["w"].tolist() == [1.0, 1.0, 1.0]


def test_values_that_are_not_arrays_are_left_out_with_a_note(tmp_path, capsys):
    (tmp_path / "s.msgpack").write_bytes(flax.serialization.to_bytes({"w": np.ones(2, np.float32), "name": "gpt"}))
    assert main(["convert", str(tmp_path / "s.msgpack"), str(tmp_path / "o.safetensors")]) == 0
    assert "left out `name`: not an array" in capsys.readouterr().err
    assert list(safetensors.numpy.load_file(tmp_path / "o.safetensors")) == ["w"]


def test_a_dtype_safetensors_cannot_hold_is_one_error_naming_the_leaf(tmp_path):
    np.savez(tmp_path / "w.npz", z=np.ones(2, np.complex128))
    with pytest.raises(tt.CheckpointError, match="`z` has dtype complex128, which safetensors cannot hold"):
        tt.convert(tmp_path / "w.npz", tmp_path / "o.safetensors")
    tt.convert(tmp_path / "w.npz", tmp_path / "o.safetensors", rules=tt.Rules(cast={"z": "complex64"}))


def test_progress_bar_draws_per_block_on_a_terminal(tmp_path, capsys):
    np.savez(tmp_path / "w.npz", a=np.ones(2**16, np.float32))
    tt.convert(tmp_path / "w.npz", tmp_path / "o.safetensors", progress=True, block_bytes=4096)
    err = capsys.readouterr().err
    assert "\r[" in err and " a" in err
    tt.convert(tmp_path / "w.npz", tmp_path / "p.safetensors")  # not a terminal: nothing drawn
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------- interrupted writes


_SLOW_CHILD = """
import sys, time
import treetools as tt
from treetools.checkpoint_io.writers import safetensors as w
real = w.tensor_blocks
def slow(tensors, block_bytes):
    for tensor, block in real(tensors, block_bytes):
        time.sleep(0.02)
        yield tensor, block
w.tensor_blocks = slow
print("started", flush=True)
tt.convert(sys.argv[1], sys.argv[2], block_bytes=1 << 16, overwrite=len(sys.argv) > 3)
print("finished", flush=True)
"""


@pytest.mark.parametrize("dst_name,overwrite", [("o.safetensors", False), ("hf", False), ("hf", True)])
def test_sigkill_part_way_leaves_no_destination_that_reads_as_complete(tmp_path, dst_name, overwrite):
    np.savez(tmp_path / "w.npz", **{f"w{i}": rng.standard_normal(2**16, dtype=np.float32) for i in range(4)})
    dst = tmp_path / dst_name
    if overwrite:  # an old, complete destination: it must survive a killed overwrite
        np.savez(tmp_path / "old.npz", old=np.ones(2, np.float32))
        tt.convert(tmp_path / "old.npz", dst, shard_size=4)
        old = _tree_hash(dst)
    args = [sys.executable, "-c", _SLOW_CHILD, str(tmp_path / "w.npz"), str(dst)] + (["overwrite"] if overwrite else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        assert proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until data is being written under the temporary name
            tmps = [p for p in tmp_path.iterdir() if ".treetools-tmp-" in p.name]
            written = sum(f.stat().st_size for t in tmps for f in ([t] if t.is_file() else t.iterdir()))
            if written > 2**17:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the child wrote nothing")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.stdout.close()
    if overwrite:
        assert _tree_hash(dst) == old  # the old checkpoint, whole
    else:
        assert not dst.exists()
        with pytest.raises(tt.CheckpointNotFoundError):
            tt.open_source(dst)
    leftovers = [p.name for p in tmp_path.iterdir() if ".treetools-tmp-" in p.name]
    assert leftovers and all(n.startswith(f".{dst_name}.treetools-tmp-") for n in leftovers)  # hidden, beside DST


# ---------------------------------------------------------------------------------------------- memory


# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child of pytest would start at pytest's peak.
_MEMORY_CHILD = """
import sys
import treetools as tt
def peak_kib():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
tt.convert(sys.argv[1], sys.argv[3])
tiny = peak_kib()
tt.convert(sys.argv[2], sys.argv[4], verify=True)
print(tiny, peak_kib())
"""


def _write_safetensors_streamed(path, sizes):
    """A safetensors file of random float32 tensors of ``sizes`` elements, written without holding any whole."""
    tensors = [st_writer.Tensor(f"t{i}", np.broadcast_to(np.float32(0), (n,))) for i, n in enumerate(sizes)]
    with open(path, "wb") as f:
        f.write(st_writer.header(tensors, {"format": "pt"}))
        for n in sizes:
            for a in range(0, n, 2**22):
                f.write(rng.standard_normal(min(2**22, n - a), dtype=np.float32).tobytes())


def _convert_peak_growth_mib(tmp_path, **env) -> float:
    """The child's peak RSS after a 512 MiB convert + verify over its peak after a 16-byte one, in MiB."""
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    (tmp_path / "tiny.safetensors").unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(tmp_path / "tiny.npz"),
                           str(tmp_path / "big.safetensors"), str(tmp_path / "tiny.safetensors"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 2**29
    tiny_kib, big_kib = map(int, proc.stdout.split())
    print(f"peak RSS: tiny convert {tiny_kib // 1024} MiB, 512 MiB convert + verify {big_kib // 1024} MiB {env}")
    return (big_kib - tiny_kib) / 1024


def test_peak_memory_does_not_grow_with_the_checkpoint(tmp_path):
    # 512 MiB with one 256 MiB leaf, against a tiny conversion in the same process (imports, threads, buffers).
    # What treetools holds is a few blocks (8 MiB by default): two read ahead and one being read per core, 48 MiB
    # on 2 cores (docs/convert.md); verify's half blocks come after the write. Measured with glibc giving each freed block
    # back at once (MALLOC_MMAP_THRESHOLD_, so malloc's cache does not count): 40-44 MiB, quiet or with the cores
    # shared. As a user's process runs (glibc's defaults), malloc also keeps freed blocks in its per-thread
    # arenas: 52-68 MiB quiet, 72-96 MiB with other jobs on the cores. Loading the 256 MiB leaf whole would add
    # at least 256 MiB.
    _write_safetensors_streamed(tmp_path / "big.safetensors", [2**26] + [2**24] * 4)
    np.savez(tmp_path / "tiny.npz", a=np.ones(4, np.float32))
    blocks_mib = 3 * cores() * block_bytes_from(os.environ.get("TREETOOLS_CHUNK_BYTES")) / 2**20  # the child's blocks
    held = _convert_peak_growth_mib(tmp_path, MALLOC_MMAP_THRESHOLD_=str(2**20))
    assert held < blocks_mib + 16, f"converting 512 MiB held {held:.0f} MiB more than a tiny conversion"
    grown = _convert_peak_growth_mib(tmp_path)
    assert grown < 2 * (blocks_mib + 16), f"converting 512 MiB grew the peak RSS by {grown:.0f} MiB"


# ---------------------------------------------------------------------------------------------- buckets


def test_bucket_destinations_stream_their_uploads(tmp_path, remote_store, monkeypatch):
    params = _params(npz=True)
    np.savez(tmp_path / "w.npz", **_flat(params))
    want = _flat(params, sep=".")
    one = remote_store.url("export", "model.safetensors")
    report = tt.convert(tmp_path / "w.npz", one, verify=True)
    assert report.ok
    remote_store.fs().get(one, str(tmp_path / "one.safetensors"))
    _assert_tree_equal(safetensors.numpy.load_file(tmp_path / "one.safetensors"), want)
    folder = remote_store.url("export", "hf")
    report = tt.convert(one, folder, shard_size=600, verify=True)  # bucket to bucket
    assert report.ok and len(report.files) > 2
    remote_store.fs().get(folder, str(tmp_path / "hf"), recursive=True)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    got = {}
    for name in set(index["weight_map"].values()):
        got.update(safetensors.numpy.load_file(tmp_path / "hf" / name))
    _assert_tree_equal(got, want)
    with pytest.raises(tt.CheckpointError, match="exists"):
        tt.convert(tmp_path / "w.npz", folder)
    tt.convert(tmp_path / "w.npz", folder, overwrite=True)  # one shard now: the old shards and index are gone
    assert sorted(p.rsplit("/", 1)[-1] for p in remote_store.fs().ls(folder)) == ["model.safetensors"]


def test_a_failed_bucket_upload_leaves_no_object(tmp_path, remote_store, monkeypatch):
    from treetools.checkpoint_io.storage import bucket

    monkeypatch.setattr(bucket, "UPLOAD_BLOCK", 5 * 2**20)  # S3's smallest part: a multipart upload starts
    np.savez(tmp_path / "w.npz", a=rng.standard_normal(2**22, dtype=np.float32), b=np.ones(3, np.float32))
    real = st_writer.tensor_blocks

    def failing(tensors, block_bytes):
        for i, (tensor, block) in enumerate(real(tensors, block_bytes)):
            if i == 2:
                raise OSError("disk gone")
            yield tensor, block

    monkeypatch.setattr(st_writer, "tensor_blocks", failing)
    for dst in (remote_store.url("x.safetensors"), remote_store.url("hf")):
        with pytest.raises(OSError, match="disk gone"):
            tt.convert(tmp_path / "w.npz", dst, block_bytes=4 * 2**20)
        assert not remote_store.fs().exists(dst)


# ---------------------------------------------------------------------------------------------- layers


def test_writers_import_no_jax():
    code = ("import sys, treetools.checkpoint_io.writers.safetensors, treetools.checkpoint_io.writers.orbax, treetools.checkpoint_tools.convert\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'orbax')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- docs/convert.md


DOC = Path(__file__).parent.parent / "docs" / "convert.md"


def _doc_blocks() -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_docs_convert_md_shell_lines_are_the_gpt2_conversion(tmp_path, monkeypatch):
    # Each block of the page runs on its own (tests/test_readme.py runs them all); the page's shell lines run in
    # the folder the GPT-2 block wrote (its `workdir`): its dry run lists the mapping, its write verifies.
    blocks = _doc_blocks()
    assert len(blocks) == 3
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the block's mkdtemp() under this test's folder
    namespace: dict = {}
    exec(compile(blocks[1], str(DOC), "exec"), namespace)  # noqa: S102 - the documentation's own example
    workdir = Path(namespace["workdir"])
    monkeypatch.chdir(workdir)
    rules = "gpt2_to_pt.toml"
    assert main(["convert", "flax_model.msgpack", "gpt2-cli/", "--rules", rules, "--dry-run"]) == 0
    assert main(["convert", "flax_model.msgpack", "gpt2-cli/", "--rules", rules, "--verify"]) == 0
    a = safetensors.numpy.load_file(workdir / "gpt2-cli" / "model.safetensors")
    _assert_tree_equal(a, safetensors.numpy.load_file(workdir / "gpt2-hf" / "model.safetensors"))


def test_gpt2_names_and_values_match_transformers_flax_to_pytorch_rule(tmp_path, monkeypatch):
    # transformers' load_flax_weights_in_pytorch_model (src/transformers/modeling_flax_pytorch_utils.py, v4.x):
    # a "kernel" becomes "weight" transposed (.T), "scale"/"embedding" become "weight", names join with ".".
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict = {}
    exec(compile(_doc_blocks()[1], str(DOC), "exec"), namespace)  # noqa: S102 - the GPT-2 block, on its own
    expected = {}
    for keys, value in flax.traverse_util.flatten_dict(namespace["flax_params"]).items():
        if keys[-1] == "kernel":
            keys, value = keys[:-1] + ("weight",), value.T
        elif keys[-1] in ("scale", "embedding"):
            keys = keys[:-1] + ("weight",)
        expected[".".join(keys)] = np.ascontiguousarray(value)
    got = safetensors.numpy.load_file(Path(namespace["workdir"]) / "gpt2-hf" / "model.safetensors")
    _assert_tree_equal(got, expected)
    # and the PyTorch GPT-2 state dict's names and shapes (GPT2LMHeadModel without the tied lm_head)
    D, L = namespace["D"], namespace["L"]
    per_layer = {"ln_1.weight": (D,), "ln_1.bias": (D,), "attn.c_attn.weight": (D, 3 * D), "attn.c_attn.bias": (3 * D,),
                 "attn.c_proj.weight": (D, D), "attn.c_proj.bias": (D,), "ln_2.weight": (D,), "ln_2.bias": (D,),
                 "mlp.c_fc.weight": (D, 4 * D), "mlp.c_fc.bias": (4 * D,), "mlp.c_proj.weight": (4 * D, D),
                 "mlp.c_proj.bias": (D,)}
    shapes = {"transformer.wte.weight": (50, D), "transformer.wpe.weight": (16, D), "transformer.ln_f.weight": (D,),
              "transformer.ln_f.bias": (D,)}
    shapes.update({f"transformer.h.{i}.{k}": s for i in range(L) for k, s in per_layer.items()})
    assert {k: v.shape for k, v in got.items()} == shapes


def test_gpt2_against_transformers_own_conversion(tmp_path):
    # Only where transformers still has Flax (before v5) and PyTorch is installed; neither is a test dependency.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models (removed in v5)")
    from transformers.modeling_flax_pytorch_utils import load_flax_weights_in_pytorch_model

    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    flax_model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    flax_model.save_pretrained(tmp_path / "flax")  # flax_model.msgpack, as the Hub holds them
    import re

    (tmp_path / "gpt2_to_pt.toml").write_text(re.search(r'rules_toml = r"""(.*?)"""', DOC.read_text(), re.S).group(1))
    rules = tt.Rules.from_file(tmp_path / "gpt2_to_pt.toml")
    assert tt.convert(tmp_path / "flax" / "flax_model.msgpack", tmp_path / "pt", rules=rules, verify=True).ok
    ours = safetensors.numpy.load_file(tmp_path / "pt" / "model.safetensors")
    reference = load_flax_weights_in_pytorch_model(transformers.GPT2LMHeadModel(config), flax_model.params).state_dict()
    for name, value in ours.items():
        assert np.array_equal(value, reference[name].detach().numpy()), name
    missing = set(reference) - set(ours)
    assert missing <= {"lm_head.weight"} | {k for k in reference if k.endswith((".attn.bias", ".attn.masked_bias"))}
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pt")  # transformers loads the folder itself
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, reference["transformer.h.1.mlp.c_fc.weight"])


def test_verify_counts_every_difference_across_blocks_and_names_the_first_in_c_order(tmp_path, monkeypatch):
    """Damage in several blocks of a 2-D tensor read back in 1 KiB blocks: the count and the first position
    equal numpy's, from the written file read by safetensors' own reader against the source."""
    from safetensors.numpy import load_file

    src = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    np.savez(tmp_path / "w.npz", a=src, b=np.ones(3, np.float32))
    damage = {40 * 32 + 7, 10 * 32 + 3, 12 * 32}  # flat positions in three different 1 KiB blocks
    real = st_writer.tensor_blocks

    def damaged(tensors, block_bytes):
        at: dict[str, int] = {}
        for tensor, block in real(tensors, block_bytes):
            start = at.get(tensor.name, 0)
            at[tensor.name] = start + block.size
            if tensor.name == "a":
                block = block.copy()
                flat = block.reshape(-1)
                for pos in damage:
                    if start <= pos < start + flat.size:
                        flat[pos - start] = -1.0
            yield tensor, block

    monkeypatch.setattr(st_writer, "tensor_blocks", damaged)
    report = tt.convert(tmp_path / "w.npz", tmp_path / "o.safetensors", block_bytes=1024, verify=True)
    bad = np.argwhere(load_file(str(tmp_path / "o.safetensors"))["a"] != src)
    assert len(bad) == len(damage)
    first = tuple(int(i) for i in bad[0])  # argwhere lists positions in C order
    assert report.problems == [f"`a`: {len(bad)} of {src.size:,} elements differ from the source (first at {first})."]
    assert not report.ok
