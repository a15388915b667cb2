"""EasyDeL checkpoints (issue 29), written as EasyDeL's ``save_pretrained`` and trainer write them through eformer
(tests/_writers/easydel.py names the files and commits).

A ``save_pretrained`` folder (``config.json``, ``tensorstore_index.json``, ``model_structure.json``, arrays
under ``model/``) is one checkpoint; a trainer's save folder holds ``run-<step>/`` folders, each committed
when its ``metadata.json`` is there (EasyDeL writes it last). The items are the prefixes the
``tensorstore_index.json`` lists: ``model`` (the parameters, what ``load_parameters`` returns) and ``tx``
(the optimizer state); leaf paths are the index paths below the prefix. The pickled treedef in
``*_structure.json`` is never unpickled. The truth is the writer's own arrays.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections import namedtuple

import ml_dtypes
import numpy as np
import pytest

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf,
                                  check_inspect, check_load_parameters, check_refused, check_restore, check_show,
                                  check_stats, check_verify, inspect_json, run, run_fresh, flat_arrays)
from tests._writers.easydel import save_pretrained, save_run

ScaleByAdamState = namedtuple("ScaleByAdamState", ["count", "mu", "nu"])


def _params(step: int, delta: float = 0.0) -> dict:
    """An nnx CausalLM's pure params dict: list indices are int keys."""
    rng = np.random.default_rng(step)
    return {"model": {"embed_tokens": {"embedding": rng.standard_normal((9, 4)).astype(ml_dtypes.bfloat16)},
                      "layers": {0: {"self_attn": {"q_proj": {
                          "kernel": rng.standard_normal((4, 4)).astype(np.float32) + delta}}},
                                 1: {"self_attn": {"q_proj": {
                                     "kernel": rng.standard_normal((4, 4)).astype(np.float32)}}}}},
            "lm_head": {"kernel": (np.arange(36).reshape(4, 9) + step).astype(np.float32)}}


def _opt_state(params: dict, step: int):
    def like(tree, scale):
        return {k: like(v, scale) if isinstance(v, dict) else (np.ones(v.shape) * scale).astype(v.dtype)
                for k, v in tree.items()}

    return (ScaleByAdamState(np.asarray(step, np.int32), like(params, 0.5), like(params, 0.25)), ())


def write_trainer_run(save_dir, steps=(5, 10), *, delta: float = 0.0, unfinished: int | None = 15) -> dict:
    truth = {}
    for step in steps:
        params = _params(step, delta)
        opt_state = _opt_state(params, step)
        save_run(save_dir, step, params, opt_state)
        truth[step] = {"model": flat_arrays(params), "tx": flat_arrays(opt_state)}
    if unfinished is not None:
        params = _params(unfinished)
        save_run(save_dir, unfinished, params, _opt_state(params, unfinished), finish=False)
    return truth


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("easydel") / "llama-tiny"
    params = _params(1)
    save_pretrained(folder, params)
    return folder, flat_arrays(params)


@pytest.fixture(scope="module")
def trainer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("easydel") / "outputs"
    return folder, write_trainer_run(folder)


def test_save_pretrained_folder_every_command(pretrained, tmp_path):
    folder, truth = pretrained
    report = check_inspect(folder, truth, item="model")
    assert report["format"] == "easydel"
    assert report["steps"] is None  # one checkpoint, no steps (as a safetensors file)
    assert list(report["checkpoints"][0]["items"]) == ["model"]
    check_stats(folder, truth, item="model")
    check_show(folder, truth, item="model")
    check_load_parameters(folder, truth)  # the bf16 embedding stays bf16
    out = check_verify(folder)
    want = sum(v.nbytes for v in truth.values())
    assert f"{want:,} bytes read and decoded" in out, out
    check_restore(folder, truth, item="model")


def test_save_pretrained_folder_convert(pretrained, tmp_path):
    folder, truth = pretrained
    check_convert(folder, truth, tmp_path, item="model")


