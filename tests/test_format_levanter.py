"""Levanter checkpoints (issue 29): ``checkpoints/<run_id>/step-N/`` with ``metadata.json`` and one zarr folder per
leaf, written as Levanter's Checkpointer writes them (tests/_writers/levanter.py names the file and commit).

Read at the run root, a step folder, and an item folder (``step-N/model``). A step is committed when its
``metadata.json`` is there (Levanter writes it after every array); a ``step-N`` folder without it is listed as
incomplete and never read. Each top-level entry of a step is an item: ``model`` (the parameters, what
``load_parameters`` returns), ``opt_state``, ``step`` and ``training_key``; an entry that is one array
(``step``, ``training_key``) is an item of one leaf named like the item. The truth is the writer's arrays.
"""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import ml_dtypes
import numpy as np
import pytest

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf,
                                  check_inspect, check_load_parameters, check_refused, check_restore, check_show,
                                  check_stats, check_verify, inspect_json, run, run_fresh)
from tests._writers.levanter import save_export, save_levanter, trainer_state

ScaleByAdamState = namedtuple("ScaleByAdamState", ["count", "mu", "nu"])  # optax's field names


def _model(step: int, delta: float = 0.0) -> dict:
    rng = np.random.default_rng(step)
    return {"embeddings": {"token_embeddings": {"weight": rng.standard_normal((7, 4)).astype(ml_dtypes.bfloat16)}},
            "transformer": {"blocks": {"stacked": {"attn": {"c_attn": {
                "weight": rng.standard_normal((2, 4, 12)).astype(np.float32) + delta,
                "bias": (np.arange(24).reshape(2, 12) + step).astype(np.float32)}}}}}}


def _opt_state(model: dict, step: int):
    """optax.adam's state shape: (ScaleByAdamState(count, mu, nu), EmptyState ())."""
    def like(scale):
        return _map(model, lambda x: (np.ones(x.shape) * scale).astype(x.dtype))

    return (ScaleByAdamState(np.asarray(step, np.int32), like(0.5), like(0.25)), ())


