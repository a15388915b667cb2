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
from treetools.checkpoint_tools.verify import verify_path


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


def test_what_else_was_written_into_a_committed_step_is_a_problem_naming_it(tmp_path, capsys):
    # Issue 24.11: a training run written inside a committed step (`--workdir runs/demo/checkpoints/200`) was "ok".
    root = tmp_path / "checkpoints"
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(200, args=ocp.args.Composite(params=ocp.args.StandardSave(_tree()),
                                               data_iter=ocp.args.JsonSave({"index": 7})))
        mngr.wait_until_finished()
    assert main(["verify", str(root)]) == 0
    capsys.readouterr()
    step = root / "200"
    (step / "checkpoints" / "100").mkdir(parents=True)
    (step / "metrics.jsonl").write_text('{"step": 1}\n')
    (step / "params" / "notes.txt").write_text("x")
    for path in (root, step):
        assert main(["verify", str(path)]) == 1
        out = capsys.readouterr().out
        problems = [line for line in out.splitlines() if line.startswith("problem: ")]
        shown = f"{root}/200"
        assert problems == [
            f"problem: {shown}/params: holds `notes.txt`, which is no item of this save and no file Orbax writes; "
            "something else wrote into the committed save (a run's --workdir inside it?): move it out.",
            f"problem: {shown}: holds `checkpoints`, `metrics.jsonl`, which are no item of this save and no file "
            "Orbax writes; something else wrote into the committed save (a run's --workdir inside it?): move them "
            "out."], out
    assert not verify_path(str(step / "params")).ok
    # Gone again: ok (Orbax's own files, ocdbt.process_N folders among them, are never strangers).
    shutil.rmtree(step / "checkpoints")
    (step / "metrics.jsonl").unlink()
    (step / "params" / "notes.txt").unlink()
    assert verify_path(str(root)).ok


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


# ---------------------------------------------------------------------------- issue 24, round 2


def _root(path, steps=(1, 2)):
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=path, async_save=False)
    for step in steps:
        tt.save_checkpoint(mngr, step, {"params": _tree()})
    mngr.close()
    return path


