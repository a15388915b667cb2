"""Issue 49: the third hostile-input round, aimed at the turn-4 readers and writers (docs/untrusted.md).

Every hostile input is built here by the test itself; each case asserts one error line and a non-zero exit (or
a correct read), and, where a header declares more than it stores, memory or work within the budget (peaks
measured in a child process, as ``tests/test_untrusted.py`` does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tests.test_untrusted import _clean, _one_error, _run, grown_mib


def _flax_array(shape, dtype: str = "float32", data: bytes = b"") -> msgpack.ExtType:
    """An ndarray as flax.serialization packs it: ext 1 holding ``[shape, dtype name, bytes]``."""
    return msgpack.ExtType(1, msgpack.packb([list(shape), dtype, data]))


# ----------------------------------------------------------------------------- msgpack


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [2**32, 0, 2**32]])
def test_a_zero_size_msgpack_array_of_absurd_dimensions_is_one_line(tmp_path, capsys, shape):
    # No data bytes bound them (0 elements); numpy cannot build either shape (a dimension over 2^63, a product of
    # the non-zero dimensions over 2^63), so --stats, diff --values and convert ended in a ValueError traceback.
    with pytest.raises(ValueError):
        np.empty(tuple(shape), np.float32)  # why it cannot be read as a zero-size array
    f = tmp_path / "state.msgpack"
    f.write_bytes(msgpack.packb({"params": {"w": _flax_array(shape), "b": _flax_array([2], "float32", bytes(8))}}))
    out_file = tmp_path / "out.safetensors"
    for argv in (("inspect", f), ("inspect", f, "--stats"), ("diff", f, f, "--values"),
                 ("convert", f, out_file), ("inspect", f, "--show", "params/w")):
        err = _one_error(capsys, *argv, code=2 if argv[0] == "diff" else 1)
        assert str(list(shape)) in err and "Flax msgpack" in err, err
    code, out, err = _run(capsys, "verify", f)
    assert code == 1 and "Traceback" not in out + err and str(list(shape)) in out + err
    assert not out_file.exists()


def test_a_zero_size_msgpack_array_numpy_holds_is_read_as_one(tmp_path, capsys):
    f = tmp_path / "state.msgpack"
    f.write_bytes(msgpack.packb({"w": _flax_array([0, 2**40]), "b": _flax_array([2], "float32", bytes(8))}))
    code, out, err = _run(capsys, "inspect", f, "--stats", "--format", "json")
    assert code == 0, err
    leaves = {leaf["path"]: leaf for leaf in json.loads(out)["checkpoints"][0]["items"]["default"]["leaves"]}
    assert leaves["w"]["shape"] == [0, 2**40] and leaves["w"]["params"] == 0 and leaves["b"]["params"] == 2


# ----------------------------------------------------------------------------- jax pytree serialization


def _pytreedef_table(builder, kind: int, children=None) -> int:
    """One ``PyTreeDef`` table of jax's export schema (field 0 kind, field 1 children), written by hand."""
    if children is not None:
        builder.StartVector(4, len(children), 4)
        for child in reversed(children):
            builder.PrependUOffsetTRelative(child)
        vector = builder.EndVector()
    builder.StartObject(5)
    builder.PrependInt8Slot(0, kind, 0)
    if children is not None:
        builder.PrependUOffsetTRelativeSlot(1, vector, 0)
    return builder.EndObject()


def _jax_pytree(folder: Path, buf: bytes, ids: list) -> Path:
    import base64

    (folder / "array_store").mkdir(parents=True)
    (folder / "pytreedef.json").write_text(json.dumps({"__jax_pytreedef_repr": base64.b64encode(buf).decode(),
                                                       "__jax_leaf_ids": ids}))
    return folder


def test_a_pytreedef_of_shared_nodes_is_refused_in_one_line_within_the_budget(tmp_path):
    # 60 levels of a tuple holding the same node twice: 2^60 leaves spelled in about a kilobyte. The walk grew the
    # process past 2 GB within seconds; every node but the root takes 8 bytes in a tree, so it now stops at
    # 1 + bytes / 8 nodes.
    import flatbuffers

    builder = flatbuffers.Builder(1024)
    node = _pytreedef_table(builder, 0)  # a leaf
    for _ in range(60):
        node = _pytreedef_table(builder, 2, [node, node])
    builder.Finish(node)
    buf = bytes(builder.Output())
    folder = _jax_pytree(tmp_path / "dag", buf, ["Array(float32[2])"] * 4)
    assert (folder / "pytreedef.json").stat().st_size < 28_000
    code, mib, out = grown_mib("inspect", folder, "--memory-budget-mb", "64", timeout=120)
    assert code == 1 and "more nodes than its" in out and "Traceback" not in out, out
    assert mib < 64, mib


