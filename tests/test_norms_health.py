"""Per-layer training health from ``norm_metrics`` (issue 40): update ratios, non-finite counts and largest |g|
per module and per scanned layer, and the optimizer's moments matched to their params by path.

Truth is numpy float64 on the host copies of the very trees passed in, and, for the moments, optax's own
state objects reached by hand (``state[0].mu``, ``state.inner_states["train"]...``), never through the
path matching under test.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from tests.test_norms import _program
from tests.test_norms_stacked import L, MESHES, _call, _host, _in_shard_map, _linen_params, _place, linen_sharded  # noqa: F401
from treetools.pytree.norms import norm_metrics
from treetools.pytree.partitioning import is_box, rebox, unbox
from treetools.pytree.paths import flatten, unflatten_dict

RTOL = 2e-6


def _sq64(x) -> float:
    return float(np.sum(np.asarray(x, np.float64) ** 2))


def _modules(host: dict[str, np.ndarray], depth: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in host:
        out.setdefault("/".join(path.split("/")[:depth]), []).append(path)
    return out


# --------------------------------------------------------------------------- #
# Per layer of a scanned model: every kind, under jit (Explicit, Auto) and inside shard_map
# --------------------------------------------------------------------------- #


def _like(tree, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda b: rebox(b, (scale * rng.normal(size=unbox(b).shape)).astype(np.float32)), tree,
                        is_leaf=is_box)


def _per_layer_expected(hosts: dict[str, dict[str, np.ndarray]]) -> dict[str, float]:
    """Every key of norm_metrics(depth=3, abs_max=True) on the scanned LM, by hand (float64): the layer index is
    the third part of `decoder/layers/<i>/...` (the depth rule of split_within)."""
    want: dict[str, float] = {}

    def groups(host):
        out = {}
        for path, v in host.items():
            if path.startswith("decoder/layers/"):
                for i in range(L):
                    out.setdefault(f"decoder/layers/{i}", []).append(v[i])
            else:
                out.setdefault("/".join(path.split("/")[:3]), []).append(v)
        return out

    for kind, host in hosts.items():
        want[kind] = np.sqrt(sum(_sq64(v) for v in host.values()))
        for name, parts in groups(host).items():
            want[f"{kind}/{name}"] = np.sqrt(sum(_sq64(v) for v in parts))
            if kind == "grad_norm":
                want[f"grad_abs_max/{name}"] = max(float(np.max(np.abs(v))) for v in parts)
                want[f"nonfinite_grads/{name}"] = 0
    want["grad_abs_max"] = max(float(np.max(np.abs(v))) for v in hosts["grad_norm"].values())
    want["nonfinite_grads"] = 0
    want["update_ratio"] = want["update_norm"] / want["param_norm"]
    for name in groups(hosts["param_norm"]):
        want[f"update_ratio/{name}"] = want[f"update_norm/{name}"] / want[f"param_norm/{name}"]
    return want


def _health_inputs(params):
    grads, updates = _like(params, 1), _like(params, 2, 1e-3)
    state = optax.adam(1e-3).init(params)  # the moments keep the params' boxes (optax maps through them)
    state = (state[0]._replace(mu=_like(params, 3, 0.1), nu=_like(params, 4, 0.01)), *state[1:])
    hosts = {"grad_norm": _host(grads), "param_norm": _host(params), "update_norm": _host(updates),
             "mu_norm": _host(state[0].mu), "nu_norm": _host(state[0].nu)}
    return {"g": grads, "p": params, "u": updates, "s": state}, hosts


def _health(t):
    return norm_metrics(grads=t["g"], params=t["p"], updates=t["u"], opt_state=t["s"], depth=3, abs_max=True)


def _check(m, want):
    assert set(m) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(float(m[key]), value, rtol=RTOL, err_msg=key)
    assert all(m[k].dtype == jnp.int32 for k in m if k.startswith("nonfinite_grads"))


def test_per_layer_health_on_a_scanned_model_matches_float64():
    trees, hosts = _health_inputs(_linen_params())
    want = _per_layer_expected(hosts)
    assert "mu_norm/decoder/layers/3" in want and "update_ratio/decoder/layers/0" in want
    _check(jax.jit(_health)(trees), want)
    _check(_health(trees), want)  # eagerly: one compiled program per kind


def test_per_layer_health_sharded_under_jit_and_inside_shard_map(linen_sharded):
    mesh, placed, _, _ = linen_sharded
    trees, hosts = _health_inputs(placed)
    trees = {k: _place(v, mesh) if k != "s" else v for k, v in trees.items()}
    trees["s"] = (trees["s"][0]._replace(mu=_place(trees["s"][0].mu, mesh), nu=_place(trees["s"][0].nu, mesh)),
                  *trees["s"][1:])
    want = _per_layer_expected(hosts)
    _check(_call(jax.jit(_health), trees), want)  # Explicit or Auto axes, per the fixture
    _check(_in_shard_map(_health, mesh, trees), want)  # local shards of boxes: psum over their axes


def test_per_param_gives_the_same_kinds_per_leaf():
    g, p, u = ({"a": {"w": np.full((2, 3), s, np.float32), "b": np.arange(3, dtype=np.float32) * s}} for s in (1, 2, 3))
    m = norm_metrics(grads=g, params=p, updates=u, per_param=True, abs_max=True)
    for path in ("a/w", "a/b"):
        hg, hp, hu = (flatten(t)[path] for t in (g, p, u))
        np.testing.assert_allclose(float(m[f"update_ratio/{path}"]), np.sqrt(_sq64(hu) / _sq64(hp)), rtol=RTOL)
        np.testing.assert_allclose(float(m[f"grad_abs_max/{path}"]), np.max(np.abs(hg)), rtol=RTOL)
        assert int(m[f"nonfinite_grads/{path}"]) == 0
    assert "grad_abs_max" not in norm_metrics(grads=g)  # opt-in: one more reduction of each gradient


def test_nonfinite_and_abs_max_name_the_module_holding_them():
    host = {"embed": np.ones((4, 3), np.float32), "layers_0/w": np.ones((3, 3), np.float32),
            "layers_1/w": np.full((3, 3), -5.0, np.float32), "layers_1/b": np.ones(3, np.float32)}
    host["layers_0/w"][1, 2] = np.nan
    host["layers_0/w"][0, 0] = np.inf
    m = jax.jit(lambda t: norm_metrics(grads=t, depth=1, abs_max=True))(unflatten_dict(host))
    assert {k: int(v) for k, v in m.items() if k.startswith("nonfinite_grads")} == {
        "nonfinite_grads": 2, "nonfinite_grads/embed": 0, "nonfinite_grads/layers_0": 2, "nonfinite_grads/layers_1": 0}
    # A NaN reads as +inf in the max (a cross-device max would drop it); the count tells NaN from Inf.
    assert float(m["grad_abs_max/layers_0"]) == np.inf and float(m["grad_abs_max/layers_1"]) == 5.0
    assert float(m["grad_abs_max/embed"]) == 1.0 and float(m["grad_abs_max"]) == np.inf


def test_a_nan_in_one_leaf_inside_shard_map_is_counted_in_its_module(devices):
    # jax#25643/#26796: where a NaN is, is lost inside shard_map. Here each device holds a slice of the boxes;
    # the count per module is psum-ed over the box's axes, so it names the module on every device.
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices, axis_types=(jax.sharding.AxisType.Explicit,))
    host = {"attn/q": np.ones((16, 4), np.float32), "mlp/up": np.ones((16, 8), np.float32)}
    host["mlp/up"][13, 5] = np.nan  # on device 6 of 8
    boxed = jax.tree.map(lambda x: nn.Partitioned(jax.device_put(x, jax.NamedSharding(mesh, P("fsdp"))),
                                                  names=("fsdp", None)), unflatten_dict(host))
    specs = jax.tree.map(lambda b: P("fsdp"), boxed, is_leaf=is_box)
    fn = jax.shard_map(lambda t: norm_metrics(grads=t, depth=1, abs_max=True), mesh=mesh, in_specs=(specs,),
                       out_specs=P())
    m = _call(jax.jit(fn), boxed)
    assert int(m["nonfinite_grads/mlp"]) == 1 and int(m["nonfinite_grads/attn"]) == 0
    assert np.isnan(float(m["grad_norm/mlp"])) and float(m["grad_norm/attn"]) == 8.0  # sqrt(64 ones), global
    assert float(m["grad_abs_max/attn"]) == 1.0 and float(m["grad_abs_max/mlp"]) == np.inf  # a NaN: never hidden


# --------------------------------------------------------------------------- #
# Optimizer moments of every optax state, matched by path
# --------------------------------------------------------------------------- #


def _params():
    rng = np.random.default_rng(0)
    shapes = {"embed/table": (12, 6), "layers_0/w": (6, 8), "layers_0/b": (8,), "head/w": (8, 5)}
    return unflatten_dict({k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()})


LABELS = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
    lambda path, _: "frozen" if path[0].key == "embed" else "train", p)

# name -> (optimizer, {"mu_norm"/"nu_norm": how to reach optax's own moment tree in its state})
OPTIMIZERS = {
    "adamw": (optax.adamw(1e-2), {"mu_norm": lambda s: s[0].mu, "nu_norm": lambda s: s[0].nu}),
    "lion": (optax.lion(1e-3), {"mu_norm": lambda s: s[0].mu}),
    "sgd-momentum": (optax.sgd(1e-2, momentum=0.9), {"mu_norm": lambda s: s[0].trace}),
    "rmsprop": (optax.rmsprop(1e-2), {"nu_norm": lambda s: s[0].nu}),
    "amsgrad": (optax.amsgrad(1e-2), {"mu_norm": lambda s: s[0].mu, "nu_norm": lambda s: s[0].nu}),
    "chain-clip-masked-adam": (
        optax.chain(optax.clip_by_global_norm(1.0), optax.masked(optax.adam(1e-2), lambda p: jax.tree.map(
            lambda x: x.ndim == 2, p))),
        {"mu_norm": lambda s: s[1].inner_state[0].mu, "nu_norm": lambda s: s[1].inner_state[0].nu}),
    "multi_transform-frozen-embed": (
        optax.multi_transform({"train": optax.adamw(1e-2), "frozen": optax.set_to_zero()}, LABELS),
        {"mu_norm": lambda s: s.inner_states["train"].inner_state[0].mu,
         "nu_norm": lambda s: s.inner_states["train"].inner_state[0].nu}),
    "inject_hyperparams-adam": (optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
                                {"mu_norm": lambda s: s.inner_state[0].mu, "nu_norm": lambda s: s.inner_state[0].nu}),
}


def _trained(tx, params, steps=2):
    state = tx.init(params)
    for seed in range(steps):
        grads = _like(params, 10 + seed)
        _, state = tx.update(grads, state, params)
    return state


def _leaves64(tree) -> dict[str, np.ndarray]:
    """Leaves of an optax moment tree, masked-out ones (MaskedNode) dropped."""
    return {p: np.asarray(v, np.float64) for p, v in flatten(tree).items()}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_moments_of_optax_states_per_module(name):
    tx, reach = OPTIMIZERS[name]
    params = _params()
    state = _trained(tx, params)
    m = jax.jit(lambda p, s: norm_metrics(params=p, opt_state=s, depth=1))(params, state)
    assert {k for k in m if k.split("/")[0] in ("mu_norm", "nu_norm") and "/" not in k} == set(reach)
    for kind, get in reach.items():
        host = _leaves64(get(state))
        if name.startswith("multi_transform"):
            assert not any(p.startswith("embed/") for p in host)  # frozen: no moment, so no key
        if name.startswith("chain"):
            assert "layers_0/b" not in host  # masked out (1-D): optax keeps a MaskedNode there
        np.testing.assert_allclose(float(m[kind]), np.sqrt(sum(_sq64(v) for v in host.values())), rtol=RTOL)
        modules = _modules(host, 1)
        assert {k for k in m if k.startswith(kind + "/")} == {f"{kind}/{mod}" for mod in modules}
        for mod, paths in modules.items():
            np.testing.assert_allclose(float(m[f"{kind}/{mod}"]), np.sqrt(sum(_sq64(host[p]) for p in paths)),
                                       rtol=RTOL, err_msg=f"{kind}/{mod}")


def test_moments_per_param_and_with_boxes():
    params = jax.tree.map(lambda x: nn.Partitioned(x, names=(None,) * x.ndim), _params())
    state = _trained(optax.adam(1e-2), params)
    m = norm_metrics(params=params, opt_state=state, per_param=True)
    mu = {p: np.asarray(unbox(v), np.float64) for p, v in flatten(state[0].mu).items()}
    assert {k for k in m if k.startswith("mu_norm/")} == {f"mu_norm/{p}" for p in mu}  # no `/value`: boxes are leaves
    for path, v in mu.items():
        np.testing.assert_allclose(float(m[f"mu_norm/{path}"]), np.sqrt(_sq64(v)), rtol=RTOL)


def _adafactor_estimate(v_row: np.ndarray, v_col: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Adafactor's second-moment estimate of a 2-D param: the outer product of its factors.

    optax factors the largest axis ``d0`` and the other one ``d1``: ``v_row`` (indexed along ``d1``) is the
    mean of g^2 over ``d0``, ``v_col`` (along ``d0``) the mean over ``d1``; it scales the update by
    ``(v_row / mean(v_row)) ** -0.5 * v_col ** -0.5``, each broadcast along its own axis.
    """
    rows = v_row / v_row.mean()
    return np.outer(v_col, rows) if shape[0] > shape[1] else np.outer(rows, v_col)


