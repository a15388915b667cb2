"""Issue 17: a memory budget for what one read decodes, and steps deleted while they are read.

* A stored chunk is decoded whole by TensorStore: a ``.zarray`` that declares
  2^40-element chunks (or a tiny file whose one chunk decodes to 4 GiB) must be
  refused, by the chunk shape the store itself reports, before anything is
  allocated: one line naming the leaf and ``--memory-budget``.
* A step folder that a manager deletes between the listing and the read is a
  ``StepDeletedError`` naming the step; ``inspect`` of the latest step reads
  once more and shows the step that is latest now.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

import treetools as tt
import treetools.checkpoint_tools.report as report_module
import treetools.checkpoint_tools.stats as stats_module
from treetools.cli import main
from treetools.shared.errors import CheckpointError, StepDeletedError
from treetools.checkpoint_tools.report import inspect_path


def _plain_orbax(folder: Path, tree: dict) -> Path:
    """A PyTreeCheckpointer folder without OCDBT: one zarr folder (``.zarray``) per leaf."""
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as ckptr:
        ckptr.save(folder, args=ocp.args.PyTreeSave(tree))
    return folder


def _declare_chunks(folder: Path, leaf: str, chunks: list[int]) -> None:
    zarray = folder / leaf / ".zarray"
    meta = json.loads(zarray.read_text())
    meta["chunks"] = chunks
    zarray.write_text(json.dumps(meta))


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- memory budget


def test_hostile_chunk_declaration_is_refused_before_allocating(tmp_path, capsys):
    folder = _plain_orbax(tmp_path / "ckpt", {"w": np.arange(16, dtype=np.float32), "b": np.ones(4, np.float32)})
    _declare_chunks(folder, "w", [2**40])  # 4 TiB of float32 in one chunk
    assert _run(capsys, "inspect", folder)[0] == 0  # metadata mode reads no chunk
    code, out, err = _run(capsys, "inspect", folder, "--stats")
    assert code == 1
    line = err.strip()
    assert line.count("\n") == 0 and "`w`" in line and "--memory-budget" in line and "4.00 TiB" in line, line
    assert _run(capsys, "verify", folder)[0] == 1
    code, _, err = _run(capsys, "inspect", folder, "--show", "w[:2]")
    assert code == 1 and "--memory-budget" in err


def test_hostile_chunk_child_process_exits_cleanly_with_small_peak(tmp_path):
    # Before the check TensorStore aborted the process with std::bad_alloc (or the OOM killer ended it).
    folder = _plain_orbax(tmp_path / "ckpt", {"w": np.arange(16, dtype=np.float32)})
    _declare_chunks(folder, "w", [2**40])
    peak = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "print(p.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", peak, sys.executable, "-m", "treetools", "inspect", str(folder),
                           "--stats"], capture_output=True, text=True, timeout=120)
    code, kib = proc.stdout.split("\n", 1)[0].split()
    assert int(code) == 1, proc.stdout
    assert int(kib) < 600 * 1024, kib  # a CLI process, not a 4 TiB allocation
    assert "memory budget" in proc.stdout


def test_decompression_bomb_chunk_is_refused_by_default(tmp_path, capsys):
    # A 1-element leaf re-declared as one chunk of 2^30 float32 (4 GiB decoded): the file stays tiny.
    folder = _plain_orbax(tmp_path / "ckpt", {"w": np.ones(8, np.float32)})
    meta = json.loads((folder / "w" / ".zarray").read_text())
    meta["shape"], meta["chunks"] = [2**30], [2**30]
    (folder / "w" / ".zarray").write_text(json.dumps(meta))
    assert sum(f.stat().st_size for f in (folder / "w").iterdir()) < 200 * 1024
    code, _, err = _run(capsys, "inspect", folder, "--stats")
    assert code == 1 and "4.00 GiB" in err and "2.00 GiB" in err and "--memory-budget" in err


def test_budget_flag_and_variable_are_honoured(tmp_path, capsys, monkeypatch):
    w = np.random.default_rng(0).random(2**20, dtype=np.float32)  # 4 MiB, Orbax writes it as one chunk
    folder = _plain_orbax(tmp_path / "ckpt", {"w": w})
    code, _, err = _run(capsys, "inspect", folder, "--stats", "--memory-budget-mb", "1")
    assert code == 1 and "4.00 MiB" in err and "1.00 MiB" in err
    assert "TREETOOLS_MEMORY_BUDGET_MB" not in os.environ  # the flag does not leak out of the command
    code, out, _ = _run(capsys, "inspect", folder, "--stats", "--memory-budget-mb", "8", "--format", "json")
    assert code == 0
    row = json.loads(out)["checkpoints"][0]["items"]["default"]["leaves"][0]
    assert row["stats"]["max"] == pytest.approx(float(w.max()))
    monkeypatch.setenv("TREETOOLS_MEMORY_BUDGET_MB", "1")
    with pytest.raises(CheckpointError, match="memory budget"):
        inspect_path(str(folder), stats=True)
    assert _run(capsys, "diff", folder, folder, "--values")[0] == 2  # diff: trouble
    assert _run(capsys, "diff", folder, folder, "--values", "--memory-budget-mb", "8")[0] == 0


def test_show_whole_leaf_over_budget_asks_for_a_slice(tmp_path, capsys):
    w = np.arange(2**20, dtype=np.float32)
    np.savez(tmp_path / "w.npz", w=w)
    code, _, err = _run(capsys, "inspect", tmp_path / "w.npz", "--show", "w", "--memory-budget-mb", "1")
    assert code == 1 and "w[:4]" in err and "--memory-budget" in err
    code, out, _ = _run(capsys, "inspect", tmp_path / "w.npz", "--show", "w[5:8]", "--memory-budget-mb", "1")
    assert code == 0 and "5. 6. 7." in out


def test_load_parameters_is_not_held_to_the_block_budget(tmp_path, monkeypatch):
    # load_parameters needs whole arrays: the budget is for streamed reads, not for it.
    w = np.random.default_rng(1).random(2**20, dtype=np.float32)
    root = tmp_path / "run"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root)
    tt.save_checkpoint(mngr, 1, {"params": {"w": w}}, wait=True)
    monkeypatch.setenv("TREETOOLS_MEMORY_BUDGET_MB", "1")
    np.testing.assert_array_equal(tt.load_parameters(root)["w"], w)


# ----------------------------------------------------------------------------- steps deleted while read


def _two_steps(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root)
    for step in (1, 2):
        tt.save_checkpoint(mngr, step, {"params": {"w": np.full(4, step, np.float32)}}, wait=True)
    mngr.close()
    return root


def test_snapshot_of_a_deleted_step_names_the_step(tmp_path):
    root = _two_steps(tmp_path)
    source = tt.open_source(root)
    shutil.rmtree(root / "1")
    with pytest.raises(StepDeletedError, match=r"step 1 was deleted while it was being read.*run again"):
        source.snapshot(1)
    assert source.snapshot(2).step == 2  # the others read as before


def test_inspect_reads_again_when_the_latest_step_went(tmp_path, capsys, monkeypatch):
    root = _two_steps(tmp_path)
    real = report_module.open_source
    calls = []

    def racing_open(path, *args, **kwargs):
        src = real(path, *args, **kwargs)
        if not calls:  # the first listing sees steps 1, 2; then a manager saves 3 and prunes 2
            shutil.copytree(root / "2", root / "3")
            shutil.rmtree(root / "2")
        calls.append(path)
        return src

    monkeypatch.setattr(report_module, "open_source", racing_open)
    report = inspect_path(str(root))
    assert report.step == 3 and len(calls) == 2
    assert "step 2 was deleted" in report.notes[0] and "showing step 3" in report.notes[0]

    shutil.copytree(root / "3", root / "2")
    calls.clear()
    shutil.rmtree(root / "3")  # the race above, now on step 2 asked for by number: it recreates 3, prunes 2
    with pytest.raises(StepDeletedError, match="step 2"):  # a step asked for by number is not swapped
        inspect_path(str(root), step=2)


def test_stats_of_a_step_deleted_mid_read_is_retried_for_the_latest(tmp_path, capsys, monkeypatch):
    root = _two_steps(tmp_path)
    real = stats_module.compute_stats  # imported by inspect when it computes statistics: patched at its source
    deleted = []

    def pruned_first(*args, **kwargs):
        if not deleted:  # the step goes after its metadata was read, while its arrays are
            shutil.copytree(root / "2", root / "3")
            shutil.rmtree(root / "2")
            deleted.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(stats_module, "compute_stats", pruned_first)
    code, out, err = _run(capsys, "inspect", root, "--stats", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["checkpoints"][0]["step"] == 3
    assert data["checkpoints"][0]["items"]["params"]["leaves"][0]["stats"]["mean"] == pytest.approx(2.0)
    assert "step 2 was deleted" in err


def test_msgpack_is_read_by_offset_within_a_budget_smaller_than_the_file(tmp_path, capsys, monkeypatch):
    from flax import serialization

    w = np.random.default_rng(2).random(2**20, dtype=np.float32)  # a 4 MiB file, never parsed whole
    path = tmp_path / "state.msgpack"
    path.write_bytes(serialization.to_bytes({"params": {"w": w}}))
    code, out, err = _run(capsys, "inspect", path, "--memory-budget-mb", "1", "--stats", "--chunk-mb", "0.5",
                          "--format", "json")
    assert code == 0, err
    stats = json.loads(out)["checkpoints"][0]["items"]["default"]["leaves"][0]["stats"]
    assert stats["max"] == pytest.approx(float(w.max()))
    code, out, _ = _run(capsys, "inspect", path, "--memory-budget-mb", "1", "--show", "params/w[:3]")
    assert code == 0 and np.array2string(w[:3]).split()[0].strip("[") in out
    code, _, err = _run(capsys, "inspect", path, "--memory-budget-mb", "1", "--show", "params/w")
    assert code == 1 and "--memory-budget" in err  # a 4 MiB slice is over a 1 MiB budget, as for any format
    monkeypatch.setenv("TREETOOLS_MEMORY_BUDGET_MB", "1")
    np.testing.assert_array_equal(tt.load_parameters(path)["w"], w)


def test_show_slices_are_held_to_the_budget_by_what_they_read(tmp_path, capsys):
    w = np.arange(2**20, dtype=np.float32)  # 4 MiB
    np.savez(tmp_path / "w.npz", w=w)
    for spec in ("w[:]", "w[::2]"):  # a strided slice reads its whole span
        code, _, err = _run(capsys, "inspect", tmp_path / "w.npz", "--show", spec, "--memory-budget-mb", "1")
        assert code == 1 and "4.00 MiB" in err and "--memory-budget" in err, (spec, err)
    code, out, _ = _run(capsys, "inspect", tmp_path / "w.npz", "--show", "w[::2]", "--memory-budget-mb", "inf",
                        "--format", "json")
    assert code == 0 and json.loads(out)["value"] == w[::2].tolist()  # `inf`: no budget


def test_show_on_a_compressed_npz_member(tmp_path, capsys):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.savez_compressed(tmp_path / "w.npz", w=w)
    code, out, err = _run(capsys, "inspect", tmp_path / "w.npz", "--show", "w[1]", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["value"] == w[1].tolist()


def test_verify_over_budget_is_a_known_error_not_damage(tmp_path, capsys):
    w = np.random.default_rng(0).random(2**20, dtype=np.float32)
    folder = _plain_orbax(tmp_path / "ckpt", {"w": w})
    code, out, err = _run(capsys, "verify", folder, "--memory-budget-mb", "1")
    assert code == 1 and "FAILED" not in out and "memory budget" in err and "--memory-budget" in err
    assert _run(capsys, "verify", folder, "--memory-budget-mb", "8")[0] == 0


@pytest.fixture
def prune_after_open(monkeypatch):
    """Patch a module's ``open_source`` so that right after the listing, step 2's folder is deleted."""
    def patch(module, root: Path):
        real = tt.open_source

        def racing_open(path, *args, **kwargs):
            src = real(path, *args, **kwargs)
            shutil.rmtree(root / "2", ignore_errors=True)
            return src

        monkeypatch.setattr(module, "open_source", racing_open)
    return patch


def test_load_parameters_and_restore_of_a_pruned_step_name_it(tmp_path, prune_after_open):
    import treetools.checkpoint_jax.restore as restore_module  # the module whose open_source load_parameters and restore use

    root = _two_steps(tmp_path)
    prune_after_open(restore_module, root)
    with pytest.raises(StepDeletedError, match="step 2 was deleted"):
        tt.load_parameters(root, step=2)
    shutil.copytree(root / "1", root / "2")
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root)
    with pytest.raises(StepDeletedError, match="step 2 was deleted"):
        tt.restore_checkpoint(mngr, 2, {"params": {"w": jax_struct((4,))}})


def jax_struct(shape):
    import jax

    return jax.ShapeDtypeStruct(shape, np.float32)


def test_verify_and_show_of_a_pruned_step_name_it(tmp_path, capsys, prune_after_open):
    import treetools.checkpoint_tools.verify as verify_module

    root = _two_steps(tmp_path)
    prune_after_open(verify_module, root)
    code, out, err = _run(capsys, "verify", root, "--step", "2")
    assert code == 1 and "step 2 was deleted" in err and "FAILED" not in out
    shutil.copytree(root / "1", root / "2")
    import treetools.checkpoint_tools.show as show_module  # --show reads through show_leaf

    prune_after_open(show_module, root)
    code, _, err = _run(capsys, "inspect", root, "--step", "2", "--show", "params/w")
    assert code == 1 and "step 2 was deleted" in err
