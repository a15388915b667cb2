"""Folders of TensorStore arrays without a marker file, read by their structure (issue 37): the zarr-tree reader.

Writers: big_vision's ``save_checkpoint_ts`` (tests/_writers/big_vision.py: ``~``-joined names, ``-LAST``
pointer, ``-tmp`` steps); jax's own ``serialization.async_serialize`` writing one folder per leaf named with
``.`` in ``checkpoint_<N>/`` folders (as paxml and older T5X did); Levanter's ``tree_serialize_leaves_tensorstore``
export without ``metadata.json`` (tests/_writers/levanter.py); TensorStore itself writing zarr3 and N5 arrays in
nested folders. The truth is the writer's arrays.
"""

from __future__ import annotations

import asyncio
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf, check_inspect,
                                  check_load_parameters, check_restore, check_show, check_stats, check_verify,
                                  inspect_json, run, run_fresh, flat_arrays)
from tests._writers.big_vision import save_checkpoint_ts
from tests._writers.levanter import save_export, trainer_state


def _checkpoint(step: int, delta: float = 0.0) -> dict:
    """big_vision's train checkpoint: params, opt state, step counter (``chrono``)."""
    rng = np.random.default_rng(step)
    params = {"head": {"kernel": rng.standard_normal((4, 3)).astype(np.float32) + delta,
                       "bias": np.zeros(3, np.float32) + step},
              "embedding": {"kernel": rng.standard_normal((2, 2, 3, 4)).astype(ml_dtypes.bfloat16)}}
    return {"params": params, "opt": {"count": np.asarray(step, np.int32)}}


def write_big_vision(workdir, steps=(100, 200, 300), *, delta: float = 0.0) -> dict[int, dict]:
    """Steps saved as big_vision saves them (every step but the last temporary); returns {step: checkpoint}."""
    truth = {}
    for i, step in enumerate(steps):
        truth[step] = _checkpoint(step, delta)
        save_checkpoint_ts(os.path.join(workdir, "checkpoint.bv"), truth[step], step, keep=(i != len(steps) - 1))
    return truth