def test_adafactor_second_moment_is_the_estimate_optax_divides_by():
    params = _params()
    tx = optax.scale_by_factored_rms(min_dim_size_to_factor=4)  # (12, 6), (6, 8), (8, 5) factored; (8,) not
    state = _trained(tx, params, steps=3)
    grads = _like(params, 42)
    updates, _ = tx.update(grads, state, params)
    next_state = tx.update(grads, state, params)[1]
    rows, cols, full = (flatten(getattr(next_state, f)) for f in ("v_row", "v_col", "v"))
    want = {}
    for path, g in flatten(grads).items():
        g = np.asarray(g, np.float64)
        if g.ndim == 2:
            est = _adafactor_estimate(np.asarray(rows[path], np.float64), np.asarray(cols[path], np.float64), g.shape)
            # The estimate is what optax divides by: its own update is g / sqrt(estimate).
            np.testing.assert_allclose(np.asarray(flatten(updates)[path]), g / np.sqrt(est), rtol=1e-4)
        else:
            est = np.asarray(full[path], np.float64)
        want[path] = est
    m = jax.jit(lambda p, s: norm_metrics(params=p, opt_state=s, per_param=True))(params, next_state)
    assert "mu_norm" not in m
    np.testing.assert_allclose(float(m["nu_norm"]), np.sqrt(sum(_sq64(v) for v in want.values())), rtol=1e-5)
    for path, est in want.items():
        np.testing.assert_allclose(float(m[f"nu_norm/{path}"]), np.sqrt(_sq64(est)), rtol=1e-5, err_msg=path)


