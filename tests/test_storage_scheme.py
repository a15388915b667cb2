"""A new storage scheme is one module, and ``Storage`` a contract a checker enforces (issue 45).

``tests/_toy_scheme.py`` defines ``toy://`` (files in a dict of bytes, folders as key prefixes) and registers it;
nothing else in treetools knows the scheme. Every command then reads (and ``convert`` writes) checkpoints in it
with the same results as the same files on a local disk, and the values are the writer's own. TensorStore has no
key-value store for ``toy://``, so the Orbax checkpoint copied there is refused with one line naming the scheme.
"""

from __future__ import annotations

import abc
import inspect
import json
import os

import numpy as np
import pytest
from flax import serialization
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import save_file

import treetools as tt
from tests._every_command import (
    check_diff_names_the_changed_leaf,
    check_inspect,
    check_load_parameters,
    check_show,
    check_stats,
    check_verify,
    run,
)
from tests._toy_scheme import TOY, FolderStorage, ToyStorage
from treetools.checkpoint_io.storage import Storage, Upload, base

TOY_ROOT = "toy://bucket/ckpts"


def _upload(local: str, url: str) -> None:
    """Every file under ``local`` (a file or a folder) copied into the toy scheme under ``url``, byte for byte."""
    if os.path.isfile(local):
        with open(local, "rb") as f:
            TOY.files[url] = f.read()
        return
    for folder, _, files in os.walk(local):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), local).replace(os.sep, "/")
            with open(os.path.join(folder, name), "rb") as f:
                TOY.files[f"{url}/{rel}"] = f.read()


@pytest.fixture
def checkpoints(tmp_path):
    """``{name: (local path, toy URL, truth)}``: one checkpoint of each format TensorStore does not read, written
    by its own library on the local disk and copied into ``toy://``, and a second safetensors file (``b``) whose
    ``kernel`` differs by 0.5."""
    rng = np.random.default_rng(45)
    flat = {"embed": rng.standard_normal((8, 4)).astype(np.float32), "kernel": rng.standard_normal((4, 3)),
            "bias": np.arange(3, dtype=np.int32)}
    disk = tmp_path / "disk"
    disk.mkdir()
    save_file(flat, str(disk / "a.safetensors"))
    save_file({**flat, "kernel": flat["kernel"] + 0.5}, str(disk / "b.safetensors"))
    np.savez(disk / "w.npz", **flat)
    (disk / "state.msgpack").write_bytes(serialization.to_bytes({"params": flat}))
    made = {
        "a.safetensors": flat, "b.safetensors": {**flat, "kernel": flat["kernel"] + 0.5}, "w.npz": flat,
        "state.msgpack": {f"params/{k}": v for k, v in flat.items()},
    }
    TOY.files.clear()
    _upload(str(disk), TOY_ROOT)
    yield {name: (str(disk / name), f"{TOY_ROOT}/{name}", truth) for name, truth in made.items()}
    TOY.files.clear()


def _same(argv_local: list, argv_toy: list, local: str, toy: str) -> str:
    """Run a command on the local checkpoint and on its toy copy: the same exit code and output, but for the path."""
    rc_l, out_l, err_l = run(*argv_local)
    rc_t, out_t, err_t = run(*argv_toy)
    assert rc_t == rc_l == 0, err_t + err_l
    assert (out_t, err_t) == (out_l.replace(local, toy), err_l.replace(local, toy)), argv_toy
    return out_t


