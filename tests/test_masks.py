import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import treetools as tt
from tests import _models

LR, WD = 0.1, 0.5


def _zero_grads(params):
    return jax.tree.map(jnp.zeros_like, params)


def test_adamw_mask_decays_exactly_the_kernels_on_boxed_params():
    params = _models.BoxedMLP().init(jax.random.key(0), jnp.ones((1, 32)))["params"]
    tx = optax.adamw(LR, weight_decay=WD, mask=tt.get_param_mask_fn(exclude=[r"bias$", r"scale$"]))
    state = tx.init(params)
    updates, _ = tx.update(_zero_grads(params), state, params)
    # Zero grads: adam contributes 0/(0+eps)=0, so the update is -lr*wd*p where decayed, else 0.
    flat_u, flat_p = tt.flatten(updates), tt.flatten(params)
    assert all(isinstance(flat_u[p], nn.Partitioned) for p in flat_u)
    for path, p in flat_p.items():
        expected = -LR * WD * np.asarray(p.value) if path.endswith("kernel") else np.zeros(p.value.shape)
        np.testing.assert_allclose(np.asarray(flat_u[path].value), expected, rtol=1e-6, err_msg=path)


def test_mask_fn_with_add_decayed_weights_and_masked():
    params = {"dense": {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full((2,), 3.0)}}
    mask_fn = tt.get_param_mask_fn(exclude=[r"bias$"])
    decay = optax.add_decayed_weights(0.1, mask=mask_fn)
    upd, _ = decay.update(_zero_grads(params), decay.init(params), params)
    np.testing.assert_allclose(upd["dense"]["kernel"], 0.2)
    np.testing.assert_allclose(upd["dense"]["bias"], 0.0)
    tx = optax.masked(optax.sgd(1.0), mask_fn)
    upd, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    np.testing.assert_allclose(upd["dense"]["kernel"], -1.0)
    np.testing.assert_allclose(upd["dense"]["bias"], 1.0)  # masked out: passed through


def test_include_decays_only_matches():
    params = {"a": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}, "b": {"kernel": jnp.ones(2)}}
    assert tt.get_param_mask_fn(None, include=[r"^a/kernel$"])(params) == {
        "a": {"bias": False, "kernel": True}, "b": {"kernel": False}}
    assert tt.get_param_mask_fn([])(params) == {"a": {"bias": True, "kernel": True}, "b": {"kernel": True}}


def test_mask_errors():
    with pytest.raises(ValueError, match="not both"):
        tt.get_param_mask_fn([r"bias"], include=[r"kernel"])
    with pytest.raises(ValueError, match=r"`exclude` pattern 'biass\$' matches no leaf"):
        tt.get_param_mask_fn([r"biass$"])({"bias": jnp.ones(1), "kernel": jnp.ones(1)})
    with pytest.raises(ValueError, match="not a valid regex"):
        tt.get_param_mask_fn(["[unclosed"])


