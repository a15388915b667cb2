"""Sharded norms across layouts: the one-psum-per-axis-set path (``_known_layout`` / ``_sharded_norms_*``) and its fallbacks.

Every number is checked against numpy float64 on the gathered arrays. A spy on
``treetools.pytree.sums._sharded_norms_kernel`` / ``_sharded_norms_body`` records
whether the new path ran, so each case states which path it exercises.
"""

from __future__ import annotations

import collections
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import treetools.pytree.sums as tn
from treetools.pytree.norms import clip_by_global_norm, get_sharded_global_norm, norm_metrics

RTOL = 2e-6
EXPLICIT_MESHES = {"8": ((8,), ("x",)), "2x4": ((2, 4), ("a", "b")), "4x2": ((4, 2), ("a", "b"))}


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def _n64(*arrays) -> float:
    """float64 L2 norm of the concatenation of ``arrays`` (gathered to host)."""
    return float(np.sqrt(sum(np.sum(np.asarray(a, np.float64) ** 2) for a in arrays)))


def _close(actual, expected) -> None:
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=RTOL)


@pytest.fixture
def spy(monkeypatch):
    """List of spec tuples, one per call of the new shard_map path (jitted eagerly, inline when traced)."""
    calls: list[tuple] = []

    def spying(real):
        def wrapper(*args, **kwargs):
            calls.append(kwargs["specs"])
            return real(*args, **kwargs)

        return wrapper

    for name in ("_sharded_norms_kernel", "_sharded_norms_body"):
        monkeypatch.setattr(tn, name, spying(getattr(tn, name)))
    return calls


def _mesh(name: str, devices, kind=AxisType.Explicit):
    shape, axes = EXPLICIT_MESHES[name]
    return jax.make_mesh(shape, axes, devices=devices, axis_types=(kind,) * len(axes))


def _layout(name: str) -> dict[str, tuple[tuple[int, ...], P]]:
    if name == "8":
        return {
            "w": ((4, 16), P(None, "x")),
            "e": ((16, 3), P("x", None)),
            "s": ((5,), P()),
            "z": ((), P()),
        }
    return {
        "w": ((4, 8), P(None, "b")),
        "q": ((8, 3), P("a", None)),
        "e": ((16, 2), P(("a", "b"))),
        "f": ((8, 8), P("a", "b")),  # fully sharded, 2-D
        "r": ((8, 8), P("b", "a")),  # axes in the other order
        "s": ((5,), P()),
        "z": ((), P()),
    }


def _tree(mesh, layout, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    host = {k: (rng.normal(size=shape) * (i + 1)).astype(dtype) for i, (k, (shape, _)) in enumerate(layout.items())}
    glob = {k: jax.device_put(host[k], NamedSharding(mesh, spec)) for k, (_, spec) in layout.items()}
    return host, glob


# --------------------------------------------------------------------------- #
# plain correctness on Explicit meshes: eager and jit, global and per-leaf
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("mesh_name", list(EXPLICIT_MESHES))
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_explicit_meshes_exact(mesh_name, mode, devices, spy):
    mesh = _mesh(mesh_name, devices)
    host, glob = _tree(mesh, _layout(mesh_name))
    fn = lambda t: norm_metrics(grads=t, params=t, updates=t, per_param=True)  # noqa: E731
    m = (jax.jit(fn) if mode == "jit" else fn)(glob)
    assert spy, "the shard_map path should run on all-NamedSharding / all-Explicit leaves"
    total = _n64(*host.values())
    _close(m["grad_norm"], total)
    _close(m["param_norm"], total)
    _close(m["update_ratio"], 1.0)
    assert int(m["nonfinite_grads"]) == 0
    for k, v in host.items():
        _close(m[f"grad_norm/{k}"], _n64(v))
    g, per = get_sharded_global_norm(glob)
    _close(g, total)
    for k, v in host.items():
        _close(per[k], _n64(v))


def test_auto_mesh_under_jit_takes_plain_path_and_eager_takes_new(devices, spy):
    mesh = _mesh("2x4", devices, AxisType.Auto)
    host, glob = _tree(mesh, _layout("2x4"))
    _close(jax.jit(lambda t: get_sharded_global_norm(t)[0])(glob), _n64(*host.values()))
    assert not spy  # Auto axes under jit: the compiler's path
    _close(get_sharded_global_norm(glob)[0], _n64(*host.values()))
    assert spy  # eager NamedSharding: the shard_map path


# --------------------------------------------------------------------------- #
# autodiff
# --------------------------------------------------------------------------- #


def test_grad_under_jit_is_x_over_norm_and_keeps_shardings(devices, spy):
    mesh = _mesh("2x4", devices)
    host, glob = _tree(mesh, _layout("2x4"))
    grads = jax.jit(jax.grad(lambda t: get_sharded_global_norm(t)[0]))(glob)
    assert spy
    total = _n64(*host.values())
    for k, v in host.items():
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(v, np.float64) / total, rtol=1e-5, atol=1e-7)
        assert grads[k].sharding.is_equivalent_to(glob[k].sharding, v.ndim), k