def test_verify_takes_several_paths(tmp_path, capsys):
    # Issue 24, point 15: `treetools verify runs/a/checkpoints runs/b/checkpoints` was refused.
    a, b = _root(tmp_path / "a" / "checkpoints"), _root(tmp_path / "b" / "checkpoints", steps=(5,))
    tree_bytes = sum(x.nbytes for x in _tree().values())
    assert main(["verify", str(a), str(b), "--step", "all"]) == 0
    out = capsys.readouterr().out
    sections = out.strip().split("\n\n")
    assert len(sections) == 3  # one per PATH, then the summary
    assert [line.split(":")[0] for line in sections[0].splitlines()] == ["ok", "ok"] and str(a) in sections[0]
    assert sections[1].startswith(f"ok: {b} (step 5): ") and f"{tree_bytes:,} bytes" in sections[1]
    assert sections[2] == "2 paths: 2 ok, 0 FAILED"
    # One damaged PATH among good ones: exit 1, its problems in its own section, the others still checked.
    folder = _plain(tmp_path)
    _chunks(folder)[0].unlink()
    assert main(["verify", str(a), str(folder), str(b)]) == 1
    sections = capsys.readouterr().out.strip().split("\n\n")
    assert sections[0].startswith(f"ok: {a} (step 2)")
    assert sections[1].startswith("problem: ") and sections[1].splitlines()[-1].startswith(f"FAILED: {folder}")
    assert sections[2].startswith(f"ok: {b} (step 5)")
    assert sections[3] == f"3 paths: 2 ok, 1 FAILED ({folder})"
    # A PATH that is not there: one error line naming it, the others checked, exit 1.
    assert main(["verify", str(a), str(tmp_path / "nothing"), str(b)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"treetools: error: {tmp_path / 'nothing'}: no such file or folder."]
    assert captured.out.count("ok: ") == 2 and "1 not verified" in captured.out
    # JSON: one object, one entry per PATH, each with a list of steps.
    assert main(["verify", str(a), str(folder), "--step", "all", "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == 1 and data["ok"] is False
    assert [(p["path"], p["ok"], [c["step"] for c in p["checkpoints"]]) for p in data["paths"]] == [
        (str(a), True, [1, 2]), (str(folder), False, [None])]
    assert data["paths"][0]["checkpoints"][0]["bytes"] == tree_bytes


def test_verify_step_all_names_unfinished_saves(tmp_path, capsys):
    # Issue 24, point 26: `verify --step all` said ok without a word on the unfinished saves `inspect` lists.
    root = _root(tmp_path / "run", steps=(1, 2, 3))
    os.rename(root / "3", root / "3.orbax-checkpoint-tmp-1700000000")  # a save that died before its rename
    shutil.copytree(root / "2", root / "4")  # a step folder without its commit marker
    (root / "4" / "commit_success.txt").unlink()
    meta = json.loads((root / "4" / "_CHECKPOINT_METADATA").read_text())
    meta["commit_timestamp_nsecs"] = None
    (root / "4" / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    inspect_rc = main(["inspect", str(root), "--format", "json"])
    listed = json.loads(capsys.readouterr().out)["incomplete"]
    assert inspect_rc == 0 and sorted(listed) == ["3.orbax-checkpoint-tmp-1700000000", "4"]
    for argv in ([], ["--step", "all"]):
        assert main(["verify", str(root), *argv]) == 0  # not damage: every committed step is whole
        lines = capsys.readouterr().out.strip().splitlines()
        assert [line.split(" (step ")[1].split(")")[0] for line in lines if line.startswith("ok: ")] == (
            ["1", "2"] if argv else ["2"])
        assert lines[-1] == ("incomplete: 2 unfinished saves, not read (not damage): "
                             f"{', '.join(listed)}"), lines
    assert main(["verify", str(root), "--step", "all", "--format", "json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["paths"]
    assert entry["incomplete"] == listed and entry["ok"] is True and entry["steps"] == [1, 2]


def test_verify_an_npz_holding_a_float0_leaf(tmp_path, capsys):
    # jax's float0 (the gradient of an integer leaf) has no bytes: verify raised ZeroDivisionError.
    import jax

    w = np.arange(5, dtype=np.float32)
    np.savez(tmp_path / "grads.npz", grads=np.zeros((3,), dtype=jax.dtypes.float0), w=w)
    report = verify_path(str(tmp_path / "grads.npz"))
    assert report.ok and report.leaves == 2 and report.bytes == w.nbytes
    assert main(["verify", str(tmp_path / "grads.npz")]) == 0
    assert capsys.readouterr().out == f"ok: {tmp_path / 'grads.npz'}: 1 item(s), 2 leaves, {w.nbytes:,} bytes read and decoded.\n"


def test_verify_prints_what_the_source_leaves_out_as_inspect_does(tmp_path, capsys):
    # A model folder with two weights files reads one; a root with two step series reads one. verify said nothing
    # of what it did not check; now it prints the same notes as inspect, on stderr (stdout and exit unchanged).
    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    save_file({"w": np.ones(3, np.float32)}, str(hf / "model.safetensors"))
    (hf / "flax_model.msgpack").write_bytes(serialization.to_bytes({"w": np.ones(3, np.float32)}))
    root = tmp_path / "run"
    root.mkdir()
    from flax.training import checkpoints  # flax legacy, msgpack mode: a series per prefix

    for step in (1, 2):
        checkpoints.save_checkpoint(str(root), {"w": np.full(2, step, np.float32)}, step, prefix="checkpoint_",
                                    keep=5)
        checkpoints.save_checkpoint(str(root), {"w": np.full(2, -step, np.float32)}, step, prefix="best_", keep=5)
    for path, names in ((hf, "flax_model.msgpack"), (root, "best_")):
        assert main(["inspect", str(path)]) == 0
        inspect_notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("treetools: note:")]
        assert inspect_notes and any(names in line for line in inspect_notes), inspect_notes
        assert main(["verify", str(path)]) == 0
        out, err = capsys.readouterr()
        assert [line for line in err.splitlines() if line.startswith("treetools: note:")] == inspect_notes
        assert "treetools: note:" not in out


def test_verify_says_a_step_a_manager_is_pruning_is_being_deleted(tmp_path, capsys, monkeypatch):
    # Issue 39, point 20: verify while a manager prunes called the step being deleted "1 unfinished save".
    from orbax.checkpoint._src.path import deleter

    root = tmp_path / "run"
    # Orbax's parallel deleter (num_deletion_threads=2) unlinks every file of the pruned step, then removes its
    # folders: verify runs between the two, on the state Orbax's own deleter leaves.
    mngr = tt.get_checkpoint_manager(1, max_to_keep=1, checkpoint_dir=root, async_save=False, num_deletion_threads=2)
    tt.save_checkpoint(mngr, 1, {"params": _tree()})
    seen = []
    unlink_all = deleter._ParallelDirectoryDeleter._run_scheduler

    def unlink_then_verify(self):
        unlink_all(self)
        assert sorted(os.listdir(root / "1")) == ["params"]  # the markers are gone, a folder is left
        seen.append((main(["verify", str(root)]), capsys.readouterr().out))
        seen.append((main(["verify", str(root), "--format", "json"]), capsys.readouterr().out))

    monkeypatch.setattr(deleter._ParallelDirectoryDeleter, "_run_scheduler", unlink_then_verify)
    tt.save_checkpoint(mngr, 2, {"params": _tree()})
    mngr.close()
    assert not (root / "1").exists() and tt.list_steps(root) == [2]
    (code, text), (json_code, out) = seen
    assert code == json_code == 0  # not damage: the committed step is whole
    lines = text.strip().splitlines()
    assert lines[0].startswith(f"ok: {root} (step 2): ")
    assert lines[-1] == ("incomplete: 1 step being deleted (its commit markers are gone: a manager pruning it), "
                         "not read (not damage): 1")
    (entry,) = json.loads(out)["paths"]
    assert entry["incomplete"] == entry["deleting"] == ["1"] and entry["steps"] == [2] and entry["ok"] is True


def test_a_repository_root_is_no_checkpoint_and_names_those_below_it(tmp_path, capsys, monkeypatch):
    # Issue 47 (18): after the README's commands the repository root read as an Orbax step (its `orbax_ckpt/`, a
    # StandardCheckpointer save, taken for an item): `inspect .` listed .git and .venv as unread items and
    # `verify .` failed. A subfolder that is a save of its own makes no step of the folder holding it: the root is
    # no checkpoint, and the error names the checkpoints below it (three levels down, hidden folders left out).
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / "treetools").mkdir()
    (repo / "treetools" / "__init__.py").write_text("")
    (repo / "README.md").write_text("# treetools\n")
    _root(repo / "runs" / "demo" / "checkpoints")
    (repo / "runs" / "demo" / "metrics.jsonl").write_text("")
    (tmp_path / "src").mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "src" / "model.safetensors"))  # not beside the repo
    assert main(["convert", str(tmp_path / "src" / "model.safetensors"), str(repo / "orbax_ckpt"), "--to", "orbax"]) == 0
    capsys.readouterr()
    monkeypatch.chdir(repo)
    want = ("treetools: error: .: not a checkpoint but a folder holding checkpoints; did you mean orbax_ckpt (orbax) "
            "or runs/demo/checkpoints (orbax)?\n")
    for command in ("inspect", "verify"):
        assert main([command, "."]) == 1, command
        captured = capsys.readouterr()
        assert captured.err == want and "problem" not in captured.out and "FAILED" not in captured.out, captured
    # The saves themselves still read, the one below through its root.
    assert main(["verify", "orbax_ckpt", "runs/demo/checkpoints"]) == 0
    assert capsys.readouterr().out.strip().endswith("2 paths: 2 ok, 0 FAILED")
