import collections

import flax
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from treetools.pytree import paths

Pair = collections.namedtuple("Pair", ["left", "right"])


@flax.struct.dataclass
class Node:
    weight: jax.Array
    meta: str = flax.struct.field(pytree_node=False, default="x")


def test_path_strings_for_dicts_lists_attrs():
    tree = {"params": {"Dense_0": {"kernel": jnp.ones((2, 3))}}, "layers": [{"q": 1.0}, {"q": 2.0}]}
    assert list(paths.flatten(tree)) == ["layers/0/q", "layers/1/q", "params/Dense_0/kernel"]


def test_optax_state_paths():
    params = {"Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)}}
    state = optax.adamw(1e-3).init(params)
    keys = list(paths.flatten(state))
    # ScaleByAdamState(count, mu, nu), then EmptyState twice (no leaves).
    assert keys == ["0/count", "0/mu/Dense_0/bias", "0/mu/Dense_0/kernel", "0/nu/Dense_0/bias", "0/nu/Dense_0/kernel"]


def test_masked_state_has_no_masked_node_leaves():
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    state = optax.masked(optax.adam(1e-3), {"a": True, "b": False}).init(params)
    assert list(paths.flatten(state)) == ["inner_state/0/count", "inner_state/0/mu/a", "inner_state/0/nu/a"]


def test_boxes_are_leaves_never_value():
    boxed = nn.Partitioned(jnp.ones((4, 8)), names=(None, "model"))
    logical = nn.LogicallyPartitioned(jnp.ones(4), names=("embed",))
    var = nnx.Param(jnp.ones(3), out_sharding=("model",), eager_sharding=False)
    flat = paths.flatten({"k": boxed, "l": logical, "v": var})
    assert list(flat) == ["k", "l", "v"]
    assert flat["k"] is boxed and flat["v"] is var


def test_nnx_state_paths():
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    state = nnx.state(model, nnx.Param)
    assert sorted(paths.flatten(state)) == ["layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/kernel"]


def test_namedtuple_dataclass_frozendict_none():
    tree = {
        "pair": Pair(left=np.ones(1), right=None),
        "node": Node(weight=np.ones(2)),
        "frozen": flax.core.FrozenDict({"x": np.ones(3)}),
        "empty": {},
    }
    assert list(paths.flatten(tree)) == ["frozen/x", "node/weight", "pair/left"]


def test_unflatten_rebuilds_from_template():
    tree = {"a": [np.ones(1), np.zeros(2)], "b": Pair(np.ones(3), np.ones(4))}
    flat = paths.flatten(tree)
    doubled = paths.unflatten({k: v * 2 for k, v in flat.items()}, like=tree)
    assert isinstance(doubled["b"], Pair)
    np.testing.assert_array_equal(doubled["b"].right, np.ones(4) * 2)
    with pytest.raises(ValueError, match="missing"):
        paths.unflatten({"a/0": 1}, like=tree)


def test_duplicate_path_strings_are_an_error():
    with pytest.raises(ValueError, match="share the path"):
        paths.flatten({"a/b": np.ones(1), "a": {"b": np.ones(1)}})


def test_unflatten_dict():
    assert paths.unflatten_dict({"a/b": 1, "a/c": 2, "d": 3}) == {"a": {"b": 1, "c": 2}, "d": 3}


# Property: flatten/unflatten round-trips for random nested trees.
_keys = st.text(alphabet="abcdefgh_", min_size=1, max_size=4)
_arrays = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(lambda s: np.zeros(s, np.float32))
_trees = st.recursive(
    _arrays,
    lambda children: st.one_of(
        st.dictionaries(_keys, children, max_size=4),
        st.lists(children, max_size=4),
        st.tuples(children, children),
    ),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(_trees)
def test_flatten_unflatten_roundtrip(tree):
    flat = paths.flatten(tree)
    rebuilt = paths.unflatten(flat, like=tree)
    assert jax.tree.structure(rebuilt) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(tree)):
        assert a is b
    # Every path string is the keystr of its key path, re-joined.
    assert len(flat) == len(jax.tree.leaves(tree))