def test_value_and_grad_of_loss_with_norm_penalty(devices, spy):
    # loss = sum(c * w) + 0.5 * ||t||^2  ->  d/dw = c + w, d/dother = other
    mesh = _mesh("4x2", devices)
    host, glob = _tree(mesh, _layout("4x2"))
    c = np.random.default_rng(7).normal(size=host["w"].shape).astype(np.float32)
    cs = jax.device_put(c, glob["w"].sharding)

    def loss(t, c):
        return jnp.sum(c * t["w"]) + 0.5 * norm_metrics(params=t)["param_norm"] ** 2

    val, grads = jax.jit(jax.value_and_grad(loss))(glob, cs)
    assert spy
    expected = float(np.sum(c.astype(np.float64) * host["w"])) + 0.5 * _n64(*host.values()) ** 2
    np.testing.assert_allclose(float(val), expected, rtol=1e-5)
    for k, v in host.items():
        want = v.astype(np.float64) + (c if k == "w" else 0.0)
        np.testing.assert_allclose(np.asarray(grads[k]), want, rtol=1e-5, atol=1e-5)


def test_eager_grad_under_set_mesh(devices, spy):
    # Eager jax.grad on Explicit arrays needs the mesh in context (a jax rule);
    # with it, the traced (JVP) leaves carry their specs and take the new path.
    mesh = _mesh("2x4", devices)
    host, glob = _tree(mesh, _layout("2x4"))
    with jax.set_mesh(mesh):
        grads = jax.grad(lambda t: get_sharded_global_norm(t)[0])(glob)
    assert spy
    total = _n64(*host.values())
    for k, v in host.items():
        np.testing.assert_allclose(np.asarray(grads[k]), v / total, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- #
# vmap: per-example norms
# --------------------------------------------------------------------------- #

VMAP_SPECS = {
    "features": P(None, None, "b"),
    "batch+features": P("a", None, "b"),
    "rows+cols": P(None, "a", "b"),
    "batch": P("a"),
}


@pytest.mark.parametrize("spec_name", list(VMAP_SPECS))
def test_vmap_per_example_norms(spec_name, devices, spy):
    mesh = _mesh("2x4", devices)
    hb = np.random.default_rng(3).normal(size=(4, 8, 8)).astype(np.float32)
    xb = jax.device_put(hb, NamedSharding(mesh, VMAP_SPECS[spec_name]))
    expected = np.sqrt((hb.astype(np.float64) ** 2).sum(axis=(1, 2)))
    eager = jax.vmap(lambda x: get_sharded_global_norm({"x": x})[0])(xb)
    jitted = jax.jit(jax.vmap(lambda x: norm_metrics(grads={"x": x}, per_param=True)))(xb)
    _close(eager, expected)
    _close(jitted["grad_norm"], expected)
    _close(jitted["grad_norm/x"], expected)
    np.testing.assert_array_equal(np.asarray(jitted["nonfinite_grads"]), np.zeros(4))
    # The per-example type is split only when a non-batch dim is sharded.
    assert bool(spy) == (spec_name != "batch")


def test_vmap_per_example_grads(devices, spy):
    # DP-SGD style: per-example grads of a sharded weight, then their norms.
    mesh = _mesh("2x4", devices)
    rng = np.random.default_rng(4)
    hw, hx = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(4, 8)).astype(np.float32)
    w = jax.device_put(hw, NamedSharding(mesh, P(None, "b")))
    x = jax.device_put(hx, NamedSharding(mesh, P("a")))

    def per_example(w, x):
        g = jax.vmap(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))), in_axes=(None, 0))(w, x)
        return jax.vmap(lambda g: norm_metrics(grads={"w": g})["grad_norm"])(g)

    out = jax.jit(per_example)(w, x)
    assert spy
    x64, w64 = hx.astype(np.float64), hw.astype(np.float64)
    expected = [_n64(np.outer(x64[i], 1 - np.tanh(x64[i] @ w64) ** 2)) for i in range(4)]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5)