@pytest.mark.parametrize("name", ["a.safetensors", "w.npz", "state.msgpack"])
def test_every_command_reads_a_toy_scheme_as_the_local_disk(checkpoints, name, tmp_path):
    local, toy, truth = checkpoints[name]
    # The writer's own arrays through every reading command (the truth, never treetools' reading of the disk) ...
    check_inspect(toy, truth)
    check_stats(toy, truth)
    check_show(toy, truth)
    check_verify(toy)
    params = {k.removeprefix("params/"): v for k, v in truth.items()}  # load_parameters: the params subtree
    check_load_parameters(toy, params)
    # ... and the very same reports as the local copy gives, text and JSON.
    leaf = sorted(truth)[0]
    for args in ([], ["--stats"], ["--show", leaf], ["--format", "json"], ["--stats", "--format", "json"]):
        _same(["inspect", local, *args], ["inspect", toy, *args], local, toy)
    _same(["verify", local], ["verify", toy], local, toy)
    # convert, reading the toy scheme and writing into it: the same bytes as converting on the local disk.
    out_local = str(tmp_path / "converted.safetensors")
    out_toy = f"toy://bucket/out/{name}.safetensors"
    for src, dst in ((local, out_local), (toy, out_toy)):
        rc, out, err = run("convert", src, dst, "--verify")
        assert rc == 0 and "verify: ok" in out, out + err
    with open(out_local, "rb") as f:
        assert TOY.files[out_toy] == f.read()
    assert not [k for k in TOY.files if ".partial" in k]  # nothing left at the temporary name
    written = safetensors_load(TOY.files[out_toy])  # safetensors' own reader: the params, under HF's names
    assert sorted(written) == sorted(params)
    for k, v in params.items():
        np.testing.assert_array_equal(written[k], v)
    check_load_parameters(out_toy, params)


def test_diff_values_across_a_toy_scheme(checkpoints):
    (la, ta, _), (lb, tb, _) = checkpoints["a.safetensors"], checkpoints["b.safetensors"]
    check_diff_names_the_changed_leaf(ta, tb, "kernel", 0.5)
    rc_l, out_l, _ = run("diff", la, lb, "--values", "--format", "json")
    rc_t, out_t, _ = run("diff", ta, tb, "--values", "--format", "json")
    assert rc_l == rc_t == 1
    assert json.loads(out_t)["values"] == json.loads(out_l)["values"]
    rc, out, err = run("diff", ta, la, "--values")  # the toy copy against the disk: bit-identical
    assert rc == 0 and "3 bit-identical" in out, out + err


def test_an_orbax_checkpoint_in_a_scheme_tensorstore_cannot_read_is_refused_in_one_line(tmp_path):
    # TensorStore reads Orbax's arrays itself, through a key-value store driver of the scheme; none is registered
    # for toy://, and nothing is copied behind the user's back: one line naming the folder and the scheme.
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=str(tmp_path / "run"), async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": params})
    mngr.close()
    TOY.files.clear()
    try:
        _upload(str(tmp_path / "run"), f"{TOY_ROOT}/run")
        rc, out, err = run("inspect", f"{TOY_ROOT}/run")
        assert rc == 1 and out == "", out + err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"treetools: error: {TOY_ROOT}/run/1/params"), err
        assert "TensorStore cannot read toy:// storage" in lines[0] and "register_kvstore" in lines[0]
        with pytest.raises(tt.CheckpointError, match="TensorStore cannot read toy:// storage"):
            tt.load_parameters(f"{TOY_ROOT}/run")
        # the same files on the local disk read (the refusal is the scheme's, not the checkpoint's)
        np.testing.assert_array_equal(tt.load_parameters(str(tmp_path / "run"))["w"], params["w"])
    finally:
        TOY.files.clear()


