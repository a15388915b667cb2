"""`treetools verify` on good checkpoints of each format and on each kind of damage."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from safetensors.numpy import save_file

import treetools as tt
from treetools.cli import main
from treetools.inspect.verify import verify_path


def _tree():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((64, 32)).astype(np.float32), "b": np.arange(10, dtype=np.int32)}


def _plain(tmp_path):
    """A non-OCDBT Orbax item: one folder per array, one file per chunk."""
    folder = tmp_path / "plain"
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as ckptr:
        ckptr.save(folder, args=ocp.args.PyTreeSave(_tree()))
    return folder


def _chunks(folder):
    return sorted(p for p in (folder / "a").iterdir() if not p.name.startswith("."))


def test_good_checkpoints_of_every_format_pass(tmp_path, capsys):
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "run", async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": _tree(), "data_iter": {"i": 1}})
    mngr.close()
    save_file(_tree(), str(tmp_path / "m.safetensors"))
    np.savez(tmp_path / "w.npz", **_tree())
    np.savez_compressed(tmp_path / "c.npz", **_tree())
    (tmp_path / "s.msgpack").write_bytes(serialization.to_bytes(_tree()))
    for path in (tmp_path / "run", _plain(tmp_path), tmp_path / "m.safetensors", tmp_path / "w.npz",
                 tmp_path / "c.npz", tmp_path / "s.msgpack"):
        report = verify_path(str(path))
        assert report.ok, (path, report.problems)
        assert report.bytes >= 64 * 32 * 4 + 10 * 4
        assert main(["verify", str(path)]) == 0
        out = capsys.readouterr().out
        assert out.startswith("ok: ") and out.count("\n") == 1


def test_missing_chunk(tmp_path, capsys):
    folder = _plain(tmp_path)
    chunks = _chunks(folder)
    assert chunks, "expected chunk files"
    chunks[0].unlink()
    report = verify_path(str(folder))
    assert not report.ok and any("default/a" in p for p in report.problems)
    assert main(["verify", str(folder)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("FAILED: ") and "problem: " in out


def test_truncated_chunk(tmp_path):
    folder = _plain(tmp_path)
    chunk = _chunks(folder)[0]
    os.truncate(chunk, chunk.stat().st_size // 2)
    report = verify_path(str(folder))
    assert any("default/a: stored data cannot be read" in p for p in report.problems), report.problems


def test_metadata_lists_a_leaf_that_is_not_stored(tmp_path):
    folder = _plain(tmp_path)
    shutil.rmtree(folder / "b")
    report = verify_path(str(folder))
    assert any("`b`" in p and "cannot open array metadata" in p for p in report.problems), report.problems
    assert report.leaves == 1  # `a` was still checked


def test_stored_data_the_metadata_does_not_list(tmp_path):
    folder = _plain(tmp_path)
    shutil.copytree(folder / "a", folder / "stray")
    report = verify_path(str(folder))
    assert any("does not list: stray" in p for p in report.problems), report.problems


def test_missing_commit_marker(tmp_path):
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "run", async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": _tree()})
    mngr.close()
    step = tmp_path / "run" / "1"
    (step / "commit_success.txt").unlink()
    meta = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    meta["commit_timestamp_nsecs"] = None
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match="no committed checkpoint step"):
        verify_path(str(tmp_path / "run"))  # the root has no committed step left
    assert main(["verify", str(step)]) == 1


def test_ocdbt_data_file_damage_is_found(tmp_path):
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "run", async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": _tree()})
    mngr.close()
    data = [p for p in (tmp_path / "run" / "1" / "params").rglob("d/*") if p.is_file()]
    for p in data:
        os.truncate(p, p.stat().st_size // 3)
    report = verify_path(str(tmp_path / "run"))
    assert not report.ok


def test_verify_lists_damage_of_any_format_and_goes_on_to_the_next_step(tmp_path, capsys):
    # A truncated msgpack step of a Flax legacy folder: a problem line and FAILED for that step, the others checked.
    d = tmp_path / "legacy"
    d.mkdir()
    for step in (1, 2):  # what flax's msgpack-mode save_checkpoint writes (to_bytes of the target)
        (d / f"checkpoint_{step}").write_bytes(serialization.to_bytes({"params": {"w": np.full(3, step, np.float32)}}))
    data = (d / "checkpoint_2").read_bytes()
    (d / "checkpoint_2").write_bytes(data[: len(data) // 2])
    assert main(["verify", str(d), "--step", "all"]) == 1
    out = capsys.readouterr().out
    assert "problem:" in out and "checkpoint_2" in out and "FAILED" in out and "ok:" in out and "(step 1)" in out
    shards = tmp_path / "st"
    shards.mkdir()
    save_file({"a": np.ones(4, np.float32)}, str(shards / "model.safetensors"))
    raw = (shards / "model.safetensors").read_bytes()
    (shards / "model.safetensors").write_bytes(raw[:-4])  # header promises 16 data bytes, 12 remain
    assert main(["verify", str(shards / "model.safetensors")]) == 1
    out = capsys.readouterr().out
    assert "problem:" in out and "FAILED" in out