@pytest.mark.parametrize("spec_name", ["features", "batch"])
def test_vmap_with_python_scalar_leaf(spec_name, devices):
    mesh = _mesh("2x4", devices)
    hb = np.random.default_rng(3).normal(size=(4, 8, 8)).astype(np.float32)
    xb = jax.device_put(hb, NamedSharding(mesh, VMAP_SPECS[spec_name]))
    out = jax.jit(jax.vmap(lambda x: norm_metrics(grads={"x": x, "scale": 2.0})["grad_norm"]))(xb)
    _close(out, np.sqrt((hb.astype(np.float64) ** 2).sum(axis=(1, 2)) + 4.0))


# --------------------------------------------------------------------------- #
# mixed trees
# --------------------------------------------------------------------------- #

Pair = collections.namedtuple("Pair", ["left", "right"])


def test_mixed_leaf_kinds_eager_and_jit(devices, spy):
    mesh = _mesh("2x4", devices)
    rng = np.random.default_rng(5)
    hw = rng.normal(size=(4, 8)).astype(np.float32)
    hn = rng.normal(size=(3,)).astype(np.float32)
    tree = {
        "w": jax.device_put(hw, NamedSharding(mesh, P(None, "b"))),
        "py_float": 1.5,
        "py_int": 3,
        "np": hn,
        "zero_d": jnp.asarray(2.0),
        "none": None,
        "empty": {},
        "pair": Pair(jnp.arange(4, dtype=jnp.int32), jnp.full((2,), 0.5, jnp.bfloat16)),
    }
    expected = _n64(hw, 1.5, 3, hn, 2.0, np.arange(4), [0.5, 0.5])
    _close(norm_metrics(grads=tree)["grad_norm"], expected)
    _close(get_sharded_global_norm(tree)[0], expected)
    m = jax.jit(lambda t: norm_metrics(grads=t, per_param=True))(tree)
    _close(m["grad_norm"], expected)
    _close(m["grad_norm/pair/left"], _n64(np.arange(4)))
    _close(m["grad_norm/py_int"], 3.0)
    assert int(m["nonfinite_grads"]) == 0


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_all_sharded_dtypes_and_empty_arrays(mode, devices, spy):
    # Every leaf on the mesh, so the new path runs with ints, halves, 0-d and empty arrays.
    mesh = _mesh("8", devices)
    rng = np.random.default_rng(6)
    host = {
        "f16_big": (rng.uniform(300, 600, size=(16,)) * rng.choice([-1, 1], size=16)).astype(np.float16),
        "bf16": rng.normal(size=(8, 4)).astype(jnp.bfloat16),
        "i32": rng.integers(-50, 50, size=(8, 2)).astype(np.int32),
        "empty_rows": np.zeros((0, 8), np.float32),
        "empty_cols": np.zeros((8, 0), np.float32),
        "zero_d": np.float32(-7.0),
        "bool": np.array([True, False] * 8),
    }
    specs = {"f16_big": P("x"), "bf16": P("x", None), "i32": P("x"), "empty_rows": P(None, "x"),
             "empty_cols": P("x", None), "zero_d": P(), "bool": P("x")}
    tree = {k: jax.device_put(host[k], NamedSharding(mesh, specs[k])) for k in host}
    fn = lambda t: norm_metrics(grads=t, per_param=True)  # noqa: E731
    m = (jax.jit(fn) if mode == "jit" else fn)(tree)
    assert spy
    _close(m["grad_norm"], _n64(*host.values()))
    for k, v in host.items():
        _close(m[f"grad_norm/{k}"], _n64(v))
    assert np.isfinite(float(m["grad_norm/f16_big"]))  # no fp16 overflow for |x| > 256
    assert int(m["nonfinite_grads"]) == 0


