"""jax's own pytree serialization (issue 37): ``pytree_serialization.save`` writes ``pytreedef.json`` and an
OCDBT ``array_store/``; read as its own format (never called an Orbax older than 0.5), by every command, with
the leaves named by their key paths. Written by jax itself (its structure encoding needs ``flatbuffers``, in the
``test-formats`` extra; skipped without it). The truth is the tree saved.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf, check_inspect,
                                  check_load_parameters, check_restore, check_show, check_stats, check_verify,
                                  run, run_fresh, flat_arrays)

pytest.importorskip("flatbuffers")


def _state(delta: float = 0.0) -> dict:
    rng = np.random.default_rng(0)
    return {"params": {"dense": {"kernel": (rng.standard_normal((3, 4)) + delta).astype(np.float32),
                                 "bias": np.zeros(4, ml_dtypes.bfloat16)},
                       "blocks": [{"w": np.ones((2, 2), np.float32)}, {"w": np.full((2, 2), 2.0, np.float32)}]},
            "opt_state": (np.asarray(3, np.int32), None), "step": np.asarray(11, np.int32)}


def save(path, state) -> None:
    from jax.experimental.array_serialization import pytree_serialization

    pytree_serialization.save(jax.tree.map(jnp.asarray, state), str(path), overwrite=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("jaxpytree") / "ckpt"
    state = _state()
    save(path, state)
    return path, state


def test_every_command(saved, tmp_path):
    path, state = saved
    truth = flat_arrays(state)
    report = check_inspect(path, truth)
    assert report["format"] == "jax-pytree" and report["steps"] is None
    check_show(path, truth)
    check_stats(path, truth)
    check_verify(path)
    params = flat_arrays(state["params"])
    check_load_parameters(path, params)
    check_restore(path, truth, item="default")
    check_convert(path, params, tmp_path)
    other = tmp_path / "other"
    save(other, _state(delta=0.5))
    check_diff_names_the_changed_leaf(path, other, "params/dense/kernel", 0.5)
    # jax's own load gives the same arrays.
    from jax.experimental.array_serialization import pytree_serialization

    theirs = pytree_serialization.load(str(path), jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    for name, value in flat_arrays(theirs).items():
        np.testing.assert_array_equal(tt.flatten(tt.load_parameters(path, item="default"))[name], value)


def test_the_array_store_is_no_old_orbax_item(saved):
    path, state = saved
    rc, out, err = run("inspect", path / "array_store")
    assert rc == 0, err
    assert "older than 0.5" not in err and "array store of the jax pytree checkpoint" in err
    check_inspect(path / "array_store", flat_arrays(state))


def test_metadata_imports_no_jax(saved):
    path, _ = saved
    done = run_fresh("inspect", path, forbid=["jax"])
    assert done.returncode == 0, done.stderr


def test_a_corrupt_structure_is_one_error(saved, tmp_path):
    import json
    import shutil

    path, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    raw = json.loads((copy / "pytreedef.json").read_text())
    raw["__jax_pytreedef_repr"] = raw["__jax_pytreedef_repr"][:12]
    (copy / "pytreedef.json").write_text(json.dumps(raw))
    rc, out, err = run("inspect", copy)
    assert rc == 1 and err.startswith("treetools: error:") and "__jax_pytreedef_repr" in err, err