def test_the_index_is_checked_against_the_arrays(pretrained, tmp_path):
    folder, truth = pretrained
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "tensorstore_index.json").read_text())
    index["prefixes"]["model"][0]["shape"] = [99, 99]  # the index disagrees with the zarr metadata
    (copy / "tensorstore_index.json").write_text(json.dumps(index))
    check_refused(copy, "tensorstore_index.json", index["prefixes"]["model"][0]["path"][len("model/"):])


def test_the_pickled_treedef_is_never_unpickled(pretrained, tmp_path, monkeypatch):
    folder, truth = pretrained

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled a checkpoint file")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    check_inspect(folder, truth, item="model")
    check_load_parameters(folder, truth)


def test_trainer_run_folders_steps_and_the_unfinished_one(trainer_dir):
    folder, truth = trainer_dir
    report = inspect_json(folder)
    assert report["format"] == "easydel"
    assert report["steps"] == [5, 10]
    assert report["incomplete"] == ["run-15"]
    assert list(report["checkpoints"][0]["items"]) == ["model", "tx"]  # the params first
    check_inspect(folder, truth[10]["model"], item="model")
    check_inspect(folder, truth[10]["tx"], item="tx")
    check_inspect(folder, truth[5]["tx"], item="tx", args=("--step", 5))
    check_inspect(folder / "run-5", truth[5]["model"], item="model")  # one run folder directly
    check_refused(folder / "run-15", "incomplete")
    with pytest.raises(tt.CheckpointNotFoundError, match="step 15 is an incomplete save"):
        tt.load_parameters(folder, step=15)


def test_trainer_run_every_command(trainer_dir, tmp_path):
    folder, truth = trainer_dir
    check_show(folder, truth[10]["model"], item="model")
    check_stats(folder, truth[5]["tx"], item="tx", args=("--step", 5))
    check_load_parameters(folder, truth[10]["model"])
    check_load_parameters(folder, truth[5]["tx"], step=5, item="tx")
    out = check_verify(folder, "--step", "all")
    assert out.count("ok:") == 2, out
    check_restore(folder, truth[5]["model"], item="model", step=5)
    other = tmp_path / "other"
    write_trainer_run(other, delta=0.25, unfinished=None)
    check_diff_names_the_changed_leaf(folder, other, "model/layers/0/self_attn/q_proj/kernel", 0.25, item="model")


def test_trainer_run_restore_with_rules(trainer_dir):
    folder, truth = trainer_dir
    rules = tt.Rules(rename=[(r"^lm_head/", "head/")])
    renamed = {k.replace("lm_head/", "head/", 1): v for k, v in truth[10]["model"].items()}
    check_restore(folder, truth[10]["model"], item="model", rules=rules, expect=renamed)


def test_trainer_run_convert(trainer_dir, tmp_path):
    folder, truth = trainer_dir
    check_convert(folder, truth[10]["model"], tmp_path, item="model")


def test_jax_is_not_imported_for_metadata(trainer_dir):
    folder, _ = trainer_dir
    done = run_fresh("inspect", "--stats", folder, forbid=["jax"])
    assert done.returncode == 0, done.stderr


def test_optimizer_arrays_the_index_does_not_list_are_read(trainer_dir, tmp_path):
    # Issue 37: a trainer run's optimizer state was read in part. Arrays stored under a prefix folder that the
    # index does not list (its `tx` entries rewritten by a later save), or a prefix folder the index lost, are read
    # from their zarr headers, every one of them, with a note.
    save_dir, truth = trainer_dir
    copy = tmp_path / "run-10"
    shutil.copytree(save_dir / "run-10", copy)
    index = json.loads((copy / "tensorstore_index.json").read_text())
    tx = index["prefixes"]["tx"]
    index["prefixes"]["tx"] = tx[:1]  # the index keeps one of the optimizer's arrays
    (copy / "tensorstore_index.json").write_text(json.dumps(index))
    check_inspect(copy, truth[10]["tx"], item="tx")
    rc, out, err = run("inspect", copy, "--item", "tx")
    assert rc == 0 and f"{len(tx) - 1} array(s) under `tx/` are not in the index" in err, err
    check_load_parameters(copy, truth[10]["tx"], item="tx")
    del index["prefixes"]["tx"]  # the index lost the prefix entirely: `tx/` is still an item
    (copy / "tensorstore_index.json").write_text(json.dumps(index))
    assert set(inspect_json(copy)["checkpoints"][0]["items"]) == {"model", "tx"}
    check_inspect(copy, truth[10]["tx"], item="tx")
    check_verify(copy)