def test_adafactor_needs_the_params_shapes():
    params = _params()
    state = optax.adafactor(1e-2, min_dim_size_to_factor=4).init(params)
    with pytest.raises(ValueError, match=r"Adafactor state `0`.*`embed/table`.*pass the params"):
        norm_metrics(opt_state=state)
    m = norm_metrics(grads=params, opt_state=state)  # any tree of the params' shapes will do
    assert float(m["nu_norm"]) == 0.0  # a fresh state
    with pytest.raises(ValueError, match=r"fit no factoring"):
        norm_metrics(params=jax.tree.map(lambda x: jnp.ones((3, 3)), params), opt_state=state)


# --------------------------------------------------------------------------- #
# The compiled program: one more sibling reduction per gradient for abs_max, no conditional on accelerators
# --------------------------------------------------------------------------- #


def test_health_program_on_accelerators_reads_each_array_in_sibling_reductions():
    shapes = {"embed": (512, 64), "attn/q": (64, 64), "mlp/wi": (64, 256), "mlp/bi": (256,)}
    tree = lambda dtype=jnp.float32: unflatten_dict({k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()})  # noqa: E731
    g, p, u = tree(), tree(jnp.bfloat16), tree()
    state = jax.eval_shape(optax.adam(1e-3).init, p)
    n = len(shapes)
    fn = lambda t: norm_metrics(grads=t[0], params=t[1], updates=t[2], opt_state=t[3], depth=1, abs_max=True)  # noqa: E731
    reductions, conditionals = _program(fn, (g, p, u, state), "cuda")
    assert conditionals == []
    for red in reductions[:n]:  # grads: squares, count, largest |g|, over the same axes
        assert sorted(name for name, _, _ in red) == ["reduce_max", "reduce_sum", "reduce_sum"]
        assert len({axes for _, axes, _ in red}) == 1
    # params, updates, the step count (no reduction), mu, nu: one reduction of each array
    counts = [len(r) for r in reductions[n:]]
    assert counts == [1] * (2 * n) + [0] + [1] * (2 * n)
    # On CPU the count stays behind the lazy branch; the largest |g| is a second read there.
    reductions, conditionals = _program(fn, (g, p, u, state), "cpu")
    assert conditionals == ["cond"]
    assert [[inside for _, _, inside in red] for red in reductions[:n]] == [[False, False, True]] * n