def test_a_scheme_with_a_tensorstore_store_reads_orbax_as_the_local_disk(tmp_path, monkeypatch):
    # folder:// registers a key-value store with the TensorStore adapter in its own module (register_kvstore):
    # Orbax's arrays then read there through TensorStore, every command as on the disk, confinement included.
    monkeypatch.setattr(FolderStorage, "top", str(tmp_path))
    rng = np.random.default_rng(7)
    params = {"w": rng.standard_normal((6, 4)).astype(np.float32), "b": np.arange(4, dtype=np.float32)}
    for name, tree in (("a", params), ("b", {**params, "w": params["w"] + 0.5})):
        mngr = tt.get_checkpoint_manager(1, checkpoint_dir=str(tmp_path / "vol" / name), async_save=False)
        tt.save_checkpoint(mngr, 1, {"params": tree})
        mngr.close()
    la, (ua, ub) = str(tmp_path / "vol" / "a"), ("folder://vol/a", "folder://vol/b")
    check_inspect(ua, params, item="params")
    check_stats(ua, params, item="params")
    check_show(ua, params, item="params")
    check_verify(ua)
    check_load_parameters(ua, params)
    for args in ([], ["--stats"], ["--item", "params", "--show", "w"], ["--format", "json"]):
        _same(["inspect", la, *args], ["inspect", ua, *args], la, ua)
    _same(["verify", la], ["verify", ua], la, ua)
    check_diff_names_the_changed_leaf(ua, ub, "w", 0.5, item="params")
    rc, out, err = run("convert", ua, "folder://vol/out/w.safetensors", "--verify")
    assert rc == 0 and "verify: ok" in out, out + err
    rc, out, err = run("convert", la, str(tmp_path / "w.safetensors"))
    assert rc == 0, out + err
    assert (tmp_path / "vol" / "out" / "w.safetensors").read_bytes() == (tmp_path / "w.safetensors").read_bytes()
    # its reads stay inside the checkpoint as the disk's do: an array folder linked out of it is refused
    outside = tmp_path / "elsewhere"
    os.rename(tmp_path / "vol" / "a" / "1" / "params", outside)
    os.symlink(outside, tmp_path / "vol" / "a" / "1" / "params")
    rc, out, err = run("inspect", ua, "--stats")
    assert rc == 1 and "outside the checkpoint" in err, out + err


# ----------------------------------------------------------------------------- the contract, checked


def test_storage_is_bytes_and_names_in_at_most_twenty_methods():
    public = sorted(n for n in dir(Storage) if not n.startswith("_") and callable(getattr(Storage, n)))
    # counted by hand: 8 abstract (confine stat scandir open read_range create write_atomically remove) and 12
    # written in terms of them (exists lexists isdir isfile getsize link_target listdir walk missing read_into
    # forget prefetch)
    assert len(public) <= 20, public
    assert not {"kvstore_spec", "tensorstore_context", "pin"} & set(public)  # the TensorStore adapter's
    assert isinstance(Storage, abc.ABCMeta) and isinstance(Upload, abc.ABCMeta)
    assert {"confine", "stat", "scandir", "open", "read_range", "create", "write_atomically",
            "remove"} == set(Storage.__abstractmethods__)
    assert {"write", "commit", "abort"} == set(Upload.__abstractmethods__)
    assert "NotImplementedError" not in inspect.getsource(base)


def test_a_backend_that_forgets_confine_cannot_be_made():
    class Unconfined(Storage):  # every abstract method but confine
        stat, scandir, open, read_range = ToyStorage.stat, ToyStorage.scandir, ToyStorage.open, ToyStorage.read_range
        create, write_atomically, remove = ToyStorage.create, ToyStorage.write_atomically, ToyStorage.remove

    with pytest.raises(TypeError, match="confine"):
        Unconfined()
    with pytest.raises(TypeError, match="abort"):
        type("Half", (Upload,), {"write": lambda self, d: None, "commit": lambda self: None})()


def test_the_adding_a_storage_scheme_example_runs(monkeypatch):
    # docs/formats.md "Adding a storage scheme": the example runs as written, in a fresh namespace.
    from pathlib import Path

    from treetools.checkpoint_io.storage import schemes

    monkeypatch.setattr(schemes, "_SCHEMES", dict(schemes._SCHEMES))  # mem:// registered for this test only
    monkeypatch.setattr(schemes, "_BACKENDS", dict(schemes._BACKENDS))
    text = (Path(__file__).parent.parent / "docs" / "formats.md").read_text()
    section = text[text.index("## Adding a storage scheme"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("\n```", start)]
    namespace: dict = {"__name__": "formats_doc_scheme"}
    exec(compile(code, "docs/formats.md (Adding a storage scheme)", "exec"), namespace)
    assert sorted(namespace["MEM"].files) == ["mem://bucket/run/model.safetensors"]
    assert not namespace["MemStorage"].__abstractmethods__