def test_a_pytreedef_of_800000_leaves_is_refused_before_it_holds_a_spec_per_leaf(tmp_path):
    # 800,000 leaf tables, each its own, and an empty array store: the reader built a TensorStore spec per leaf
    # (661 MB at a 64 MB budget) before the first array was found missing. Specs are now made a batch at a time.
    import flatbuffers

    n = 800_000
    builder = flatbuffers.Builder(2**24)
    leaves = [_pytreedef_table(builder, 0) for _ in range(n)]
    builder.Finish(_pytreedef_table(builder, 2, leaves))
    folder = _jax_pytree(tmp_path / "wide", bytes(builder.Output()), ["Array(f32[1])"] * n)
    code, mib, out = grown_mib("inspect", folder, "--memory-budget-mb", "64", timeout=300)
    assert code == 1 and "`0`: cannot open array metadata" in out and "Traceback" not in out, out
    assert mib < 64, mib


def test_missing_chunks_of_a_jax_pytree_array_are_work_out_of_proportion(tmp_path, capsys):
    # 2^23 one-byte chunks, none stored (jax reads a missing chunk as the fill value): a database of a few hundred
    # bytes, and --stats ran for minutes (TensorStore looks each chunk up: about 45 us each, whatever its leaf).
    import jax
    import jax.numpy as jnp
    import tensorstore as ts
    from jax.experimental.array_serialization import pytree_serialization

    folder = tmp_path / "ckpt"
    pytree_serialization.save({"w": jnp.zeros(8, jnp.uint8)}, str(folder), overwrite=True)
    meta = json.loads((folder / "pytreedef.json").read_text())
    meta["__jax_leaf_ids"] = [f"Array(uint8[{2**23}])"]
    (folder / "pytreedef.json").write_text(json.dumps(meta))
    import shutil

    shutil.rmtree(folder / "array_store")
    ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{folder}/array_store"}, "path": "0"},
            create=True, dtype=ts.uint8, shape=[2**23], chunk_layout=ts.ChunkLayout(write_chunk_shape=[1])).result()
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < 2048
    for argv in (("inspect", folder, "--stats"), ("inspect", folder, "--show", "w[0:4]"),
                 ("convert", folder, tmp_path / "o.safetensors")):
        err = _one_error(capsys, *argv)
        assert "8,388,608 chunks to look up" in err and "refusing to start" in err, err
    code, out, _ = _run(capsys, "verify", folder)
    assert code == 1 and "8,388,608 chunks to look up" in out
    assert _run(capsys, "inspect", folder)[0] == 0  # metadata reads no chunk
    del jax


# ----------------------------------------------------------------------------- zarr trees

from tests.test_untrusted import watched_fifos  # noqa: E402,F401  (a fixture: FIFOs let go if ever opened)


def test_a_zarr_folder_declaring_2_34_missing_chunks_is_refused_before_reading(tmp_path, capsys):
    # A header of about 130 bytes: 2^34 one-byte chunks, none stored (a missing chunk reads as the fill value):
    # TensorStore looks up each chunk file (about 90 us each), so --stats ran without end. Work follows what is
    # stored: the same bound as OCDBT lookups.
    array = tmp_path / "tree" / "w"
    array.mkdir(parents=True)
    (array / ".zarray").write_text(json.dumps({"zarr_format": 2, "shape": [2**34], "chunks": [1], "dtype": "|u1",
                                               "compressor": None, "fill_value": 0, "filters": None, "order": "C"}))
    assert (array / ".zarray").stat().st_size < 150
    for argv in (("inspect", array.parent, "--stats"), ("inspect", array.parent, "--show", "w[0:4]"),
                 ("convert", array.parent, tmp_path / "o.safetensors")):
        err = _one_error(capsys, *argv)
        assert "17,179,869,184 chunks to look up" in err and "refusing to start" in err, err
    code, out, _ = _run(capsys, "verify", array.parent)
    assert code == 1 and "17,179,869,184 chunks to look up" in out
    assert _run(capsys, "inspect", array.parent)[0] == 0  # metadata reads no chunk
    # In proportion: 4,096 chunks, none stored, read as the fill value.
    (array / ".zarray").write_text((array / ".zarray").read_text().replace(str(2**34), str(2**12)))
    code, out, err = _run(capsys, "inspect", array.parent, "--stats", "--format", "json")
    (leaf,) = json.loads(out)["checkpoints"][0]["items"]["default"]["leaves"]
    assert code == 0 and leaf["stats"]["zeros"] == 2**12, err