# --------------------------------------------------------------------------- #
# NaN / Inf
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_nonfinite_counted_once_per_element(mode, devices, spy):
    mesh = _mesh("2x4", devices)
    rng = np.random.default_rng(8)
    host = {
        "split": rng.normal(size=(4, 8)).astype(np.float32),  # P(None, 'b'): replicated over 'a'
        "rep": rng.normal(size=(5,)).astype(np.float32),  # P(): on all 8 devices
        "inf_only": rng.normal(size=(8, 4)).astype(np.float32),  # P(('a','b'))
        "clean": rng.normal(size=(8, 8)).astype(np.float32),  # P('a','b')
        "a_only": rng.normal(size=(4, 3)).astype(np.float32),  # P('a'): replicated over 'b'
    }
    host["split"][1, 2] = np.nan
    host["split"][3, 7] = np.inf
    host["rep"][4] = np.nan
    host["inf_only"][0, 0] = np.inf
    host["inf_only"][7, 3] = -np.inf
    host["a_only"][2, 1] = np.nan
    specs = {"split": P(None, "b"), "rep": P(), "inf_only": P(("a", "b")), "clean": P("a", "b"), "a_only": P("a")}
    tree = {k: jax.device_put(host[k], NamedSharding(mesh, specs[k])) for k in host}
    fn = lambda t: norm_metrics(grads=t, per_param=True)  # noqa: E731
    m = (jax.jit(fn) if mode == "jit" else fn)(tree)
    assert spy
    assert int(m["nonfinite_grads"]) == sum(int(np.sum(~np.isfinite(v))) for v in host.values()) == 6
    assert np.isnan(float(m["grad_norm"]))
    assert np.isnan(float(m["grad_norm/split"])) and np.isnan(float(m["grad_norm/rep"]))
    assert np.isnan(float(m["grad_norm/a_only"]))
    assert np.isposinf(float(m["grad_norm/inf_only"]))
    _close(m["grad_norm/clean"], _n64(host["clean"]))


# --------------------------------------------------------------------------- #
# clip
# --------------------------------------------------------------------------- #


def test_clip_by_global_norm_under_jit(devices, spy):
    mesh = _mesh("4x2", devices)
    host, glob = _tree(mesh, _layout("4x2"))
    total = _n64(*host.values())
    tx = clip_by_global_norm(total / 3)
    clipped, _ = jax.jit(tx.update)(glob, tx.init(glob))
    assert spy
    _close(get_sharded_global_norm(clipped)[0], total / 3)
    for k, v in host.items():
        assert clipped[k].sharding.is_equivalent_to(glob[k].sharding, v.ndim), k
        np.testing.assert_allclose(np.asarray(clipped[k]), v / 3, rtol=1e-5, atol=1e-7)
    untouched, _ = jax.jit(clip_by_global_norm(total * 2).update)(glob, ())
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(untouched[k]), v)


# --------------------------------------------------------------------------- #
# boxes, optax and nnx states
# --------------------------------------------------------------------------- #


def test_linen_boxes_around_explicit_arrays_under_jit(devices, spy):
    mesh = _mesh("2x4", devices)
    host, glob = _tree(mesh, {"k": ((8, 8), P("a", "b")), "q": ((4, 8), P(None, "b")), "s": ((3,), P())})
    rules = (("batch", "a"), ("embed", "b"))
    boxed = {
        "k": nn.Partitioned(glob["k"], names=("a", "b")),
        "q": nn.LogicallyPartitioned(glob["q"], names=(None, "embed"), rules=rules),
        "s": glob["s"],
    }
    m = jax.jit(lambda t: norm_metrics(params=t, per_param=True))(boxed)
    assert spy  # box names are not bound under jit; the unboxed leaves carry their specs
    _close(m["param_norm"], _n64(*host.values()))
    for k, v in host.items():
        _close(m[f"param_norm/{k}"], _n64(v))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_optax_adamw_state_of_explicit_params(mode, devices):
    mesh = _mesh("2x4", devices)
    host, params = _tree(mesh, {"w": ((8, 8), P("a", "b")), "b": ((8,), P("b")), "s": ((), P())})
    tx = optax.adamw(1e-2, weight_decay=0.1)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: p * 0.5 + 1.0, params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    fn = lambda u, s: norm_metrics(updates=u, grads=s)  # noqa: E731
    m = (jax.jit(fn) if mode == "jit" else fn)(updates, state)
    _close(m["update_norm"], _n64(*jax.tree.leaves(jax.device_get(updates))))
    _close(m["grad_norm"], _n64(*jax.tree.leaves(jax.device_get(state))))  # count (=1) is a leaf too
    assert int(m["nonfinite_grads"]) == 0


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_nnx_state_under_set_mesh(mode, devices, spy):
    mesh = _mesh("2x4", devices)

    class Model(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, (None, "b")), rngs=rngs)
            self.down = nnx.Linear(16, 4, kernel_init=nnx.with_partitioning(init, ("b", None)), rngs=rngs)

    with jax.set_mesh(mesh):
        state = nnx.state(Model(nnx.Rngs(0)), nnx.Param)
        assert state["up"]["kernel"].get_value().sharding.spec == P(None, "b")
        fn = lambda s: norm_metrics(params=s, per_param=True)  # noqa: E731
        m = (jax.jit(fn) if mode == "jit" else fn)(state)
    assert spy
    leaves = {k: np.asarray(state[a][b].get_value()) for k, (a, b) in
              {"up/kernel": ("up", "kernel"), "up/bias": ("up", "bias"),
               "down/kernel": ("down", "kernel"), "down/bias": ("down", "bias")}.items()}
    _close(m["param_norm"], _n64(*leaves.values()))
    for k, v in leaves.items():
        _close(m[f"param_norm/{k}"], _n64(v))


