"""T5X checkpoints (and Orbax < 0.5 items), written the way T5X and old Orbax write them (tests/_t5x_writer.py).

The truth is always the writer's own numpy arrays.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util

import treetools as tt
from treetools.checkpoint_io.context import ReadContext
from treetools.cli import main
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError
from treetools.checkpoint_tools.diff import diff_paths
from treetools.checkpoint_tools.report import inspect_path
from treetools.checkpoint_tools.show import show_leaf
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_tools.verify import verify_path

from tests._t5x_writer import save_orbax_legacy_item, save_orbax_legacy_step, save_t5x

KERNEL = "encoder/layers_0/attention/query/kernel"
INLINE = ("state/step", "target/encoder/layer_norm/scale")  # unpartitioned: kept in the msgpack


def _state(step: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    target = {"encoder": {"layers_0": {"attention": {"query": {"kernel": rng.standard_normal((8, 6)).astype(np.float32)}}},
                          "layer_norm": {"scale": rng.standard_normal(6).astype(np.float32)}},
              "token_embedder": {"embedding": rng.standard_normal((16, 6)).astype(np.float32)}}
    # Adafactor's factored second moments, as T5X keeps them under state/param_states.
    param_states = {"encoder": {"layers_0": {"attention": {"query": {"kernel": {
        "v_row": rng.random(8).astype(np.float32), "v_col": rng.random(6).astype(np.float32)}}}}}}
    return {"target": target, "state": {"step": np.array(step, np.int32), "param_states": param_states}}


def _flat(tree: dict) -> dict[str, np.ndarray]:
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Steps 100 and 200 (different values) and an unfinished save of step 300."""
    root = tmp_path_factory.mktemp("t5x") / "model"
    root.mkdir()
    truth = {}
    for step, seed in ((100, 0), (200, 1)):
        truth[step] = _state(step, seed)
        save_t5x(root, step, truth[step], inline=INLINE, target_elements=16)  # 16-element chunks: several per array
    tmp = save_t5x(root, 300, _state(300, 2), inline=INLINE, finish=False, timestamp=1700000300)
    # Unreadable garbage where the finished files would be: reading any of it would fail.
    with open(os.path.join(tmp, "checkpoint"), "wb") as f:
        f.write(b"\x81\xa7version")  # a msgpack map, cut short
    with open(os.path.join(tmp, "target.token_embedder.embedding", ".zarray"), "w") as f:
        f.write("{not json")
    return root, truth


def _leaves(report: dict) -> dict[str, dict]:
    """Rows by state-dict path: a T5X step's items are its top-level keys (target, state), so
    ``item/path``; an Orbax (< 0.5) item file is one item, ``default``, its paths as they are."""
    items = report["checkpoints"][0]["items"]
    if list(items) == ["default"]:
        return {leaf["path"]: leaf for leaf in items["default"]["leaves"]}
    return {f"{name}/{leaf['path']}": leaf for name, item in items.items() for leaf in item["leaves"]}


# ----------------------------------------------------------------------------- steps, layouts


class _Opens:
    """Paths Python opens while active (one audit hook for the session; TensorStore's own reads are not seen)."""

    paths: list[str] | None = None
    installed = False

    def __enter__(self):
        if not _Opens.installed:
            sys.addaudithook(lambda event, args: _Opens.paths.append(os.fspath(args[0]))
                             if event == "open" and _Opens.paths is not None
                             and isinstance(args[0], (str, bytes, os.PathLike)) else None)
            _Opens.installed = True
        _Opens.paths = self.paths = []
        return self

    def __exit__(self, *exc):
        _Opens.paths = None