@pytest.mark.parametrize("damage", ["fifo", "truncated"])
@pytest.mark.parametrize("header", ["zarr.json", "attributes.json"])
def test_a_zarr_tree_header_that_cannot_be_read_is_one_line_not_a_leaf_left_out(tmp_path, capsys, watched_fifos,
                                                                                header, damage):
    # A tree of three arrays (zarr, zarr3, N5); the zarr3 or N5 one's header a FIFO or cut short: it was taken
    # for "no array here" and the leaf left out without a word. Now: one line naming the file, exit 1.
    import tensorstore as ts

    make, opened = watched_fifos
    tree = tmp_path / "tree"
    for name, driver in (("a", "zarr"), ("b", "zarr3"), ("c", "n5")):
        store = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": str(tree / name)}}, create=True,
                        dtype=ts.float32, shape=[4]).result()
        store[...] = np.arange(4, dtype=np.float32)
    path = tree / ("b" if header == "zarr.json" else "c") / header
    if damage == "fifo":
        make(path)
    else:
        path.write_bytes(path.read_bytes()[:12])
    for argv in (("inspect", tree), ("inspect", tree, "--stats"), ("diff", tree, tree)):
        err = _one_error(capsys, *argv, code=2 if argv[0] == "diff" else 1)
        assert str(path) in err and ("a FIFO" if damage == "fifo" else "truncated or damaged") in err, err
    code, out, err = _run(capsys, "verify", tree)
    assert code == 1 and str(path) in out + err
    assert not opened, opened


# ----------------------------------------------------------------------------- train --health


def test_train_never_writes_health_dumps_through_a_planted_link(tmp_path, capsys):
    import jax.numpy as jnp

    import treetools as tt

    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (run / "health").symlink_to(outside)  # planted before the run: refused before training starts
    err = _one_error(capsys, "train", "--workdir", run, "--steps", "1", "--health")
    assert "health: a symbolic link leading out of" in err and not os.listdir(outside), err
    # Planted while the run goes on: found at the next dump, which is refused, never written through.
    recorder = tt.HealthRecorder(length=4)
    row = {"loss": jnp.float32(0.5), "grad_norm/a": jnp.float32(1.0)}
    state = recorder.record(recorder.init(row), 1, row, False)
    dumper = tt.HealthDumper(run / "health", tt.SpikeDetector(keys=("loss",)), every=1, within=run)
    with pytest.raises(PermissionError, match="a symbolic link leading out of"):
        dumper(1, state, None, {"flagged": jnp.bool_(False)})
    assert not os.listdir(outside)
    (run / "health").unlink()
    (events,) = dumper(2, state, None, {"flagged": jnp.bool_(False)})  # a real folder: written
    assert events["event"] == "dump" and json.loads(Path(events["path"]).read_text())["step"] == 2


# ----------------------------------------------------------------------------- Keras


def test_a_keras_zip_declaring_a_member_larger_than_itself_is_one_line(tmp_path, capsys):
    # model.weights.h5 of 2^28 one-byte chunks, none written (a few KB), in a .keras zip whose central directory
    # says the member holds 4 GB: the HDF5 chunk bound (one chunk per 16 bytes of the file) took the declared
    # size, and verify walked 2^28 chunks (killed after 60 s). The member must lie within the zip's bytes.
    import struct
    import zipfile

    import h5py

    h5 = tmp_path / "w.h5"
    with h5py.File(h5, "w") as f:
        f.create_dataset("layers/dense/vars/0", shape=(2**28,), chunks=(1,), dtype="u1")
    keras = tmp_path / "model.keras"
    with zipfile.ZipFile(keras, "w", zipfile.ZIP_STORED) as z:
        z.writestr("metadata.json", json.dumps({"keras_version": "3.0.0"}))
        z.writestr("config.json", json.dumps({"class_name": "Sequential"}))
        z.write(h5, "model.weights.h5")
    raw = bytearray(keras.read_bytes())
    entry = raw.rindex(b"model.weights.h5") - 46  # its central directory entry: 46 bytes, then the name
    assert raw[entry:entry + 4] == b"PK\x01\x02"
    struct.pack_into("<II", raw, entry + 20, 0xFFFFFFF0, 0xFFFFFFF0)  # compressed and uncompressed size: ~4 GB
    keras.write_bytes(bytes(raw))
    assert keras.stat().st_size < 16_000 and zipfile.ZipFile(keras).getinfo("model.weights.h5").file_size > 2**31
    for argv in (("inspect", keras), ("inspect", keras, "--stats"), ("convert", keras, tmp_path / "o.safetensors")):
        err = _one_error(capsys, *argv)
        assert "corrupt zip (model.weights.h5 declares 4,294,967,280 bytes" in err, err
    code, out, err = _run(capsys, "verify", keras)
    assert code == 1 and "corrupt zip" in out + err and "Traceback" not in out + err