# --------------------------------------------------------------------------- #
# partial shard_map: one Manual axis, one Explicit axis
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("spec", [P("a", "b"), P(None, "b"), P("a", None), P()], ids=str)
def test_partial_shard_map_bare_and_boxed(spec, devices, spy):
    mesh = _mesh("2x4", devices)
    hw = np.random.default_rng(9).normal(size=(4, 8)).astype(np.float32)
    hv = np.random.default_rng(10).normal(size=(8,)).astype(np.float32)
    w = jax.device_put(hw, NamedSharding(mesh, spec))
    v = jax.device_put(hv, NamedSharding(mesh, P("b")))  # split only over the Explicit axis
    names = tuple(spec) + (None,) * (2 - len(tuple(spec)))

    def bare(w, v):  # bare arrays: local over 'a' (taken as replicated), global over 'b'
        return norm_metrics(grads={"w": w, "v": v}, per_param=True)["grad_norm"][None]

    def boxed(w, v):  # boxes: psum over 'a' (bound) only; 'b' is global already
        tree = {"w": nn.Partitioned(w, names=names), "v": nn.Partitioned(v, names=("b",))}
        return norm_metrics(grads=tree)["grad_norm"]

    f_bare = jax.shard_map(bare, mesh=mesh, in_specs=(P("a"), P()), out_specs=P("a"), axis_names={"a"})
    f_box = jax.shard_map(boxed, mesh=mesh, in_specs=(P("a") if "a" in names else P(), P()), out_specs=P(),
                          axis_names={"a"})
    np.testing.assert_allclose(np.asarray(jax.jit(f_bare)(w, v)), [_n64(hw[:2], hv), _n64(hw[2:], hv)], rtol=RTOL)
    _close(jax.jit(f_box)(w, v), _n64(hw, hv))
    assert not spy  # a Manual axis in the leaves' mesh: the plain path


# --------------------------------------------------------------------------- #
# eager meshes and non-Named shardings
# --------------------------------------------------------------------------- #


def test_eager_sub_mesh_other_meshes_and_single_device(devices, spy):
    rng = np.random.default_rng(11)
    ha, hb = rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(16,)).astype(np.float32)
    sub = jax.make_mesh((4,), ("x",), devices=devices[4:])
    a, b = (jax.device_put(h, NamedSharding(sub, P("x"))) for h in (ha, hb))
    _close(get_sharded_global_norm({"a": a, "b": b})[0], _n64(ha, hb))
    assert len(spy) == 1  # one mesh of 4 devices: the new path

    # Same devices, two meshes (Auto: with Explicit axes jax itself refuses to mix meshes).
    m24, m42 = _mesh("2x4", devices, AxisType.Auto), _mesh("4x2", devices, AxisType.Auto)
    a = jax.device_put(ha, NamedSharding(m24, P("a", "b")))
    b = jax.device_put(hb, NamedSharding(m42, P(("a", "b"))))
    _close(norm_metrics(grads={"a": a, "b": b})["grad_norm"], _n64(ha, hb))
    assert len(spy) == 1  # two meshes: the plain path

    single = jax.device_put(hb, devices[3])
    assert isinstance(single.sharding, SingleDeviceSharding)
    _close(get_sharded_global_norm({"b": single})[0], _n64(hb))
    _close(get_sharded_global_norm({"b": jax.device_put(hb, NamedSharding(m24, P()))})[0], _n64(hb))
    assert len(spy) == 1  # nothing split: the plain path