def test_model_dir_lists_steps_and_the_unfinished_save_without_opening_it(model_dir, capsys):
    root, truth = model_dir
    with _Opens() as opens:
        assert main(["inspect", str(root), "--step", "all", "--stats", "--format", "json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert main(["verify", str(root), "--step", "all"]) == 0
    assert capsys.readouterr().out.count("ok:") == 2
    assert rep["format"] == "t5x"
    assert rep["steps"] == [100, 200]
    assert rep["incomplete"] == ["checkpoint_300.tmp-1700000300"]
    assert [c["step"] for c in rep["checkpoints"]] == [100, 200]
    assert any(str(p).endswith("checkpoint_200/checkpoint") for p in opens.paths)  # the hook does see our reads
    assert not any(".tmp-" in str(p) for p in opens.paths)
    assert open_source(str(root)).resolve("latest") == 200
    with pytest.raises(CheckpointNotFoundError, match=r"step 300 is an incomplete save \(checkpoint_300.tmp-1700000300\)"):
        tt.load_parameters(root, step=300)
    assert main(["inspect", str(root / "checkpoint_300.tmp-1700000300")]) == 1
    assert "incomplete save" in capsys.readouterr().err


def test_root_step_folder_and_checkpoint_file_read_the_same_leaves(model_dir):
    root, truth = model_dir
    step_dir = root / "checkpoint_200"
    want = _flat(truth[200])
    for path in (root, step_dir, step_dir / "checkpoint"):
        rep = inspect_path(str(path)).to_json()
        assert rep["format"] == "t5x"
        leaves = _leaves(rep)
        # A TensorStore spec is one leaf: no driver/kvstore/metadata parts.
        assert sorted(leaves) == sorted(want)
        for name, arr in want.items():
            assert leaves[name]["shape"] == list(arr.shape)
            assert leaves[name]["dtype"] == str(arr.dtype)
        assert rep["checkpoints"][0]["step"] == 200
        assert rep["checkpoints"][0]["metadata"]["custom"] == {"t5x_checkpoint_version": 3}
    with pytest.raises(CheckpointError, match="single checkpoint"):
        open_source(str(step_dir)).resolve(100)


def test_load_parameters_is_the_target_tree_as_host_numpy(model_dir):
    root, truth = model_dir
    for path, step in ((root, -1), (root, 100), (root / "checkpoint_200", -1), (root / "checkpoint_200" / "checkpoint", -1)):
        got = _flat(tt.load_parameters(path, step=step))
        want = _flat(truth[200 if step == -1 else step]["target"])
        assert sorted(got) == sorted(want)
        for name, arr in want.items():
            assert isinstance(got[name], np.ndarray) and got[name].dtype == arr.dtype
            np.testing.assert_array_equal(got[name], arr)


def test_shapes_and_dtypes_come_from_metadata_without_reading_array_data(model_dir, tmp_path):
    root, truth = model_dir
    step_dir = tmp_path / "checkpoint_100"
    shutil.copytree(root / "checkpoint_100", step_dir)
    folder = step_dir / "target.token_embedder.embedding"
    chunks = [p for p in folder.iterdir() if p.name != ".zarray"]
    assert len(chunks) > 1  # 16x6 in chunks of <= 16 elements
    for chunk in chunks:
        chunk.write_bytes(b"garbage, not gzip")
    leaves = _leaves(inspect_path(str(step_dir)).to_json())
    assert leaves["target/token_embedder/embedding"]["shape"] == [16, 6]
    # The data is only read on request, and then the damage is found and named.
    assert main(["inspect", str(step_dir), "--stats"]) == 1
    report = verify_path(str(step_dir))
    assert not report.ok
    assert any("token_embedder/embedding" in p for p in report.problems)


def test_bfloat16_saves_inline_and_in_tensorstore(tmp_path):
    state = _state(7, 3)
    save_t5x(tmp_path, 7, state, inline=INLINE, save_dtype=ml_dtypes.bfloat16, target_elements=16)
    # T5X casts `target` to save_dtype (in TensorStore and inline alike); optimizer state keeps its dtype.
    with open(tmp_path / "checkpoint_7" / "target.encoder.layers_0.attention.query.kernel" / ".zarray") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    leaves = _leaves(inspect_path(str(tmp_path), stats=True).to_json())
    for name, arr in _flat(state["target"]).items():
        assert leaves[f"target/{name}"]["dtype"] == "bfloat16"
        want = arr.astype(ml_dtypes.bfloat16).astype(np.float64)
        assert leaves[f"target/{name}"]["stats"]["mean"] == pytest.approx(want.mean(), rel=1e-12)
    assert leaves["state/param_states/" + KERNEL + "/v_row"]["dtype"] == "float32"
    got = _flat(tt.load_parameters(tmp_path))
    for name, arr in _flat(state["target"]).items():
        assert got[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got[name], arr.astype(ml_dtypes.bfloat16))


# ----------------------------------------------------------------------------- values


def test_stats_equal_numpy_float64(model_dir):
    root, truth = model_dir
    leaves = _leaves(inspect_path(str(root), step=100, stats=True).to_json())
    for name, arr in _flat(truth[100]).items():
        x = np.asarray(arr, np.float64).ravel()
        stats = leaves[name]["stats"]
        # stats.py reduces float32 pieces in float32 (float64 between pieces): ~1e-7 relative per element.
        tol = dict(rel=1e-6, abs=1e-6 * (np.abs(x).max() or 1.0))
        assert stats["mean"] == pytest.approx(x.mean(), **tol), name
        assert stats["std"] == pytest.approx(x.std(), **tol), name
        assert stats["min"] == x.min() and stats["max"] == x.max(), name
        assert stats["l2"] == pytest.approx(np.sqrt((x * x).sum()), rel=1e-6), name


def test_show_reads_a_slice_of_a_tensorstore_leaf_and_an_inline_one(model_dir, capsys):
    root, truth = model_dir
    kernel = truth[200]["target"]["encoder"]["layers_0"]["attention"]["query"]["kernel"]
    name, value = show_leaf(str(root), f"target/{KERNEL}[2:5, -1]")
    assert name == f"target/{KERNEL}"
    np.testing.assert_array_equal(value, kernel[2:5, -1])
    name, value = show_leaf(str(root), "state/step")
    assert int(value) == 200
    assert main(["inspect", str(root), "--show", f"target/{KERNEL}[0, 0:2]", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["path"] == f"target/{KERNEL}"
    np.testing.assert_array_equal(np.asarray(shown["value"], np.float32), kernel[0, 0:2])  # float32 -> JSON is exact


def test_diff_between_steps_and_against_an_orbax_save_of_the_same_params(model_dir, tmp_path, capsys):
    root, truth = model_dir
    a, b = root / "checkpoint_100", root / "checkpoint_200"
    assert main(["diff", str(a), str(b), "--values"]) == 1
    assert main(["diff", str(a), str(a), "--values"]) == 0
    report = diff_paths(str(a), str(b), values=True)
    assert report.counts()["outside_tolerance"] == len(_flat(truth[100]))  # other seed, other step: every leaf moved
    # The same parameters saved by Orbax: T5X's `target` against the Orbax `params` item.
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "orbax", async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": truth[200]["target"]})
    mngr.close()
    capsys.readouterr()
    assert main(["diff", str(b), str(tmp_path / "orbax"), "--item", "target", "--values"]) == 0
    report = diff_paths(str(b), str(tmp_path / "orbax"), item="target", values=True)
    assert report.identical and report.counts()["bit_identical"] == len(_flat(truth[200]["target"]))
    assert main(["diff", str(a), str(tmp_path / "orbax"), "--item", "target", "--values"]) == 1


def test_verify_reads_every_array(model_dir):
    root, truth = model_dir
    report = verify_path(str(root))
    assert report.ok, report.problems
    assert report.step == 200 and report.leaves == len(_flat(truth[200]))
    assert report.bytes == sum(np.asarray(v).nbytes for v in _flat(truth[200]).values())


# ----------------------------------------------------------------------------- Orbax < 0.5 and T5X on it


def test_orbax_before_0_5_root_step_and_item_folders(tmp_path):
    state = _state(5, 4)
    # T5X's Orbax-era manager: step folders `checkpoint_<step>`, one item `state`; and a `_sharding`
    # file, which the orbax format claims (and refuses without _METADATA): t5x is asked first.
    step_dir = save_orbax_legacy_step(tmp_path / "run", 5, {"state": state}, prefix="checkpoint",
                                      aggregate=["state.step"], sharding_file=True)
    item_dir = os.path.join(step_dir, "state")
    assert os.path.exists(os.path.join(item_dir, "_sharding")) and not os.path.exists(os.path.join(item_dir, "_METADATA"))
    want = _flat(state)
    for path in (tmp_path / "run", step_dir, item_dir, os.path.join(item_dir, "checkpoint")):
        rep = inspect_path(str(path), stats=True).to_json()
        assert rep["format"] == "t5x"
        items = rep["checkpoints"][0]["items"]
        leaves = {leaf["path"]: leaf for leaf in next(iter(items.values()))["leaves"]}
        assert sorted(leaves) == sorted(want)
        for name, arr in want.items():
            assert leaves[name]["shape"] == list(arr.shape)
            assert leaves[name]["stats"]["max"] == pytest.approx(float(np.max(arr)))
    assert list(inspect_path(str(tmp_path / "run")).to_json()["checkpoints"][0]["items"]) == ["state"]
    assert open_source(str(tmp_path / "run")).steps == [5]
    got = _flat(tt.load_parameters(tmp_path / "run"))  # the lone item `state`, then its `target`
    assert sorted(got) == sorted(_flat(state["target"]))
    for name, arr in _flat(state["target"]).items():
        np.testing.assert_array_equal(got[name], arr)
    assert verify_path(str(tmp_path / "run")).ok


def test_orbax_before_0_5_plain_manager_root_with_an_unfinished_step(tmp_path):
    params = _state(1, 5)["target"]
    save_orbax_legacy_step(tmp_path / "run", 1, {"params": params})
    os.makedirs(tmp_path / "run" / "2.orbax-checkpoint-tmp-1700000002" / "params")
    src = open_source(str(tmp_path / "run"))
    assert src.format == "t5x" and src.steps == [1] and src.incomplete == ["2.orbax-checkpoint-tmp-1700000002"]
    got = _flat(tt.load_parameters(tmp_path / "run"))
    for name, arr in _flat(params).items():
        np.testing.assert_array_equal(got[name], arr)


def test_zarr_folder_without_zarray_is_one_precise_refusal(tmp_path):
    save_orbax_legacy_item(tmp_path / "item", {"w": np.arange(4.0)})
    os.remove(tmp_path / "item" / "w" / ".zarray")
    with pytest.raises(CheckpointError, match=r"item/w: zarr folder without \.zarray \(`w`\)"):
        inspect_path(str(tmp_path / "item"))


# ----------------------------------------------------------------------------- corrupt and hostile


def _copy_step(model_dir, tmp_path):
    root, _ = model_dir
    step_dir = tmp_path / "checkpoint_100"
    shutil.copytree(root / "checkpoint_100", step_dir)
    return step_dir


def _rewrite_spec(step_dir, change):
    """Edit the TensorStore spec of the embedding in the `checkpoint` msgpack (as a hostile writer could)."""
    import msgpack

    path = step_dir / "checkpoint"
    tree = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    change(tree["optimizer"]["target"]["token_embedder"]["embedding"])
    path.write_bytes(msgpack.packb(tree, use_bin_type=True))


def test_truncated_checkpoint_msgpack_is_one_line_naming_the_file(model_dir, tmp_path, capsys):
    step_dir = _copy_step(model_dir, tmp_path)
    data = (step_dir / "checkpoint").read_bytes()
    (step_dir / "checkpoint").write_bytes(data[: len(data) // 2])
    assert main(["inspect", str(step_dir)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "checkpoint_100/checkpoint: corrupt or truncated `checkpoint` msgpack" in err and "copy the step folder" in err


def test_spec_pointing_at_a_missing_zarr_folder(model_dir, tmp_path):
    step_dir = _copy_step(model_dir, tmp_path)
    shutil.rmtree(step_dir / "target.token_embedder.embedding")
    with pytest.raises(CheckpointError, match=r"`target/token_embedder/embedding` is stored in the zarr folder "
                                              r"'target.token_embedder.embedding', which is missing"):
        tt.load_parameters(step_dir)


@pytest.mark.parametrize("path", ["../outside", "/etc", "a/../../outside"])
def test_kvstore_paths_that_escape_the_step_folder_are_refused(model_dir, tmp_path, path):
    step_dir = _copy_step(model_dir, tmp_path)
    _rewrite_spec(step_dir, lambda spec: spec["kvstore"].update(path=path))
    with pytest.raises(CheckpointError, match="tries to escape the checkpoint folder"):
        inspect_path(str(step_dir))


def test_a_symlinked_zarr_folder_leading_outside_is_refused(model_dir, tmp_path):
    step_dir = _copy_step(model_dir, tmp_path)
    outside = tmp_path / "elsewhere"
    shutil.move(step_dir / "target.token_embedder.embedding", outside)
    os.symlink(outside, step_dir / "target.token_embedder.embedding")
    with pytest.raises(CheckpointError, match="resolves outside"):
        inspect_path(str(step_dir))


def test_other_tensorstore_drivers_and_disagreeing_specs_are_refused(model_dir, tmp_path):
    step_dir = _copy_step(model_dir, tmp_path)
    _rewrite_spec(step_dir, lambda spec: spec["kvstore"].update(driver="memory"))
    with pytest.raises(CheckpointError, match="'zarr' over 'memory'"):
        inspect_path(str(step_dir))
    step_dir = _copy_step(model_dir, tmp_path / "b")
    _rewrite_spec(step_dir, lambda spec: spec["metadata"].update(shape=[16, 7]))
    with pytest.raises(CheckpointError, match=r"\[16, 7\] in the `checkpoint` file but float32\[16, 6\]"):
        inspect_path(str(step_dir))


def test_a_fifo_instead_of_zarray_is_refused_not_waited_on(model_dir, tmp_path):
    step_dir = _copy_step(model_dir, tmp_path)
    zarray = step_dir / "target.token_embedder.embedding" / ".zarray"
    zarray.unlink()
    os.mkfifo(zarray)
    with pytest.raises(CheckpointError, match="not a regular file"):
        inspect_path(str(step_dir))


def test_claims_need_positive_evidence(tmp_path):
    from treetools.checkpoint_io.formats.t5x import FORMAT

    (tmp_path / "checkpoint").write_text("model_checkpoint_path: \"model.ckpt-100\"\n")  # TensorFlow's index file
    assert not FORMAT.claims(str(tmp_path / "checkpoint"), ReadContext().confined_to(str(tmp_path)))
    assert not FORMAT.claims(str(tmp_path), ReadContext().confined_to(str(tmp_path)))
    (tmp_path / "checkpoint_5").mkdir()  # a step-like name with nothing in it
    assert not FORMAT.claims(str(tmp_path), ReadContext().confined_to(str(tmp_path)))
    with pytest.raises(CheckpointError, match="not a checkpoint that treetools can read"):
        open_source(str(tmp_path))


def test_metadata_and_stats_import_neither_jax_nor_flax(model_dir):
    import subprocess

    root, _ = model_dir
    code = ("import sys\n"
            "from treetools.cli import main\n"
            f"assert main(['inspect', {str(root)!r}, '--stats']) == 0\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'orbax', 'flax'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(t5x)" in proc.stdout


def test_orbax_before_0_5_item_in_ocdbt(tmp_path):
    import tensorstore as ts

    # Orbax's use_ocdbt=True: every array in one OCDBT store rooted in the item folder, placeholders in `checkpoint`.
    tree = {"a": {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4)}, "n": np.int32(3)}
    item = tmp_path / "params"
    item.mkdir()
    kvstore = {"driver": "ocdbt", "base": f"file://{item}/"}
    for keys, arr in traverse_util.flatten_dict(tree).items():
        spec = {"driver": "zarr", "kvstore": dict(kvstore, path=".".join(keys)),
                "metadata": {"shape": list(np.shape(arr)), "dtype": np.asarray(arr).dtype.str}}
        ts.open(spec, create=True, open=True).result()[...].write(np.asarray(arr)).result()
    from flax import serialization

    placeholders = traverse_util.unflatten_dict({k: "PLACEHOLDER://" + ".".join(k) for k in traverse_util.flatten_dict(tree)})
    (item / "checkpoint").write_bytes(serialization.msgpack_serialize(placeholders))
    assert (item / "manifest.ocdbt").is_file() and not (item / "a.w").exists()
    leaves = _leaves(inspect_path(str(item), stats=True).to_json())
    assert leaves["a/w"]["shape"] == [3, 4] and leaves["a/w"]["stats"]["max"] == 11.0
    got = tt.load_parameters(item)
    np.testing.assert_array_equal(got["a"]["w"], tree["a"]["w"])
    assert int(got["n"]) == 3
    (item / "checkpoint").write_bytes(serialization.msgpack_serialize({"x": "PLACEHOLDER://missing"}))
    with pytest.raises(CheckpointError, match="`x`: cannot open array metadata"):
        inspect_path(str(item))


def test_an_inline_array_whose_bytes_do_not_fill_its_shape_is_corrupt(tmp_path):
    import msgpack

    # Flax's ext type 1: (shape, dtype name, bytes); here 4 bytes for a 1000x1000 float32 array.
    bad = msgpack.ExtType(1, msgpack.packb(((1000, 1000), "float32", b"\0" * 4), use_bin_type=True))
    (tmp_path / "checkpoint").write_bytes(msgpack.packb({"version": 3, "optimizer": {"target": {"w": bad}}}))
    with pytest.raises(CheckpointError, match=r"checkpoint: corrupt or truncated `checkpoint` msgpack \(at byte [\d,]+: "
                                              r"an array ext of 4 data bytes for shape \[1000, 1000\] float32\)"):
        inspect_path(str(tmp_path / "checkpoint"))


def test_docstring_examples():
    import doctest

    from treetools.checkpoint_io.formats import t5x

    result = doctest.testmod(t5x, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_the_checkpoint_msgpack_is_walked_not_parsed_whole(tmp_path):
    # Inline arrays stay in the file, read from their offsets: a 4 MiB inline array within a 1 MiB budget.
    import msgpack

    w = np.random.default_rng(0).standard_normal((1024, 1024), np.float32)
    inline = msgpack.ExtType(1, msgpack.packb((w.shape, "float32", w.tobytes()), use_bin_type=True))
    (tmp_path / "checkpoint").write_bytes(msgpack.packb({"version": 3, "optimizer": {"target": {"w": inline}}}))
    report = inspect_path(str(tmp_path / "checkpoint"), stats=True, memory_budget=2**20, block_bytes=2**19)
    (stats,) = [leaf["stats"] for leaf in report.to_json()["checkpoints"][0]["items"]["target"]["leaves"]]
    assert stats["max"] == pytest.approx(float(w.max())) and stats["min"] == pytest.approx(float(w.min()))
    np.testing.assert_array_equal(tt.load_parameters(tmp_path / "checkpoint")["w"], w)


def test_items_are_the_state_dict_top_level_keys_params_first(model_dir, capsys):
    # T5X's `target` is the model: shown first, its count column is "params"; `state` counts "elements".
    root, truth = model_dir
    data = inspect_path(str(root)).to_json()
    items = data["checkpoints"][0]["items"]
    assert list(items) == ["target", "state"]
    assert sorted(leaf["path"] for leaf in items["target"]["leaves"]) == sorted(_flat(truth[200]["target"]))
    assert main(["inspect", str(root), "--leaves"]) == 0
    out = capsys.readouterr().out
    assert out.index("target") < out.index("state")
    header = lambda word: [line for line in out.splitlines() if line.split()[:1] == ["path"] and word in line]
    assert len(header("params")) == 1 and len(header("elements")) == 1, out
    got = tt.load_parameters(root)
    assert sorted(tt.flatten(got)) == sorted(_flat(truth[200]["target"]))