def _map(tree, fn):
    return {k: _map(v, fn) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _truth(state: dict) -> dict[str, dict[str, np.ndarray]]:
    """{item: {path: array}}: the state's top-level fields, one-array fields as items of one leaf."""
    out = {}
    for item, value in state.items():
        flat = tt.flatten(value if isinstance(value, (dict, tuple)) else {item: value})
        out[item] = {k: np.asarray(v) for k, v in flat.items()}
    return out


def write_run(base, steps=(10, 20), *, delta: float = 0.0, unfinished: int | None = 30) -> dict[int, dict]:
    truth = {}
    for step in steps:
        model = _model(step, delta)
        state = trainer_state(step, model, _opt_state(model, step), seed=step)
        save_levanter(base, step, state, is_temporary=(step == steps[-1]))
        truth[step] = _truth(state)
    if unfinished is not None:  # preempted: arrays written, no metadata.json
        model = _model(unfinished)
        save_levanter(base, unfinished, trainer_state(unfinished, model, _opt_state(model, unfinished)), finish=False)
    return truth


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("levanter") / "checkpoints" / "run-abc123"
    return base, write_run(base)


def test_root_lists_committed_steps_and_the_preempted_save(run_dir):
    base, truth = run_dir
    report = inspect_json(base)
    assert report["format"] == "levanter"
    assert report["steps"] == [10, 20]
    assert report["incomplete"] == ["step-30"]
    assert report["checkpoints"][0]["step"] == 20
    assert list(report["checkpoints"][0]["items"])[0] == "model"  # the params first
    assert set(report["checkpoints"][0]["items"]) == {"model", "opt_state", "step", "training_key"}
    for item, leaves in truth[20].items():
        check_inspect(base, leaves, item=item)
    for item, leaves in truth[10].items():
        check_inspect(base, leaves, item=item, args=("--step", 10))
    with pytest.raises(tt.CheckpointNotFoundError, match="step 30 is an incomplete save"):
        tt.load_parameters(base, step=30)


def test_step_folder_and_model_folder_read_directly(run_dir):
    base, truth = run_dir
    step_dir = base / "step-10"
    for item, leaves in truth[10].items():
        check_inspect(step_dir, leaves, item=item)
    check_inspect(step_dir / "model", truth[10]["model"])
    check_load_parameters(step_dir / "model", truth[10]["model"])
    check_load_parameters(step_dir, truth[10]["model"])
    check_refused(base / "step-30", "incomplete")  # pointed at directly: still never read


def test_values_stats_and_load_parameters(run_dir):
    base, truth = run_dir
    check_show(base, truth[20]["model"], item="model")
    check_stats(base, truth[20]["model"], item="model")
    check_show(base, truth[10]["opt_state"], item="opt_state", args=("--step", 10))
    check_load_parameters(base, truth[20]["model"])  # bf16 embedding stays bf16
    check_load_parameters(base, truth[10]["opt_state"], step=10, item="opt_state")
    assert int(tt.load_parameters(base, step=10, item="step")["step"]) == 10
    np.testing.assert_array_equal(tt.load_parameters(base, item="training_key")["training_key"],
                                  truth[20]["training_key"]["training_key"])
    assert truth[20]["training_key"]["training_key"].dtype == np.uint32


def test_verify_reads_every_array_of_every_committed_step(run_dir):
    base, truth = run_dir
    out = check_verify(base, "--step", "all")
    assert out.count("ok:") == 2, out
    for step in (10, 20):
        want = sum(v.nbytes for leaves in truth[step].values() for v in leaves.values())
        line = next(line for line in out.splitlines() if f"(step {step})" in line)
        assert f"{want:,} bytes read and decoded" in line, line


def test_diff_names_the_leaf_the_writer_changed(run_dir, tmp_path):
    base, truth = run_dir
    other = tmp_path / "other" / "run-abc123"
    write_run(other, steps=(10, 20), delta=0.5, unfinished=None)
    # Only model/transformer/.../c_attn/weight differs, by 0.5 (float32: exact).
    check_diff_names_the_changed_leaf(base, other, "transformer/blocks/stacked/attn/c_attn/weight", 0.5,
                                      item="model")
    rc, out, err = run("diff", base, "--step", 10, "--step", 20, "--item", "step", "--values")
    assert rc == 1, out + err


def test_restore(run_dir):
    base, truth = run_dir
    check_restore(base, truth[20]["model"], item="model")
    check_restore(base, truth[10]["model"], item="model", step=10)
    check_restore(base, truth[20]["training_key"], item="training_key")


def test_restore_with_rules(run_dir):
    base, truth = run_dir
    rules = tt.Rules(rename=[(r"^transformer/", "decoder/")])
    renamed = {k.replace("transformer/", "decoder/", 1): v for k, v in truth[20]["model"].items()}
    check_restore(base, truth[20]["model"], item="model", rules=rules, expect=renamed)


def test_convert(run_dir, tmp_path):
    base, truth = run_dir
    check_convert(base, truth[20]["model"], tmp_path, item="model")


def test_a_step_folder_copied_without_one_array_is_refused_by_name(run_dir, tmp_path):
    base, truth = run_dir
    copy = tmp_path / "step-10"
    shutil.copytree(base / "step-10", copy)
    shutil.rmtree(copy / "model" / "transformer" / "blocks" / "stacked" / "attn" / "c_attn" / "bias")
    (copy / "model" / "transformer" / "blocks" / "stacked" / "attn" / "c_attn" / "bias").mkdir()  # empty folder
    rc, out, err = run("verify", copy)
    assert rc == 1
    assert "c_attn/bias" in out + err


def test_jax_is_not_imported_for_metadata(run_dir):
    base, _ = run_dir
    done = run_fresh("inspect", base, forbid=["jax"])
    assert done.returncode == 0, done.stderr


def test_diff_values_reports_a_changed_step_and_training_key(tmp_path):
    # Issue 37: integers are compared exactly. Step 100,000 -> 100,001 and a key word ~2**31 changed by 7 lie
    # within diff's default relative tolerance (1e-5) as floats would; as integers they are changes.
    model = _model(1)
    a = save_levanter(tmp_path / "a", 100_000, {**trainer_state(100_000, model, _opt_state(model, 1)),
                                                 "training_key": np.asarray([2_000_000_000, 5], np.uint32)})
    b = save_levanter(tmp_path / "b", 100_000, {**trainer_state(100_001, model, _opt_state(model, 1)),
                                                 "training_key": np.asarray([2_000_000_007, 5], np.uint32)})
    rc, out, err = run("diff", a, b, "--values", "--format", "json")
    assert rc == 1, out + err

    differing = {row["path"]: row for row in json.loads(out)["values"] if not row["bit_identical"]}
    assert set(differing) == {"step/step", "training_key/training_key"}, differing
    assert differing["step/step"]["max_abs_diff"] == 1 and differing["training_key/training_key"]["max_abs_diff"] == 7
    assert all(row["mismatched"] == 1 for row in differing.values()), differing


def test_a_bare_save_checkpoint_export_reads_at_the_root_the_step_and_the_model_folder(tmp_path):
    # Issue 49: Levanter's `save_checkpoint({"model": model}, 0, "export/step-0")` (the function the Checkpointer
    # calls, here without a trainer state): metadata.json beside `model/` and no array at the step's top. The root
    # and the step were refused, and `step-0/model` was read as a generic tree without its item.
    model = _model(3)
    save_levanter(tmp_path / "export", 0, {"model": model})
    assert sorted(p.name for p in (tmp_path / "export" / "step-0").iterdir()) == ["metadata.json", "model"]
    truth = _truth({"model": model})["model"]
    assert truth["embeddings/token_embeddings/weight"].dtype == ml_dtypes.bfloat16
    for path in (tmp_path / "export", tmp_path / "export" / "step-0", tmp_path / "export" / "step-0" / "model"):
        report = check_inspect(path, truth, item="model")
        assert report["format"] == "levanter" and list(report["checkpoints"][0]["items"]) == ["model"], path
        assert report["checkpoints"][0]["step"] == 0
        check_load_parameters(path, truth)
    root = tmp_path / "export"
    assert inspect_json(root)["steps"] == [0]
    check_stats(root, truth, item="model")
    check_show(root, truth, item="model")
    out = check_verify(root)
    assert f"{sum(v.nbytes for v in truth.values()):,} bytes read and decoded" in out, out
    check_restore(root, truth, item="model")
    rules = tt.Rules(rename=[(r"^embeddings/", "embed/")])
    check_restore(root, truth, item="model", rules=rules,
                  expect={k.replace("embeddings/", "embed/", 1): v for k, v in truth.items()})
    check_convert(root, truth, tmp_path / "c")
    other = tmp_path / "other"
    save_levanter(other, 0, {"model": _model(3, delta=0.5)})
    check_diff_names_the_changed_leaf(root, other, "transformer/blocks/stacked/attn/c_attn/weight", 0.5)
    rc, out, err = run("diff", root, other, "--values", "--format", "json")
    assert {row["path"] for row in json.loads(out)["values"]} == set(truth), out  # one item: paths below it


def test_a_folder_with_metadata_json_of_another_writer_is_not_a_levanter_step(tmp_path):
    # The export's evidence is Levanter's metadata.json (`step`, `timestamp`) beside folders holding arrays: a
    # metadata.json of another shape beside a tree of arrays stays the structural reader's.
    model = _model(3)
    save_export(tmp_path / "tree" / "model", model)
    (tmp_path / "tree" / "metadata.json").write_text('{"name": "mine"}')
    from treetools.checkpoint_io.registry import claiming_format

    fmt = claiming_format(str(tmp_path / "tree"))
    assert fmt is None or fmt.name != "levanter", fmt
    (tmp_path / "tree" / "metadata.json").write_text('{"step": 0, "timestamp": "2026-01-01T00:00:00"}')  # Levanter's
    assert claiming_format(str(tmp_path / "tree")).name == "levanter"


def test_diff_values_between_two_steps_of_a_run_reports_step_and_training_key(run_dir):
    # Issue 49: between two steps of one run (`--step A --step B`, and the two step folders), `step` and
    # `training_key` are reported as changed with the model; the optimizer's count too.
    base, truth = run_dir
    for argv in ((base, "--step", 10, "--step", 20), (base / "step-10", base / "step-20")):
        rc, out, err = run("diff", *argv, "--values", "--format", "json")
        assert rc == 1, out + err
        rows = {row["path"]: row for row in json.loads(out)["values"]}
        differing = {p for p, row in rows.items() if not row["bit_identical"]}
        want = {f"{item}/{p}" for item in truth[10] for p in truth[10][item]
                if not np.array_equal(truth[10][item][p], truth[20][item][p])}
        assert differing == want and {"step/step", "training_key/training_key"} <= differing, differing
        assert rows["step/step"]["max_abs_diff"] == 10