def test_multi_transform_freezes_exactly_the_labelled_subtree():
    params = _models.init_net()["params"]
    label_fn = tt.get_param_label_fn([(r"^embed/", "frozen"), (r"^blocks/", "train")], default="train")
    tx = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, label_fn)
    grads = jax.tree.map(lambda x: jnp.ones_like(x), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    for path, u in tt.flatten(updates).items():
        if path.startswith("embed/"):
            assert np.all(np.asarray(u) == 0.0), path
        else:
            assert np.all(np.asarray(u) != 0.0), path


def test_patterns_inside_nested_transforms_count_hidden_leaves():
    # Inside multi_transform, the "train" group's adamw gets params whose frozen leaves are
    # optax.MaskedNode: `bias$` then matches only hidden leaves. That is no typo and must not raise.
    params = {"frozen": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "head": {"kernel": jnp.full((2, 2), 2.0)}}
    label_fn = tt.get_param_label_fn([(r"^frozen/", "frozen")], default="train")
    train = optax.adamw(LR, weight_decay=WD, mask=tt.get_param_mask_fn(exclude=[r"bias$"]))
    tx = optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, label_fn)
    updates, _ = tx.update(_zero_grads(params), tx.init(params), params)
    np.testing.assert_allclose(updates["head"]["kernel"], -LR * WD * 2.0, rtol=1e-6)  # decayed: -lr*wd*p
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates["frozen"]))
    # A pattern that matches neither a visible nor a hidden leaf is still a typo.
    typo = optax.multi_transform(
        {"train": optax.adamw(LR, mask=tt.get_param_mask_fn(exclude=[r"biass$"])), "frozen": optax.set_to_zero()},
        label_fn)
    with pytest.raises(ValueError, match=r"`exclude` pattern 'biass\$' matches no leaf"):
        typo.init(params)
    # Same rule for labels under optax.masked: `bias$` matches only the leaves the mask hides.
    inner = optax.multi_transform({"a": optax.sgd(1.0), "b": optax.set_to_zero()},
                                  tt.get_param_label_fn([(r"bias$", "b")], default="a"))
    tx = optax.masked(inner, tt.get_param_mask_fn(None, include=[r"^head/"]))
    ones = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(ones, tx.init(params), params)
    np.testing.assert_allclose(updates["head"]["kernel"], -1.0)  # sgd(1.0) on a gradient of 1
    np.testing.assert_allclose(updates["frozen"]["bias"], 1.0)  # outside the mask: passed through


def test_mask_fn_under_inject_hyperparams():
    params = {"dense": {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.ones(2)}}
    mask_fn = tt.get_param_mask_fn(exclude=[r"bias$"])
    # inject_hyperparams calls a callable hyperparameter with the step count unless it is static:
    # say so, instead of "matches no leaf; nearby paths: ['']".
    wrong = optax.inject_hyperparams(optax.adamw)(learning_rate=LR, weight_decay=WD, mask=mask_fn)
    with pytest.raises(ValueError, match=r"got one bare array .*static_args=\('mask',\)"):
        wrong.init(params)
    tx = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(learning_rate=LR, weight_decay=WD, mask=mask_fn)
    updates, _ = jax.jit(tx.update)(_zero_grads(params), tx.init(params), params)
    np.testing.assert_allclose(updates["dense"]["kernel"], -LR * WD * 2.0, rtol=1e-6)
    np.testing.assert_allclose(updates["dense"]["bias"], 0.0)


def test_label_fn_first_match_wins_and_boxes_kept():
    params = _models.BoxedMLP().init(jax.random.key(0), jnp.ones((1, 32)))["params"]
    labels = tt.get_param_label_fn([(r"kernel", "k"), (r"^in/", "in")], default="rest")(params)
    flat = {p: box.value for p, box in tt.flatten(labels).items()}
    assert flat == {"in/bias": "in", "in/kernel": "k", "ln/bias": "rest", "ln/scale": "rest",
                    "out/bias": "rest", "out/kernel": "k"}
    with pytest.raises(ValueError, match=r"`rules` pattern 'nope' matches no leaf"):
        tt.get_param_label_fn([(r"nope", "x")])(params)


def test_label_fn_on_nnx_state_with_multi_transform():
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    params = nnx.state(model, nnx.Param)
    label_fn = tt.get_param_label_fn([(r"^layers/0/", "frozen")], default="train")
    tx = optax.multi_transform({"train": optax.sgd(1.0), "frozen": optax.set_to_zero()}, label_fn)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    flat = tt.flatten(updates)
    assert np.all(np.asarray(flat["layers/0/kernel"].get_value()) == 0)
    assert np.all(np.asarray(flat["layers/1/kernel"].get_value()) == -1)


def test_flattened_traversal_compat():
    params = {"Dense_0": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}}
    fn = tt.flattened_traversal(lambda path, _: "decay" if path[-1] == "kernel" else "no")
    assert fn(params) == {"Dense_0": {"bias": "no", "kernel": "decay"}}


