"""Flax's legacy ``flax.training.checkpoints.save_checkpoint``: msgpack ``checkpoint_<N>`` files and its Orbax mode.

Every checkpoint here is written by flax itself; the truth is the tree handed to it.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from flax import config as flax_config
from flax.training import checkpoints

import treetools as tt
from treetools.cli import main
from treetools.shared.errors import StepDeletedError
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_tools.report import inspect_path


def _state(step):
    rng = np.random.default_rng(int(step))
    return {"params": {"Dense_0": {"kernel": rng.standard_normal((3, 4)).astype(np.float32),
                                   "bias": np.full((4,), step, np.float32)}},
            "opt": {"mu": np.arange(4, dtype=np.float32) * step}}


@contextlib.contextmanager
def _orbax_backend(on):
    old = flax_config.flax_use_orbax_checkpointing
    flax_config.update("flax_use_orbax_checkpointing", on)
    try:
        yield
    finally:
        flax_config.update("flax_use_orbax_checkpointing", old)


def write_flax_legacy(folder, steps=(1, 2, 3), *, orbax=False, prefix="checkpoint_"):
    """Save ``_state(step)`` for each step with flax's own save_checkpoint; returns {step: state}."""
    with _orbax_backend(orbax):
        for step in steps:
            checkpoints.save_checkpoint(str(folder), _state(step), step, prefix=prefix, keep=100)
    return {step: _state(step) for step in steps}


def _leaves(rep, i=0):
    return {leaf["path"]: leaf for leaf in rep["checkpoints"][i]["items"]["default"]["leaves"]}


def _assert_tree_equal(got, want):
    assert sorted(tt.flatten(got)) == sorted(tt.flatten(want))
    for path, value in tt.flatten(want).items():
        np.testing.assert_array_equal(tt.flatten(got)[path], value, err_msg=path)


@pytest.fixture
def msgpack_dir(tmp_path):
    truth = write_flax_legacy(tmp_path)
    # An unfinished save: flax writes <prefix>tmp and renames it when done. Garbage, so reading it would fail.
    (tmp_path / "checkpoint_tmp").write_bytes(b"\x82\xa1a")
    return tmp_path, truth


def test_msgpack_steps_latest_and_unfinished_save(msgpack_dir):
    folder, truth = msgpack_dir
    assert sorted(os.listdir(folder)) == ["checkpoint_1", "checkpoint_2", "checkpoint_3", "checkpoint_tmp"]
    rep = inspect_path(str(folder), stats=True).to_json()
    assert rep["format"] == "flax-legacy"
    assert rep["steps"] == [1, 2, 3] and rep["incomplete"] == ["checkpoint_tmp"]
    assert rep["checkpoints"][0]["step"] == 3
    leaves = _leaves(rep)
    assert sorted(leaves) == sorted(tt.flatten(truth[3]))
    assert leaves["params/Dense_0/bias"]["stats"]["mean"] == 3.0
    kernel = truth[3]["params"]["Dense_0"]["kernel"]
    assert leaves["params/Dense_0/kernel"]["stats"]["max"] == pytest.approx(float(kernel.max()))
    with pytest.raises(tt.CheckpointError, match="unfinished Flax save"):  # pointed at directly: still never read
        inspect_path(str(folder / "checkpoint_tmp"))
    one = _leaves(inspect_path(str(folder), step=1, stats=True).to_json())
    assert one["opt/mu"]["stats"]["max"] == 3.0  # arange(4) * 1


def test_msgpack_load_parameters_latest_and_step(msgpack_dir):
    folder, truth = msgpack_dir
    _assert_tree_equal(tt.load_parameters(folder), truth[3]["params"])
    _assert_tree_equal(tt.load_parameters(folder, step=2), truth[2]["params"])
    with pytest.raises(FileNotFoundError, match="1, 2, 3"):
        tt.load_parameters(folder, step=7)


