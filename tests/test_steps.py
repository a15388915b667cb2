"""The one step rule (treetools.checkpoint_io.steps): names, commit evidence, step specs, and the manager agreeing with it."""

from __future__ import annotations

import json
import os
import sys
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

import treetools as tt
from treetools.checkpoint_io import steps


def test_constants_match_orbax():
    from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as pytree_handler
    from orbax.checkpoint._src.metadata import checkpoint as step_metadata
    from orbax.checkpoint._src.path import atomicity_types

    assert steps.TMP_DIR_SUFFIX == atomicity_types.TMP_DIR_SUFFIX
    assert steps.COMMIT_SUCCESS_FILE == atomicity_types.COMMIT_SUCCESS_FILE
    assert steps.STEP_METADATA_FILE == step_metadata._STEP_METADATA_FILENAME
    assert steps.PYTREE_METADATA_FILE == pytree_handler.PYTREE_METADATA_FILE


def _save(root, *numbers):
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root, async_save=False)
    for n in numbers:
        tt.save_checkpoint(mngr, n, {"params": {"w": jnp.full(2, float(n))}})
    return mngr


def test_manager_inspect_load_and_restore_agree_on_latest(tmp_path, capsys):
    mngr = _save(tmp_path, 1, 2)
    # A copy still in progress: a step folder with an item but no commit evidence at all.
    partial = tmp_path / "3"
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "d").mkdir()
    listing = steps.scan_steps(tmp_path)
    assert listing.steps == [1, 2] and listing.incomplete == ["3"]
    fresh = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path, read_only=True)
    assert fresh.latest_step() == 2 == tt.latest_step(tmp_path)
    assert fresh.all_steps() == [1, 2]
    np.testing.assert_array_equal(tt.load_parameters(tmp_path)["w"], [2.0, 2.0])
    out = tt.restore_checkpoint(fresh, "latest", {"params": {"w": jnp.zeros(2)}})
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), [2.0, 2.0])
    from treetools.cli import main

    assert main(["inspect", str(tmp_path), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == [1, 2] and report["incomplete"] == ["3"] and report["checkpoints"][0]["step"] == 2
    fresh.close()
    mngr.close()


def test_two_committed_folders_for_one_step_is_an_error_naming_both(tmp_path):
    mngr = _save(tmp_path / "run", 2)
    mngr.close()
    import shutil

    shutil.copytree(tmp_path / "run" / "2", tmp_path / "run" / "000002")
    with pytest.raises(tt.CheckpointError, match=r"step 2 has two committed folders \(000002 and 2\)"):
        tt.load_parameters(tmp_path / "run")


def test_junk_entries_are_skipped(tmp_path):
    mngr = _save(tmp_path, 1)
    mngr.close()
    os.symlink("7", tmp_path / "7")  # a symlink loop
    assert steps.scan_steps(tmp_path).steps == [1]
    np.testing.assert_array_equal(tt.load_parameters(tmp_path)["w"], [1.0, 1.0])


@pytest.mark.parametrize("spec, want", [(None, None), (-1, None), ("latest", None), (5, 5), ("12", 12),
                                        (np.int64(3), 3),
                                        # flax's float steps (`save_checkpoint(..., step=0.625)`: `best_acc_0.625`)
                                        (1.5, 1.5), ("0.625", 0.625), ("1e-05", 1e-05), (2.0, 2)])
def test_parse_step(spec, want):
    got = steps.parse_step(spec)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("bad", [True, "ten", -2, [1], -0.5, float("nan"), float("inf"), "1.5.2", "-0.5"])
def test_parse_step_refuses(bad):
    with pytest.raises(TypeError, match="`step` must be"):
        steps.parse_step(bad)


def test_fifo_step_metadata_is_never_committed_and_never_hangs(tmp_path):
    mngr = _save(tmp_path, 1)
    mngr.close()
    (tmp_path / "2").mkdir()
    os.mkfifo(tmp_path / "2" / steps.STEP_METADATA_FILE)
    assert steps.scan_steps(tmp_path).steps == [1]  # returns: the FIFO is not opened


def test_step_rule_imports_neither_jax_nor_orbax(tmp_path):
    code = ("import sys, treetools.checkpoint_io.steps as s\n"
            f"s.scan_steps({str(tmp_path)!r})\n"
            "assert 'jax' not in sys.modules and 'orbax' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_step_that_lost_its_markers_is_being_deleted_not_saved(tmp_path):
    # Issue 39, point 20: Orbax's deleter removes a pruned step's files (its markers among them) before its folder;
    # a save in progress keeps its _CHECKPOINT_METADATA (no commit time yet) from the start, or a tmp name.
    _save(tmp_path, 1, 2, 3, 4).close()
    os.rename(tmp_path / "4", tmp_path / "4.orbax-checkpoint-tmp-1700000000")  # a local save before its rename
    meta = json.loads((tmp_path / "3" / steps.STEP_METADATA_FILE).read_text())
    meta["commit_timestamp_nsecs"] = None  # a bucket save in place, before its commit
    (tmp_path / "3" / steps.STEP_METADATA_FILE).write_text(json.dumps(meta))
    (tmp_path / "3" / steps.COMMIT_SUCCESS_FILE).unlink()
    for name in (steps.COMMIT_SUCCESS_FILE, steps.STEP_METADATA_FILE):  # step 1 mid-deletion: its items are left
        (tmp_path / "1" / name).unlink()
    listing = steps.scan_steps(tmp_path)
    assert listing.steps == [2]
    assert listing.incomplete == ["1", "3", "4.orbax-checkpoint-tmp-1700000000"]
    assert listing.deleting == ["1"]
    assert tt.open_source(tmp_path).deleting == ["1"]
    # Where no step carries a marker (Orbax before step metadata), nothing is said to be deleted.
    old = tmp_path / "old"
    (old / "5" / "params").mkdir(parents=True)
    (old / "6").mkdir()
    (old / "5" / "params" / steps.PYTREE_METADATA_FILE).write_text("{}")
    listing = steps.scan_steps(old)
    assert listing.steps == [5] and listing.incomplete == ["6"] and listing.deleting == []