_trees = st.recursive(
    st.just(np.ones(2)),
    lambda c: st.one_of(st.dictionaries(st.sampled_from(["kernel", "bias", "layer", "x"]), c, min_size=1, max_size=3),
                        st.lists(c, min_size=1, max_size=3)),
    max_leaves=12,
)


@settings(max_examples=50, deadline=None)
@given(_trees)
def test_mask_and_label_trees_have_params_structure(params):
    mask = tt.get_param_mask_fn([])(params)
    labels = tt.get_param_label_fn([], default="d")(params)
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    assert jax.tree.structure(labels) == jax.tree.structure(params)
    assert all(m is True for m in jax.tree.leaves(mask)) and set(jax.tree.leaves(labels)) <= {"d"}


def _llama_like():
    """A LLaMA-style block: no biases, RMSNorm scales."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.RMSNorm(name="norm")(x)
            return nn.Dense(8, use_bias=False, name="proj")(x)

    return Block().init(jax.random.key(0), jnp.ones((1, 8)))["params"]


def test_allow_unmatched_serves_models_with_and_without_biases():
    exclude = [r"bias$", r"scale$"]
    llama, boxed = _llama_like(), _models.BoxedMLP().init(jax.random.key(0), jnp.ones((1, 32)))["params"]
    with pytest.raises(ValueError, match=r"`exclude` pattern 'bias\$' matches no leaf.*allow_unmatched=True"):
        tt.get_param_mask_fn(exclude)(llama)  # strict stays the default
    mask_fn = tt.get_param_mask_fn(exclude, allow_unmatched=True)
    assert mask_fn(llama) == {"norm": {"scale": False}, "proj": {"kernel": True}}
    assert {p: m.value for p, m in tt.flatten(mask_fn(boxed)).items()} == {
        "in/bias": False, "in/kernel": True, "ln/bias": False, "ln/scale": False, "out/bias": False,
        "out/kernel": True}
    # The same optimizer config on both families.
    for params in (llama, boxed):
        tx = optax.adamw(LR, weight_decay=WD, mask=mask_fn)
        updates, _ = tx.update(_zero_grads(params), tx.init(params), params)
        for path, u in tt.flatten(tt.unbox_tree(updates)).items():
            p = tt.flatten(tt.unbox_tree(params))[path]
            want = -LR * WD * np.asarray(p) if path.endswith("kernel") else np.zeros(p.shape)
            np.testing.assert_allclose(np.asarray(u), want, rtol=1e-6, err_msg=path)
    # include= and typos in a permissive config: a pattern that matches nothing is just unused.
    assert tt.get_param_mask_fn(None, include=[r"kernel$", r"nope"], allow_unmatched=True)(llama) == {
        "norm": {"scale": False}, "proj": {"kernel": True}}


def test_label_fn_allow_unmatched():
    llama = _llama_like()
    rules = [(r"^embed/", "frozen"), (r"bias$", "no_decay")]
    with pytest.raises(ValueError, match=r"`rules` pattern '\^embed/' matches no leaf"):
        tt.get_param_label_fn(rules, default="train")(llama)
    label_fn = tt.get_param_label_fn(rules, default="train", allow_unmatched=True)
    assert label_fn(llama) == {"norm": {"scale": "train"}, "proj": {"kernel": "train"}}
    tx = optax.multi_transform({"train": optax.sgd(1.0), "frozen": optax.set_to_zero(),
                                "no_decay": optax.sgd(1.0)}, label_fn)
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, llama), tx.init(llama), llama)
    assert all(np.all(np.asarray(u) == -1.0) for u in jax.tree.leaves(updates))


def test_include_alone_as_the_readme_writes_it():
    # Issue 24, point 1: `get_param_mask_fn(include=[...])` raised TypeError (missing `exclude`).
    params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
    assert tt.get_param_mask_fn(include=[r"kernel$"])(params) == {"dense": {"bias": False, "kernel": True}}
    assert tt.get_param_mask_fn()(params) == {"dense": {"bias": True, "kernel": True}}  # neither: decay everything