def test_msgpack_cli_show_unknown_step_and_verify(msgpack_dir, capsys):
    folder, truth = msgpack_dir
    assert main(["inspect", str(folder), "--step", "2", "--show", "params/Dense_0/bias"]) == 0
    assert "[2. 2. 2. 2.]" in capsys.readouterr().out
    assert main(["inspect", str(folder), "--step", "9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("treetools: error:") and "1, 2, 3" in err
    assert main(["verify", str(folder), "--step", "all"]) == 0


def test_msgpack_step_deleted_after_listing(msgpack_dir):
    folder, truth = msgpack_dir
    source = open_source(str(folder))
    assert source.snapshot(3).items["default"].leaves  # a step file that is there reads
    (folder / "checkpoint_2").write_bytes(b"\x82\xa1")  # still there, but corrupt: not "deleted"
    with pytest.raises(tt.CheckpointError, match="corrupt or truncated") as e:
        source.snapshot(2)
    assert not isinstance(e.value, StepDeletedError)
    (folder / "checkpoint_3").unlink()  # keep= pruning it between the listing and the read
    with pytest.raises(StepDeletedError, match="step 3 was deleted"):
        source.snapshot(3)


def test_msgpack_other_prefix(tmp_path):
    # A float step (flax allows them, and orders them by number with the others: natural_sort) is a step too.
    floats = write_flax_legacy(tmp_path, (1.5,), prefix="ckpt_")
    truth = write_flax_legacy(tmp_path, (5, 40), prefix="ckpt_")
    assert (tmp_path / "ckpt_1.5").is_file()
    rep = inspect_path(str(tmp_path)).to_json()
    assert rep["format"] == "flax-legacy" and rep["steps"] == [1.5, 5, 40]
    _assert_tree_equal(tt.load_parameters(tmp_path, step=5), truth[5]["params"])
    _assert_tree_equal(tt.load_parameters(tmp_path, step=1.5), floats[1.5]["params"])


def test_msgpack_single_file_is_a_msgpack_checkpoint(msgpack_dir):
    folder, truth = msgpack_dir
    rep = inspect_path(str(folder / "checkpoint_2")).to_json()
    assert rep["format"] == "msgpack" and rep["steps"] is None
    _assert_tree_equal(tt.load_parameters(folder / "checkpoint_2"), truth[2]["params"])


def test_msgpack_diff_of_two_steps(msgpack_dir, capsys):
    folder, _ = msgpack_dir
    assert main(["diff", str(folder / "checkpoint_3"), str(folder), "--values"]) == 0
    assert main(["diff", str(folder / "checkpoint_1"), str(folder), "--values"]) == 1


@pytest.fixture
def orbax_dir(tmp_path):
    return tmp_path, write_flax_legacy(tmp_path, (1, 2), orbax=True)


def test_orbax_mode_root_lists_steps_and_reads_the_step_folder_as_the_item(orbax_dir):
    folder, truth = orbax_dir
    # flax's Orbax backend writes each step folder as one item: its files sit next to the step metadata.
    assert {"_METADATA", "_CHECKPOINT_METADATA"} <= set(os.listdir(folder / "checkpoint_2"))
    rep = inspect_path(str(folder), stats=True).to_json()
    assert rep["format"] == "orbax" and rep["steps"] == [1, 2]
    assert list(rep["checkpoints"][0]["items"]) == ["default"]
    leaves = _leaves(rep)
    assert sorted(leaves) == sorted(tt.flatten(truth[2]))
    assert leaves["params/Dense_0/bias"]["stats"]["mean"] == 2.0
    _assert_tree_equal(tt.load_parameters(folder), truth[2]["params"])
    _assert_tree_equal(tt.load_parameters(folder, step=1), truth[1]["params"])
    _assert_tree_equal(tt.load_parameters(folder / "checkpoint_1"), truth[1]["params"])


def test_orbax_mode_errors_never_name_orbax_internals(orbax_dir, capsys):
    folder, _ = orbax_dir
    with pytest.raises(FileNotFoundError) as e:
        tt.load_parameters(folder, item="weights")  # no item, no key of one
    assert "items: default." in str(e.value)
    for internal in ("ocdbt.process_0", "array_metadatas", "`d`", " d,", "manifest"):
        assert internal not in str(e.value)
    assert main(["inspect", str(folder), "--item", "d"]) == 1
    assert "items: default." in capsys.readouterr().err


def test_orbax_mode_restore_round_trip_and_verify(orbax_dir):
    folder, truth = orbax_dir
    whole = tt.load_parameters(folder, item="default")
    restored = tt.restore_checkpoint(str(folder), 1, {"default": tt.make_abstract(whole)})["default"]
    _assert_tree_equal(restored, truth[1])
    assert main(["verify", str(folder), "--step", "all"]) == 0


def test_orbax_mode_unfinished_save_is_listed_not_read(orbax_dir):
    folder, _ = orbax_dir
    tmp = folder / "checkpoint_3.orbax-checkpoint-tmp-1700000000"
    tmp.mkdir()
    (tmp / "_METADATA").write_text("{broken")
    rep = inspect_path(str(folder)).to_json()
    assert rep["steps"] == [1, 2] and rep["incomplete"] == [tmp.name]
    assert rep["checkpoints"][0]["step"] == 2


def test_a_run_resumed_with_the_other_backend_reads_both_kinds_of_step(tmp_path):
    # Step 1 saved in Orbax mode, step 2 in msgpack mode, in one folder: flax reads both, and so does treetools.
    d = tmp_path / "mixed"
    truth = write_flax_legacy(d, (1,), orbax=True)
    truth.update(write_flax_legacy(d, (2,), orbax=False))
    assert checkpoints.latest_checkpoint(str(d)).endswith("checkpoint_2")  # flax's own answer
    source = open_source(str(d))
    assert source.format == "flax-legacy" and source.steps == [1, 2]
    for step in (1, 2):
        _assert_tree_equal(tt.load_parameters(d, step=step), truth[step]["params"])
    assert main(["verify", str(d), "--step", "all"]) == 0


def test_multi_process_gda_placeholders_are_refused_not_returned(tmp_path):
    # flax's save_checkpoint_multiprocess keeps '//GDAPlaceholder:<path>' strings in the msgpack and the arrays
    # in checkpoint_<N>_gda/ (flax.training.checkpoints.MP_ARRAY_PH); the placeholder is no parameter.
    from flax.serialization import to_bytes

    (tmp_path / "checkpoint_1").write_bytes(to_bytes({"params": {"w": checkpoints.MP_ARRAY_PH + "params/w",
                                                                 "b": np.ones(3, np.float32)}}))
    with pytest.raises(tt.CheckpointError, match=r"multi-process checkpoint.*params/w.*checkpoint_1_gda"):
        tt.load_parameters(tmp_path)
    assert main(["verify", str(tmp_path)]) == 1


def test_a_first_save_still_in_progress_is_incomplete_never_read(tmp_path, capsys):
    # During the first save the folder holds only `<prefix>tmp`: no committed step, and the file is never read.
    from flax.serialization import to_bytes

    (tmp_path / "ckpt_tmp").write_bytes(to_bytes({"params": {"w": np.ones(3, np.float32)}}))
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no committed checkpoint step (incomplete, never read: ckpt_tmp)" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "ckpt_tmp")]) == 1
    assert "unfinished Flax save" in capsys.readouterr().err


@pytest.mark.parametrize("orbax", [False, True], ids=["msgpack", "orbax-mode"])
def test_checkpoints_named_by_a_metric_are_steps_of_one_series(tmp_path, orbax):
    # Issue 49: `save_checkpoint(dir, state, step=<accuracy>, prefix="best_acc_")` names them `best_acc_0.5`...:
    # steps of one series (they were shown as items and their totals summed), the latest flax's own latest.
    from tests._every_command import (check_convert, check_inspect, check_load_parameters, check_restore,
                                      check_show, check_stats, check_verify, flat_arrays, inspect_json, run)

    folder = tmp_path / "best"
    states = {}
    with _orbax_backend(orbax):
        for acc in (0.5, 0.5625, 0.625):  # improving accuracies, saved as they come
            states[acc] = _state(int(acc * 16))
            checkpoints.save_checkpoint(str(folder), states[acc], step=acc, prefix="best_acc_", keep=5)
    latest = checkpoints.latest_checkpoint(str(folder), prefix="best_acc_")
    assert os.path.basename(latest) == "best_acc_0.625"  # flax's own choice (natural_sort)
    report = inspect_json(folder)
    assert report["format"] == "flax-legacy"
    assert report["steps"] == [0.5, 0.5625, 0.625]
    assert report["checkpoints"][0]["step"] == 0.625
    (checkpoint,) = report["checkpoints"]
    assert list(checkpoint["items"]) == ["default"]
    # one model's totals, not the sum of three: 3*4 + 4 params and 4 optimizer elements
    assert checkpoint["items"]["default"]["total_params"] == 3 * 4 + 4 + 4
    truth = {acc: flat_arrays(state) for acc, state in states.items()}
    check_inspect(folder, truth[0.625])
    check_inspect(folder, truth[0.5], args=("--step", "0.5"))
    check_stats(folder, truth[0.5625], args=("--step", "0.5625"))
    check_show(folder, truth[0.5], args=("--step", "0.5"))
    check_load_parameters(folder, flat_arrays(states[0.625]["params"]))
    check_load_parameters(folder, flat_arrays(states[0.5]["params"]), step=0.5)
    check_load_parameters(folder, flat_arrays(states[0.5]["params"]), step="0.5")
    check_restore(folder, truth[0.5625], item="default", step=0.5625)
    rules = tt.Rules(rename=[(r"^params/Dense_0/", "params/head/")])
    check_restore(folder, truth[0.625], item="default", rules=rules,
                  expect={k.replace("Dense_0", "head"): v for k, v in truth[0.625].items()})
    check_convert(folder, flat_arrays(states[0.5]["params"]), tmp_path / "c", args=("--step", "0.5"))
    out = check_verify(folder, "--step", "all")
    assert out.count("ok:") == 3 and "(step 0.5625)" in out, out
    rc, out, err = run("diff", folder, "--step", "0.5", "--step", "0.625", "--values", "--format", "json")
    assert rc == 1, out + err
    rc, out, err = run("inspect", folder, "--step", "0.75")
    assert rc == 1 and "no step 0.75" in err and "0.5, 0.5625, 0.625" in err, err


def test_metric_named_checkpoints_beside_numbered_ones_are_another_series(tmp_path):
    # `save_checkpoint(dir, state, step)` and `save_checkpoint(dir, best, step=acc, prefix="best_acc_")` into one
    # folder (Orbax mode, flax's default): two series; `checkpoint_` is read, `best_acc_` named and read by --prefix.
    from tests._every_command import check_load_parameters, flat_arrays, run

    with _orbax_backend(True):
        for step in (1, 2):
            checkpoints.save_checkpoint(str(tmp_path), _state(step), step, keep=5)
        checkpoints.save_checkpoint(str(tmp_path), _state(7), step=0.75, prefix="best_acc_", keep=5)
    rep = inspect_path(str(tmp_path)).to_json()
    assert rep["format"] == "flax-legacy" and rep["steps"] == [1, 2]
    rc, out, err = run("inspect", tmp_path)
    assert rc == 0 and "'best_acc_' (step 0.75)" in err, err
    check_load_parameters(tmp_path, flat_arrays(_state(2)["params"]))
    check_load_parameters(tmp_path, flat_arrays(_state(7)["params"]), prefix="best_acc_")
    check_load_parameters(tmp_path, flat_arrays(_state(7)["params"]), prefix="best_acc_", step=0.75)