@pytest.fixture(scope="module")
def big_vision(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("bv")
    truth = write_big_vision(workdir)
    # A save in progress (preempted before its commit callback): a step folder the pointer does not name yet.
    os.makedirs(workdir / "checkpoint.bv-000000400" / "params~head~bias")
    return workdir, truth


def test_big_vision_steps_follow_the_last_pointer(big_vision):
    workdir, truth = big_vision
    # 100 and 200 are kept, 300 is `-tmp` (the latest, kept until the next save deletes it), 400 is in progress.
    assert (workdir / "checkpoint.bv-LAST").read_text() == "000000300-tmp"
    rc, out, err = run("inspect", workdir)
    assert rc == 0, err
    assert "structural zarr-tree reader" in err  # a note says which reader read it
    report = inspect_json(workdir)
    assert report["format"] == "zarr-tree"
    assert report["steps"] == [100, 200, 300] and report["incomplete"] == ["checkpoint.bv-000000400"]
    assert report["checkpoints"][0]["step"] == 300
    check_inspect(workdir, flat_arrays(truth[300]))  # names: `~` read as `/`
    check_inspect(workdir, flat_arrays(truth[100]), args=("--step", 100))


def test_big_vision_every_command(big_vision, tmp_path):
    workdir, truth = big_vision
    params = flat_arrays(truth[300]["params"])
    check_show(workdir, flat_arrays(truth[300]))
    check_stats(workdir, flat_arrays(truth[200]), args=("--step", 200))
    check_load_parameters(workdir, params)  # the params subtree, as big_vision's load_checkpoint_ts + ["params"]
    check_load_parameters(workdir / "checkpoint.bv-000000100", flat_arrays(truth[100]["params"]))
    check_restore(workdir, flat_arrays(truth[300]), item="default")
    rules = tt.Rules(rename=[(r"^params/head/", "params/classifier/")])
    renamed = {k.replace("params/head/", "params/classifier/"): v for k, v in flat_arrays(truth[300]).items()}
    check_restore(workdir, flat_arrays(truth[300]), item="default", rules=rules, expect=renamed)
    check_convert(workdir, params, tmp_path)
    out = check_verify(workdir, "--step", "all")
    assert out.count("ok:") == 3, out
    other = tmp_path / "other"
    write_big_vision(other, delta=0.25)
    check_diff_names_the_changed_leaf(workdir, other, "params/head/kernel", 0.25)


def _async_serialize(path: str, value) -> None:
    """jax's own per-array writer, as paxml and T5X called it (``get_tensorstore_spec`` of a folder)."""
    from jax.experimental.array_serialization import serialization

    spec = serialization.get_tensorstore_spec(path)
    asyncio.run(serialization.async_serialize(jnp.asarray(value), spec))


def test_jax_async_serialize_per_leaf_folders_in_checkpoint_steps(tmp_path):
    root = tmp_path / "model_dir"
    truth = {}
    for step in (10, 20):
        state = {"target": {"decoder": {"layers_0": {"kernel": np.full((3, 2), step, np.float32)}},
                            "token_embedder": {"embedding": np.arange(8, dtype=np.float32).reshape(4, 2)}},
                 "state": {"step": np.asarray(step, np.int32)}}
        for name, value in tt.flatten(state).items():  # folder names join the path with `.` (T5X's tensorstore names)
            _async_serialize(str(root / f"checkpoint_{step}" / name.replace("/", ".")), value)
        truth[step] = state
    report = check_inspect(root, flat_arrays(truth[20]))
    assert report["format"] == "zarr-tree" and report["steps"] == [10, 20]
    check_show(root, flat_arrays(truth[10]), args=("--step", 10))
    check_load_parameters(root, flat_arrays(truth[20]["target"]))  # T5X's `target`
    check_verify(root)
    rc, out, err = run("diff", root, "--step", 10, "--step", 20, "--values", "--format", "json")
    assert rc == 1 and "state/step" in out


def test_levanter_export_without_metadata(tmp_path):
    rng = np.random.default_rng(0)
    model = {"transformer": {"h": {"0": {"w": rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16)}}},
             "embeddings": {"weight": rng.standard_normal((5, 4)).astype(np.float32)}}
    state = trainer_state(30, model, ({"mu": {"embeddings": {"weight": np.zeros((5, 4), np.float32)}}},), seed=3)
    export = save_export(tmp_path / "export", state)
    truth = flat_arrays(state)
    report = check_inspect(export, truth)
    assert report["format"] == "zarr-tree" and report["steps"] is None
    check_load_parameters(export, flat_arrays(model))  # Levanter's `model`, beside step/opt_state/training_key
    check_stats(export, truth)
    check_restore(export, truth, item="default")
    check_verify(export)


def test_zarr3_and_n5_arrays_in_nested_folders(tmp_path):
    top = tmp_path / "tree"
    arrays = {"encoder/w": np.arange(12, dtype=np.float32).reshape(3, 4), "decoder/b": np.arange(5, dtype=np.int64)}
    for (name, value), driver in zip(arrays.items(), ("zarr3", "n5")):
        store = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": str(top / name)}},
                        create=True, dtype=value.dtype.name, shape=value.shape).result()
        store.write(value).result()
    # A zarr3 group (zarr.json of node_type group) is a folder, not an array.
    (top / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    check_inspect(top, arrays)
    check_show(top, arrays)
    check_verify(top)


def test_never_claims_another_formats_checkpoint(tmp_path):
    # An Orbax step (zarr arrays under _METADATA-holding items) is Orbax's; a folder above an Orbax root gets
    # "did you mean", not a zarr tree.
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "work" / "checkpoints")
    tt.save_checkpoint(mngr, 1, {"params": {"w": jnp.ones(2)}}, wait=True)
    mngr.close()
    assert inspect_json(tmp_path / "work" / "checkpoints")["format"] == "orbax"
    rc, out, err = run("inspect", tmp_path / "work")
    assert rc == 1 and "did you mean" in err and "zarr-tree" not in err.split("Readable")[0]


def test_metadata_imports_no_jax(big_vision):
    workdir, _ = big_vision
    done = run_fresh("inspect", workdir, forbid=["jax"])
    assert done.returncode == 0, done.stderr