def test_a_flax_msgpack_of_250000_tiny_leaves_is_held_to_the_budget(tmp_path, capsys):
    # 250,000 leaves (small integers) in 1.7 MB: the walk held 64 bytes an entry to the budget, and each leaf then
    # cost about 650 more (its Leaf, Row and JSON entry): 188 MB against a 16 MB budget. Each leaf is now held at
    # 768 bytes as it is decoded.
    f = tmp_path / "state.msgpack"
    n = 250_000
    f.write_bytes(msgpack.packb({f"{i:x}": i % 100 for i in range(n)}))
    assert f.stat().st_size < 2**21
    for argv in (("inspect", f, "--format", "json"), ("verify", f), ("diff", f, f, "--values")):
        code, mib, out = grown_mib(*argv, "--memory-budget-mb", "16", timeout=300)
        assert code in (1, 2) and "over the memory budget of 16.00 MiB" in out and "Traceback" not in out, out
        assert mib < 16, (argv, mib)
    # At a budget that holds them, every leaf is read.
    code, out, err = _run(capsys, "inspect", f, "--format", "json", "--memory-budget-mb", "512")
    values = json.loads(out)["checkpoints"][0]["items"]["default"]["values"]
    assert code == 0 and len(values) == n and values["3e7"] == 999 % 100, err


# ----------------------------------------------------------------------------- plan


def test_plan_escapes_a_newline_in_a_leaf_name(tmp_path, capsys):
    f = tmp_path / "w.npz"
    np.savez(f, **{"w\ntreetools: note: all clear": np.ones((4, 4), np.float32)})
    code, out, err = _run(capsys, "plan", f)
    assert code == 0 and "w\\ntreetools: note: all clear" in out, out
    assert not any(line.startswith("treetools: note: all clear") for line in (out + err).splitlines()), out
    _clean(out, err)


def test_plan_of_a_recorded_mesh_of_65536_x_65536_devices_is_one_line(tmp_path, capsys):
    import base64

    import treetools as tt
    from tests.test_untrusted import _orbax

    run = _orbax(tmp_path / "run")
    key = base64.b64encode(b"w").decode()
    (run / "1" / "params" / "_sharding").write_text(json.dumps({key: json.dumps(
        {"sharding_type": "NamedSharding", "shape": [65536, 65536], "axis_names": ["a", "b"],
         "partition_spec": [["a"]]})}))
    err = _one_error(capsys, "plan", run)
    assert "records a mesh of 65536 x 65536 devices (4,294,967,296)" in err and "--mesh" in err, err
    code, out, err = _run(capsys, "plan", run, "--mesh", "a=2,b=2")  # a mesh of the user's own: planned
    assert code == 0 and "mesh a=2 x b=2 (4 devices)" in out, err
    code, out, err = _run(capsys, "plan", run, "--mesh", "a=65536,b=65536")  # a usage error: one line, exit 2
    assert code == 2 and err.count("\n") == 1 and "4,294,967,296 devices, more than 16,777,216" in err, err
    with pytest.raises(ValueError, match="more than 16,777,216"):
        tt.memory_plan({"w": np.ones(4, np.float32)}, mesh={"a": 65536, "b": 65536})


# ----------------------------------------------------------------------------- plot of health dumps


def _dump(**over) -> dict:
    dump = {"schema": 1, "kind": "treetools.health_dump", "step": 3, "reason": "every",
            "names": ["loss", "grad_norm/a", "grad_norm/b"], "flagged": [],
            "records": [{"step": s, "flagged": 0, "loss": 1.0, "grad_norm/a": 0.5 * s, "grad_norm/b": 1.0}
                        for s in (1, 2, 3)]}
    dump.update(over)
    return dump


