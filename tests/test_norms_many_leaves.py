"""Norms of trees with more leaves than ``treetools.pytree.sums._CHAIN``: the totals combined by halving a stack
of them on CPU (issue 48: XLA:CPU's compile of a chain of adds grows faster than its length), checked against
numpy float64, under jit, inside ``shard_map``, with NaN/Inf, stacked leaves and gradients."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from treetools.pytree import sums
from treetools.pytree.norms import norm_metrics
from treetools.pytree.partitioning import is_box, leaf_sharding
from treetools.pytree.paths import unflatten_dict

RTOL = 2e-6  # float32 accumulation vs float64
MODULES, PER_MODULE = 4, 6  # 24 leaves, and 24 + 1 terms in the global total: well above _CHAIN


def _sq64(x: np.ndarray) -> float:
    return float(np.sum(np.asarray(x, dtype=np.float64) ** 2))


def _nonfinite(x: np.ndarray) -> int:
    return int(np.sum(~np.isfinite(np.asarray(x))))


def _host(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"m{m}/w{i}": (rng.normal(size=(8, 2 + i)) * (m + i + 1)).astype(np.float32)
            for m in range(MODULES) for i in range(PER_MODULE)}


def test_there_are_more_values_than_the_chain_takes():
    assert MODULES * PER_MODULE > sums._CHAIN and PER_MODULE <= sums._CHAIN < MODULES * PER_MODULE


@pytest.mark.parametrize("bad", [{}, {"m1/w2": (3, np.nan), "m3/w0": (0, np.inf), "m3/w5": (7, -np.inf)}],
                         ids=["finite", "nonfinite"])
def test_global_group_and_leaf_values_match_float64(bad):
    g, p = _host(0), _host(1)
    for path, (flat_index, value) in bad.items():
        g[path].reshape(-1)[flat_index] = value
    fn = jax.jit(lambda g, p, **kw: norm_metrics(grads=g, params=p, abs_max=True, **kw),
                 static_argnames=("depth", "per_param"))
    by_module = fn(unflatten_dict(g), unflatten_dict(p), depth=1)
    by_leaf = fn(unflatten_dict(g), unflatten_dict(p), per_param=True)
    groups = {f"m{m}": [k for k in g if k.startswith(f"m{m}/")] for m in range(MODULES)}
    groups |= {k: [k] for k in g}
    for m in (by_module, by_leaf):
        np.testing.assert_allclose(float(m["grad_norm"]), np.sqrt(sum(_sq64(v) for v in g.values())), rtol=RTOL)
        np.testing.assert_allclose(float(m["param_norm"]), np.sqrt(sum(_sq64(v) for v in p.values())), rtol=RTOL)
        assert m["nonfinite_grads"].dtype == jnp.int32 and int(m["nonfinite_grads"]) == len(bad)
        largest = max(float(np.max(np.where(np.isnan(v), np.inf, np.abs(v)))) for v in g.values())
        assert float(m["grad_abs_max"]) == largest  # +inf where a gradient is NaN or Inf
        names = {k.split("/", 1)[1] for k in m if k.startswith("param_norm/")}
        assert names == ({f"m{i}" for i in range(MODULES)} if m is by_module else set(g))
        for name in names:
            members = groups[name]
            np.testing.assert_allclose(float(m[f"param_norm/{name}"]), np.sqrt(sum(_sq64(p[k]) for k in members)),
                                       rtol=RTOL, err_msg=name)
            expected = np.sqrt(sum(_sq64(g[k]) for k in members))
            np.testing.assert_allclose(float(m[f"grad_norm/{name}"]), expected, rtol=RTOL, err_msg=name)
            assert int(m[f"nonfinite_grads/{name}"]) == sum(_nonfinite(g[k]) for k in members), name
            peak = max(float(np.max(np.where(np.isnan(g[k]), np.inf, np.abs(g[k])))) for k in members)
            assert float(m[f"grad_abs_max/{name}"]) == peak, name


def test_one_group_of_every_leaf():
    # depth=1 on a tree under one module: one group holding all 24 leaves, combined by halving too.
    g = _host(2)
    m = jax.jit(lambda t: norm_metrics(grads={"model": t}, depth=1))(unflatten_dict(g))
    expected = np.sqrt(sum(_sq64(v) for v in g.values()))
    np.testing.assert_allclose(float(m["grad_norm/model"]), expected, rtol=RTOL)
    np.testing.assert_allclose(float(m["grad_norm"]), expected, rtol=RTOL)


def test_stacked_leaves_per_layer():
    # 12 stacked leaves of 3 layers: each layer's group combines 12 per-layer vectors (more than _CHAIN).
    rng = np.random.default_rng(3)
    g = {f"layers/w{i}": rng.normal(size=(3, 4, 1 + i)).astype(np.float32) for i in range(12)}
    m = jax.jit(lambda t: norm_metrics(grads=t, depth=2, stacked={"layers": 0}))(unflatten_dict(g))
    for layer in range(3):
        expected = np.sqrt(sum(_sq64(v[layer]) for v in g.values()))
        np.testing.assert_allclose(float(m[f"grad_norm/layers/{layer}"]), expected, rtol=RTOL, err_msg=str(layer))
    np.testing.assert_allclose(float(m["grad_norm"]), np.sqrt(sum(_sq64(v) for v in g.values())), rtol=RTOL)


def _spec(box: nn.Partitioned) -> P:
    info = leaf_sharding(box)
    assert info is not None
    return info.spec


def test_inside_shard_map_equals_jit(devices):
    # Sharded and replicated boxes side by side: the stacked totals mix values that vary over the mesh axis
    # with values that do not.
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices)
    host = _host(4)
    host = {k: np.tile(v, (1, 8)) if i % 2 else v for i, (k, v) in enumerate(host.items())}  # odd ones split
    specs = {k: (None, "fsdp") if i % 2 else (None, None) for i, k in enumerate(host)}
    glob = {k: jax.device_put(v, NamedSharding(mesh, P(*specs[k]))) for k, v in host.items()}
    boxed = unflatten_dict({k: nn.Partitioned(glob[k], names=specs[k]) for k in host})
    in_specs = jax.tree.map(_spec, boxed, is_leaf=is_box)

    def fn(t):
        return norm_metrics(grads=t, depth=1, abs_max=True)

    inside = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(in_specs,), out_specs=P()))(boxed)
    outside = jax.jit(fn)(unflatten_dict(glob))
    for m in (inside, outside):
        np.testing.assert_allclose(float(m["grad_norm"]), np.sqrt(sum(_sq64(v) for v in host.values())), rtol=RTOL)
        for mod in range(MODULES):
            members = [v for k, v in host.items() if k.startswith(f"m{mod}/")]
            np.testing.assert_allclose(float(m[f"grad_norm/m{mod}"]), np.sqrt(sum(_sq64(v) for v in members)),
                                       rtol=RTOL)
            assert float(m[f"grad_abs_max/m{mod}"]) == max(float(np.max(np.abs(v))) for v in members)
        assert int(m["nonfinite_grads"]) == 0


def test_gradient_through_the_halved_total():
    host = _host(5)
    tree = {k: jnp.asarray(v) for k, v in host.items()}
    total = np.sqrt(sum(_sq64(v) for v in host.values()))
    grads = jax.jit(jax.grad(lambda t: norm_metrics(grads=t)["grad_norm"]))(tree)
    for k, v in tree.items():
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(v, np.float64) / total, rtol=1e-5, atol=1e-7)


def test_cpu_halves_a_stack_accelerators_keep_the_chain():
    # What is handed to XLA: on CPU the 24 leaf sums (and the 24 counts, in the lazy branch) are stacked and
    # halved (log2 of 25 vector adds each), not added in a chain of 24; for a GPU the chain is kept.
    g = unflatten_dict({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _host(6).items()})
    fn = jax.jit(lambda t: norm_metrics(grads=t))
    n = MODULES * PER_MODULE
    cpu = jax.export.export(fn, platforms=["cpu"])(g).mlir_module()
    cuda = jax.export.export(fn, platforms=["cuda"])(g).mlir_module()
    adds = re.compile(r"= stablehlo\.add ")
    assert "stablehlo.concatenate" in cpu and len(adds.findall(cpu)) <= 2 * 5
    assert "stablehlo.concatenate" not in cuda and len(adds.findall(cuda)) == 2 * n
