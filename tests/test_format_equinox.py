"""Equinox ``eqx.tree_serialise_leaves`` files (issue 29), written by equinox itself (the ``test-formats`` extra).

An ``.eqx`` file is the model's array leaves as consecutive ``.npy`` streams, in jax's flatten order
(equinox/_serialisation.py at patrick-kidger/equinox commit 9336d820b2ef66b360fc6cb3611b3da5cefbb14d:
``default_serialise_filter_spec`` saves each array-like leaf with ``np.save``/``jnp.save`` and nothing for
other leaves). The names live only in the user's model, so without it the leaves are listed by index (`0`,
`1`, ...) with shape, dtype, statistics and values; ``load_parameters(path, target=model)`` names them, as
``eqx.tree_deserialise_leaves(path, like)`` does. The truth is the model's own arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf, check_refused,
                                  check_single_file, run, run_fresh)

eqx = pytest.importorskip("equinox")
jax = pytest.importorskip("jax")
jnp = jax.numpy


class Model(eqx.Module):
    """An MLP (arrays and non-array leaves: its activation functions), a bf16 array and an int32 counter."""

    mlp: eqx.nn.MLP
    scale: jax.Array
    count: jax.Array

    def __init__(self, key, bump: float = 0.0):
        self.mlp = eqx.nn.MLP(3, 2, 4, 1, key=key)
        self.scale = ((jnp.arange(6).reshape(2, 3) - 2) / 4 + bump).astype(jnp.bfloat16)  # exact in bf16
        self.count = jnp.asarray(7, jnp.int32)


def _truth(model) -> dict[str, np.ndarray]:
    """Index -> array, in the order equinox writes them (array-like leaves of jax's flatten)."""
    arrays = [x for x in jax.tree_util.tree_leaves(model) if eqx.is_array_like(x)]
    return {str(i): np.asarray(x) for i, x in enumerate(arrays)}


def write_eqx(path):
    """``eqx.tree_serialise_leaves(path, model)``; returns (path, model, truth)."""
    model = Model(jax.random.PRNGKey(0))
    eqx.tree_serialise_leaves(path, model)
    return path, model, _truth(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return write_eqx(tmp_path_factory.mktemp("eqx") / "model.eqx")


def test_leaves_by_index_with_shape_dtype_stats_and_values(saved, tmp_path):
    path, model, truth = saved
    assert len(truth) == 6 and str(truth["4"].dtype) == "bfloat16"  # 2 x (weight, bias), scale, count
    check_single_file(path, truth, tmp_path, "equinox")


def test_convert(saved, tmp_path):
    path, model, truth = saved
    check_convert(path, truth, tmp_path)


def test_load_parameters_with_the_model_names_the_leaves(saved):
    path, model, truth = saved
    like = Model(jax.random.PRNGKey(1))  # same structure, other values: the skeleton
    loaded = tt.load_parameters(path, target=like)
    assert type(loaded) is Model
    got = [x for x in jax.tree_util.tree_leaves(loaded) if eqx.is_array_like(x)]
    assert len(got) == len(truth)
    for value, want in zip(got, truth.values()):
        assert value.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(value), want)
    # An abstract skeleton (eqx.filter_eval_shape) works the same way and allocates nothing first.
    abstract = eqx.filter_eval_shape(Model, jax.random.PRNGKey(2))
    loaded = tt.load_parameters(path, target=abstract)
    np.testing.assert_array_equal(np.asarray(loaded.mlp.layers[0].weight), np.asarray(model.mlp.layers[0].weight))
    # equinox's own reader agrees with treetools'
    ref = eqx.tree_deserialise_leaves(path, like)
    np.testing.assert_array_equal(np.asarray(ref.scale), np.asarray(loaded.scale))


def test_a_skeleton_that_does_not_match_is_refused(saved):
    path, model, truth = saved
    wrong = eqx.nn.MLP(3, 2, 5, 1, key=jax.random.PRNGKey(0))  # width 5, not 4
    with pytest.raises(tt.CheckpointMismatchError):
        tt.load_parameters(path, target=wrong)


def test_diff_names_the_leaf_that_changed(saved, tmp_path):
    path, model, truth = saved
    other = tmp_path / "other.eqx"
    eqx.tree_serialise_leaves(other, Model(jax.random.PRNGKey(0), bump=0.5))
    check_diff_names_the_changed_leaf(path, other, "4", 0.5)


def test_a_truncated_file_is_one_error_naming_equinox(saved, tmp_path):
    path, model, truth = saved
    cut = tmp_path / "cut.eqx"
    cut.write_bytes(path.read_bytes()[:-10])
    line = check_refused(cut, "Equinox")
    assert "msgpack" not in line
    # verify reports the damage as its problem (stdout, exit 1), as for every format whose header is damaged
    rc, out, err = run("verify", cut)
    assert rc == 1 and "Equinox" in out and "truncated" in out and "msgpack" not in out, out + err


def test_metadata_does_not_import_jax(saved):
    path, _, _ = saved
    done = run_fresh("inspect", "--stats", path, forbid=["jax"])
    assert done.returncode == 0, done.stderr


def test_restore_with_rules_by_the_models_names(saved):
    # The positional leaves take the model's names first; the rules then speak of those names (`scale`).
    path, model, truth = saved
    like = eqx.filter_eval_shape(Model, jax.random.PRNGKey(3))
    like = eqx.tree_at(lambda m: m.scale, like, jax.ShapeDtypeStruct((2, 3), jnp.float32))
    loaded = tt.load_parameters(path, target=like, rules=tt.Rules(cast={r"^scale$": "float32"}))
    assert loaded.scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded.scale), truth["4"].astype(np.float32))
    restored = tt.restore_checkpoint(path, None, {"default": like}, rules=tt.Rules(cast={r"^scale$": "float32"}))
    np.testing.assert_array_equal(np.asarray(restored["default"].mlp.layers[1].bias), truth["3"])