_RECORD = {"step": 1, "flagged": 0, "grad_norm/a": 0.5}
HOSTILE_DUMPS = {
    "deep JSON": '{"kind": "treetools.health_dump", "records": [], "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "a record without a step": _dump(records=[{"flagged": 0, "grad_norm/a": 1.0}]),
    "a step that is a string": _dump(records=[{**_RECORD, "step": "one"}]),
    "a record that is a list": _dump(records=[[1, 2]]),
    "a value that is a string": _dump(records=[{**_RECORD, "grad_norm/a": "big"}]),
    "a value beyond any float": _dump(records=[{**_RECORD, "grad_norm/a": 10**400}]),
    "names that are numbers": _dump(names=[1, 2]),
    "a flagged entry without a step": _dump(flagged=[{"reasons": ["spike"]}]),
    "attributed modules that are a number": _dump(flagged=[{"step": 1, "attributed": 7}]),
    "nonfinite kinds that are a list": _dump(records=[{**_RECORD, "nonfinite": ["nan"]}]),
}


@pytest.mark.parametrize("case", list(HOSTILE_DUMPS))
def test_plot_of_a_hostile_health_dump_is_one_line(tmp_path, capsys, case):
    pytest.importorskip("matplotlib")
    dump = HOSTILE_DUMPS[case]
    path = tmp_path / "health_00000003.json"
    path.write_text(dump if isinstance(dump, str) else json.dumps(dump))
    err = _one_error(capsys, "plot", path)
    assert str(path) in err and ("health dump" in err or "not a metrics file" in err), err
    assert not (tmp_path / "health_00000003.png").exists()


def test_plot_of_a_health_dump_fifo_never_opens_it(tmp_path, capsys, watched_fifos):
    make, opened = watched_fifos
    path = make(tmp_path / "health_00000003.json")
    code, out, err = _run(capsys, "plot", path)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not opened, opened


def test_plot_of_a_sound_health_dump_still_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "health_00000003.json"
    path.write_text(json.dumps(_dump(flagged=[{"step": 2, "reasons": ["spike " * 100], "attributed": ["a"]}])))
    code, out, err = _run(capsys, "plot", path)
    assert code == 0 and out.strip() == str(tmp_path / "health_00000003.png"), err


# ----------------------------------------------------------------------------- convert's DST name


def test_convert_to_a_230_character_name_writes_it_and_a_longer_than_any_name_is_one_line(tmp_path, capsys):
    # The hidden temporary beside DST adds about 35 characters (and Orbax 21 more): a 230-character DST ended in
    # an OSError traceback (ENAMETOOLONG). The temporary's name is now cut to fit; a DST no file system can name
    # is a usage error before anything is read.
    import treetools as tt

    src = tmp_path / "w.npz"
    np.savez(src, w=np.arange(6, dtype=np.float32))
    for dst, extra in ((tmp_path / ("a" * 218 + ".safetensors"), ()), (tmp_path / ("f" * 230), ()),
                       (tmp_path / ("o" * 230), ("--to", "orbax"))):
        assert len(dst.name) == 230
        code, out, err = _run(capsys, "convert", src, dst, *extra)
        assert code == 0 and "Traceback" not in err, err
        np.testing.assert_array_equal(tt.flatten(tt.load_parameters(dst))["w"], np.arange(6, dtype=np.float32))
    assert sorted(len(p.name) for p in tmp_path.iterdir()) == [5, 230, 230, 230]  # no temporary left behind
    long = tmp_path / ("b" * 250 + ".safetensors")
    code, out, err = _run(capsys, "convert", src, long)
    assert code == 2 and err.count("\n") == 1 and "262 bytes long" in err and "at most 255" in err, err
    assert long.name not in os.listdir(tmp_path) and "Traceback" not in err


# ----------------------------------------------------------------------------- OCDBT


def test_a_symlink_loop_in_an_ocdbt_item_is_refused_naming_the_checkpoints_path(tmp_path, capsys):
    # The database's folder is read through its pinned descriptor: the refusal named /proc/self/fd/5/d/up.
    from tests.test_untrusted import _orbax

    run = _orbax(tmp_path / "run")
    (run / "1" / "params" / "d" / "up").symlink_to("..")
    where = f"{run}/1/params/d/up: a symlink back to a folder above it (a loop)"
    for argv in (("inspect", run), ("inspect", run, "--stats"), ("diff", run, run)):
        err = _one_error(capsys, *argv, code=2 if argv[0] == "diff" else 1)
        assert where in err and "/proc/self/fd" not in err, err
    code, out, err = _run(capsys, "verify", run)
    assert code == 1 and where in out and "/proc/self/fd" not in out + err, out + err
