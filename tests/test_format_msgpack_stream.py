"""msgpack that is not one map (issue 37): EasyLM's streaming checkpoints and arrays of pairs.

EasyLM's ``StreamingCheckpointer`` (tests/_writers/easylm.py names the file and commit) writes the flattened
state dict as a stream of ``[key path, flax bytes]`` records: the params-only file (``streaming_params``) and
the whole train state (``streaming_train_state_<step>``), in bfloat16 and float32, as OpenLLaMA users have
them. The truth is the writer's own objects.
"""

from __future__ import annotations

import json

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
from flax.serialization import to_bytes

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf, check_inspect,
                                  check_load_parameters, check_restore, check_show, check_stats, check_verify,
                                  inspect_json, run, run_fresh, flat_arrays)
from tests._writers.easylm import save_all


def _train_state(dtype, step: int = 7, delta: float = 0.0) -> dict:
    """A flax TrainState as EasyLM's ``to_state_dict`` gives it: ``params`` is the variables dict."""
    rng = np.random.default_rng(step)
    params = {"params": {"transformer": {"wte": {"embedding": rng.standard_normal((8, 4)).astype(dtype)},
                                         "h": {"0": {"attention": {"wq": {"kernel": np.full((4, 4), 1.0 + delta, dtype)}}}},
                                         "ln_f": {"kernel": np.ones(4, dtype)}},
                         "lm_head": {"kernel": rng.standard_normal((4, 8)).astype(dtype)}}}
    like = lambda value: jax.tree.map(lambda x: np.full(x.shape, value, np.float32), params)  # noqa: E731
    opt_state = {"0": {"count": np.asarray(step, np.int32), "mu": like(0.0), "nu": like(0.5)}, "1": {}}
    return {"step": step, "params": params, "opt_state": opt_state}


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def easylm(request, tmp_path_factory):
    dtype = ml_dtypes.bfloat16 if request.param == "bfloat16" else np.float32
    folder = tmp_path_factory.mktemp(f"easylm_{request.param}")
    state = _train_state(dtype)
    whole = save_all(folder, state, save_optimizer_state=True, step=7)
    params = save_all(folder, state, save_optimizer_state=False)
    return whole, params, state


def test_params_file_every_command(easylm, tmp_path):
    _, path, state = easylm
    truth = flat_arrays(state["params"])
    report = check_inspect(path, truth)
    assert report["format"] == "msgpack-stream"
    rc, _, err = run("inspect", path)
    assert rc == 0 and "record stream" in err  # a note says which reader read it
    check_show(path, truth)
    check_stats(path, truth)
    check_verify(path)
    check_load_parameters(path, flat_arrays(state["params"]["params"]))  # the variables dict's `params`
    check_restore(path, truth, item="default")
    rules = tt.Rules(rename=[(r"/wte/", "/embed/")])
    check_restore(path, truth, item="default", rules=rules,
                  expect={k.replace("/wte/", "/embed/"): v for k, v in truth.items()})
    check_convert(path, flat_arrays(state["params"]["params"]), tmp_path)


def test_train_state_file_every_command(easylm, tmp_path):
    path, _, state = easylm
    # flatten_dict drops the empty optax node ("opt_state/1": {}), as EasyLM's stream never holds it.
    arrays = {k: v for k, v in flat_arrays(state).items() if k != "step"}
    leaves = {leaf["path"]: leaf for leaf in inspect_json(path)["checkpoints"][0]["items"]["default"]["leaves"]}
    assert set(leaves) == set(arrays) | {"step"}
    for name, want in arrays.items():
        assert leaves[name]["shape"] == list(want.shape) and leaves[name]["dtype"] == str(want.dtype), name
    rc, out, _ = run("inspect", path, "--show", "step", "--format", "json")
    assert rc == 0 and json.loads(out)["value"] == 7
    check_load_parameters(path, flat_arrays(state["params"]["params"]))  # params/params: the model's parameters
    check_load_parameters(path, flat_arrays(state["opt_state"]["0"]["mu"]), item="opt_state/0/mu")
    check_show(path, arrays)
    check_verify(path)
    other = tmp_path / "other"
    other.mkdir()
    changed = _train_state(np.float32 if leaves["params/params/lm_head/kernel"]["dtype"] == "float32"
                           else ml_dtypes.bfloat16, delta=0.5)
    check_diff_names_the_changed_leaf(
        path, save_all(other, changed, save_optimizer_state=True, step=7),
        "params/params/transformer/h/0/attention/wq/kernel", 0.5, args=("--exclude", "^step$"))  # `step`: a value


def test_array_of_pairs(tmp_path):
    path = tmp_path / "pairs.msgpack"
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    path.write_bytes(msgpack.packb([["dense/kernel", msgpack.ExtType(1, msgpack.packb(
        [list(w.shape), "float32", w.tobytes()]))], [["dense", "bias"], 1.5]]))
    assert tt.load_parameters(path)["dense"]["bias"] == 1.5
    np.testing.assert_array_equal(tt.load_parameters(path)["dense"]["kernel"], w)
    rc, _, err = run("inspect", path)
    assert rc == 0 and "array of 2 [key, value] pairs" in err


def test_a_corrupt_stream_is_one_error(easylm, tmp_path):
    path, _, _ = easylm
    cut = tmp_path / "streaming_train_state_cut"
    data = open(path, "rb").read()
    cut.write_bytes(data[:-7])
    rc, out, err = run("inspect", cut)
    assert rc == 1 and err.startswith("treetools: error:") and "truncated" in err


def test_metadata_imports_no_jax(easylm):
    path, _, _ = easylm
    done = run_fresh("inspect", path, forbid=["jax"])
    assert done.returncode == 0, done.stderr


def test_flax_maps_stay_the_msgpack_format(tmp_path):
    path = tmp_path / "state.msgpack"
    path.write_bytes(to_bytes({"params": {"w": np.ones(2, np.float32)}}))
    assert inspect_json(path)["format"] == "msgpack"