def test_jit_with_closed_over_concrete_array(devices, spy):
    # A tracer (AbstractMesh) beside a concrete array (Mesh): not one mesh, plain path; exact either way.
    mesh = _mesh("2x4", devices)
    host, glob = _tree(mesh, {"w": ((4, 8), P(None, "b")), "v": ((8,), P("b"))})
    out = jax.jit(lambda w: get_sharded_global_norm({"w": w, "v": glob["v"]})[0])(glob["w"])
    _close(out, _n64(*host.values()))


def test_concrete_array_closed_over_inside_shard_map(devices):
    mesh = _mesh("2x4", devices, AxisType.Auto)
    hw = np.arange(32, dtype=np.float32).reshape(4, 8)
    w = jax.device_put(hw, NamedSharding(mesh, P(None, "b")))
    f = jax.shard_map(lambda x: x + get_sharded_global_norm({"w": w})[0], mesh=mesh, in_specs=P(), out_specs=P())
    _close(jax.jit(f)(jnp.zeros(())), _n64(hw))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_reduced_spec_leaf(mode, devices):
    mesh = _mesh("2x4", devices)
    hw = np.arange(32, dtype=np.float32).reshape(4, 8)
    with jax.set_mesh(mesh):
        if mode == "eager":
            w = jax.device_put(hw, NamedSharding(mesh, P(None, "b", reduced={"a"})))
            out = get_sharded_global_norm({"w": w})[0]
        else:
            w = jax.device_put(hw, NamedSharding(mesh, P(None, "b")))
            reduced = lambda w: jax.sharding.reshard(w, P(None, "b", reduced={"a"}))  # noqa: E731
            out = jax.jit(lambda w: get_sharded_global_norm({"w": reduced(w)})[0])(w)
    _close(out, _n64(hw))


# --------------------------------------------------------------------------- #
# tracing and compiling raise no Python warnings
# --------------------------------------------------------------------------- #


def test_make_jaxpr_and_compile_do_not_warn(devices, spy):
    mesh = _mesh("2x4", devices)
    _, glob = _tree(mesh, _layout("2x4"))
    fn = lambda t: norm_metrics(grads=t, params=t, per_param=True)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxpr = jax.make_jaxpr(fn)(glob)
        jax.jit(fn).lower(glob).compile()
        with jax.set_mesh(mesh):
            jax.jit(fn).lower(glob).compile()
    assert not caught, [str(w.message) for w in caught]
    assert "shard_map" in str(jaxpr)
    assert spy


def test_inside_scan_while_remat_and_cond(devices, spy):
    mesh = _mesh("2x4", devices)
    hw = np.random.default_rng(12).normal(size=(4, 8)).astype(np.float32)
    w = jax.device_put(hw, NamedSharding(mesh, P(None, "b")))
    r = _n64(hw)
    # scan: c <- c + ||c * w|| from c = 1, twice
    scan = jax.jit(lambda w: jax.lax.scan(lambda c, _: (c + get_sharded_global_norm({"w": w * c})[0], None),
                                          jnp.float32(1.0), None, length=2)[0])(w)
    c1 = 1 + r
    _close(scan, c1 + c1 * r)
    loop = jax.jit(lambda w: jax.lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + get_sharded_global_norm({"w": w})[0]), (0, jnp.float32(0))
    )[1])(w)
    _close(loop, 3 * r)
    g = jax.jit(jax.grad(jax.checkpoint(lambda w: norm_metrics(params={"w": w})["param_norm"])))(w)
    np.testing.assert_allclose(np.asarray(g), hw / r, rtol=1e-5, atol=1e-7)
    stacked = jax.device_put(np.stack([hw, 2 * hw]), NamedSharding(mesh, P(None, None, "b")))
    per_layer = jax.jit(lambda ws: jax.lax.scan(lambda c, wl: (c, get_sharded_global_norm(wl)[0]), 0.0, ws)[1])(stacked)
    _close(per_layer, [r, 2 * r])
    assert len(spy) >= 4