def test_an_nnx_optimizer_state_drops_value_as_its_params_do(tmp_path):
    # Issue 49: EasyDeL saves `optax.init` of the model's nnx state under `tx`; its moments are nnx variables,
    # whose key paths end in `.value` (`tx/0/mu/.../kernel/value`), while the params beside them are a pure dict.
    # A path never ends in `/value`: the moments are named as their params are.
    import jax
    import optax
    from flax import nnx

    from tests._writers._tree import flat_with_names

    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    opt_state = optax.adam(1e-3).init(state)
    stored = flat_with_names(opt_state, sep="/")
    assert any(name.endswith("/value") for name in stored), list(stored)  # as the writer names them
    params = jax.tree.map(np.asarray, state.to_pure_dict())
    folder = save_run(tmp_path / "out", 7, params, opt_state)
    tx = {name.removesuffix("/value"): np.asarray(v) for name, v in stored.items()}
    assert set(tx) == {"0/count", "0/mu/bias", "0/mu/kernel", "0/nu/bias", "0/nu/kernel"}
    for path in (folder, tmp_path / "out"):
        check_inspect(path, tx, item="tx")
        check_inspect(path, flat_arrays(params), item="model")
    check_show(folder, tx, item="tx")
    check_stats(folder, tx, item="tx")
    check_load_parameters(folder, tx, item="tx")
    check_load_parameters(folder, flat_arrays(params))
    check_restore(folder, tx, item="tx")
    rules = tt.Rules(rename=[(r"^0/mu/", "0/first_moment/")])
    check_restore(folder, tx, item="tx", rules=rules, expect={k.replace("0/mu/", "0/first_moment/"): v for k, v in tx.items()})
    check_verify(folder)
    check_convert(folder, tx, tmp_path / "c", item="tx")
    other = save_run(tmp_path / "other", 7, params, jax.tree.map(lambda x: x + 1 if x.dtype == np.int32 else x, opt_state))
    rc, out, err = run("diff", folder, other, "--values", "--item", "tx", "--format", "json")
    differing = [row["path"] for row in json.loads(out)["values"] if not row["bit_identical"]]
    assert rc == 1 and differing == ["0/count"], differing
    paths = [leaf["path"] for item in inspect_json(folder)["checkpoints"][0]["items"].values() for leaf in item["leaves"]]
    assert not [p for p in paths if p.endswith("/value")], paths


def test_the_index_file_given_as_path_reads_its_folder(pretrained, tmp_path):
    # Issue 49: `tensorstore_index.json` given as PATH (as `model.safetensors.index.json` may be) reads the
    # checkpoint it indexes, with every command.
    folder, truth = pretrained
    index = folder / "tensorstore_index.json"
    report = check_inspect(index, truth, item="model")
    assert report["format"] == "easydel" and report["path"] == str(index)
    check_stats(index, truth, item="model")
    check_show(index, truth, item="model")
    check_verify(index)
    check_load_parameters(index, truth)
    rules = tt.Rules(rename=[(r"^lm_head/", "head/")])
    check_restore(index, truth, item="model", rules=rules,
                  expect={k.replace("lm_head/", "head/", 1): v for k, v in truth.items()})
    check_convert(index, truth, tmp_path, item="model")
    rc, out, err = run("diff", index, folder, "--values")
    assert rc == 0, out + err
