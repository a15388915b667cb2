"""treetools.pytree.norms on 8 fake CPU devices, checked against numpy float64 on the gathered arrays."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping

import flax.linen as nn
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from treetools.pytree.metrics import JsonlWriter, MetricsLogger, read_metrics
from treetools.pytree.norms import (
    clip_by_global_norm,
    get_grad_norms,
    get_param_norms,
    get_sharded_global_norm,
    get_sharded_norm_logits,
    norm_metrics,
)
from treetools.pytree.partitioning import is_box, leaf_sharding, unbox
from treetools.pytree.paths import flatten, unflatten_dict

RTOL = 2e-6  # float32 accumulation vs float64

MESHES = {
    "8": ((8,), ("fsdp",)),
    "2x4": ((2, 4), ("tp", "fsdp")),
    "4x2": ((4, 2), ("tp", "fsdp")),
}

# name -> (shape, spec): every spec the issue asks for; "tp" ones only on 2-D meshes.
LEAVES = {
    "dense/kernel": ((6, 16), (None, "fsdp")),  # P(None, 'fsdp')
    "dense/bias": ((16,), ("fsdp",)),
    "attn/q": ((8, 5), ("tp", None)),  # P('tp', None)
    "attn/o": ((8, 8), ("tp", "fsdp")),  # fully sharded, 2-D
    "embed": ((24, 3), (("tp", "fsdp"), None)),  # fully sharded, one dim over both axes
    "ln/scale": ((7,), (None,)),  # replicated
}


def _leaves_for(axes: tuple[str, ...]) -> dict[str, tuple]:
    def ok(spec):
        used = {a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))}
        return used <= set(axes)

    out = {k: v for k, v in LEAVES.items() if ok(v[1])}
    if axes == ("fsdp",):
        out["embed"] = ((24, 3), ("fsdp", None))
    return out


def _host_arrays(layout: Mapping[str, tuple], seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.normal(size=shape) * (i + 1)).astype(dtype) for i, (k, (shape, _)) in enumerate(layout.items())}


def _sq64(x) -> float:
    return float(np.sum(np.asarray(x, dtype=np.float64) ** 2))


AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


@pytest.fixture(params=[(m, t) for m in MESHES for t in AXIS_TYPES], ids=[f"{m}-{t}" for m in MESHES for t in AXIS_TYPES])
def setup(request, devices):
    # Explicit axes: the leaves' types carry their specs and the norms take the
    # one-psum-per-axis-set path under jit; Auto axes: classic GSPMD.
    name, kind = request.param
    shape, axes = MESHES[name]
    mesh = jax.make_mesh(shape, axes, devices=devices, axis_types=(AXIS_TYPES[kind],) * len(axes))
    layout = _leaves_for(axes)
    host = _host_arrays(layout)
    glob = {k: jax.device_put(host[k], NamedSharding(mesh, P(*spec))) for k, (_, spec) in layout.items()}
    return mesh, layout, host, glob


def _expected(host: Mapping[str, np.ndarray]) -> tuple[float, dict[str, float]]:
    per = {k: np.sqrt(_sq64(v)) for k, v in host.items()}
    return float(np.sqrt(sum(_sq64(v) for v in host.values()))), per


def _check(global_norm, per_leaf_flat: Mapping[str, object], host) -> None:
    g, per = _expected(host)
    assert np.asarray(global_norm).dtype == np.float32
    np.testing.assert_allclose(float(global_norm), g, rtol=RTOL)
    assert set(per_leaf_flat) == set(per)
    for k, v in per.items():
        np.testing.assert_allclose(float(per_leaf_flat[k]), v, rtol=RTOL, err_msg=k)


def _call(fn, *args):
    # Block on every sharded call: on fake CPU devices, XLA can deadlock in an
    # all-reduce rendezvous when several collective programs are in flight.
    return jax.block_until_ready(fn(*args))


def _in_shard_map(fn, mesh, tree, out_specs=P()):
    specs = jax.tree.map(lambda b: leaf_sharding(b).spec if is_box(b) else P(), tree, is_leaf=is_box)
    return _call(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=out_specs)), tree)


# --------------------------------------------------------------------------- #
# Where the sum happens: shard_map on boxes, jit/eager on global arrays
# --------------------------------------------------------------------------- #


def test_shard_map_linen_partitioned(setup):
    mesh, layout, host, glob = setup
    tree = unflatten_dict({k: nn.Partitioned(glob[k], names=spec) for k, (_, spec) in layout.items()})

    def inside(t):
        # The box holds the local shard, e.g. (6, 16 / fsdp) for dense/kernel.
        kernel = t["dense"]["kernel"].value
        assert kernel.shape == (6, 16 // mesh.shape["fsdp"])
        return get_sharded_global_norm(t)

    g, per_leaf = _in_shard_map(inside, mesh, tree)
    _check(g, flatten(per_leaf), host)


def test_shard_map_nnx_variables(setup):
    mesh, layout, host, glob = setup
    tree = unflatten_dict(
        {k: nnx.Param(glob[k], out_sharding=spec, eager_sharding=False) for k, (_, spec) in layout.items()}
    )
    g, per_leaf = _in_shard_map(get_sharded_global_norm, mesh, tree)
    _check(g, flatten(per_leaf), host)


def test_shard_map_single_leaf_logits(setup):
    mesh, layout, host, glob = setup
    tree = {k: nn.Partitioned(glob[k], names=spec) for k, (_, spec) in layout.items()}
    logits = _in_shard_map(lambda t: jax.tree.map(get_sharded_norm_logits, t, is_leaf=is_box), mesh, tree)
    for k, v in host.items():
        # A replicated leaf summed over the mesh would come out 8x too large here.
        np.testing.assert_allclose(float(logits[k]), _sq64(v), rtol=RTOL, err_msg=k)


def test_jit_and_eager_on_global_arrays(setup):
    mesh, layout, host, glob = setup
    tree = unflatten_dict(glob)
    g_jit, per_jit = _call(jax.jit(get_sharded_global_norm), tree)
    g_eager, per_eager = _call(get_sharded_global_norm, tree)
    _check(g_jit, flatten(per_jit), host)
    _check(g_eager, flatten(per_eager), host)
    np.testing.assert_allclose(float(g_jit), float(g_eager), rtol=1e-6)
    # Boxes around global arrays under plain jit: names are not bound axes, no psum.
    boxed = unflatten_dict({k: nn.Partitioned(glob[k], names=spec) for k, (_, spec) in layout.items()})
    g_box, per_box = _call(jax.jit(get_sharded_global_norm), boxed)
    _check(g_box, flatten(per_box), host)


def _all_reduced_operands(fn, tree) -> list[tuple[str, int]]:
    """``(result type, number of operands)`` of each all-reduce in ``fn``'s compiled program."""
    import re

    text = jax.jit(fn).lower(tree).compile().as_text()
    return [(t, args.count("%")) for t, args in re.findall(r"= (.+?) all-reduce(?:-start)?\(([^)]*)\)", text)]


def test_explicit_axes_reduce_once_per_axis_set(devices):
    # Under jit with Explicit axes, the compiler alone (optax) all-reduces every
    # split leaf's sum; ours stacks the local sums: one all-reduce per distinct
    # set of mesh axes (3 here: fsdp, data, data+fsdp), each of one operand.
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=devices, axis_types=(AxisType.Explicit,) * 2)
    layout = {"a": ((4, 8), P(None, "fsdp")), "b": ((6, 3), P("data", None)), "c": ((5,), P()),
              "d": ((16,), P(("data", "fsdp"))), "e": ((2, 4), P(None, "fsdp")), "f": ((8, 2), P("fsdp"))}
    host = {k: np.random.default_rng(i).normal(size=shape).astype(np.float32) for i, (k, (shape, _)) in enumerate(layout.items())}
    tree = {k: jax.device_put(host[k], NamedSharding(mesh, spec)) for k, (_, spec) in layout.items()}
    ours = [(t, n) for t, n in _all_reduced_operands(lambda t: norm_metrics(grads=t, per_param=True), tree) if t.startswith("f32")]
    assert len(ours) == 3 and all(n == 1 for _, n in ours)
    optax_operands = sum(n for _, n in _all_reduced_operands(optax.tree.norm, tree))
    assert optax_operands == 5  # every split leaf: a, b, d, e, f
    m = _call(jax.jit(lambda t: norm_metrics(grads=t, per_param=True)), tree)
    _check(m["grad_norm"], {k: m[f"grad_norm/{k}"] for k in host}, host)


def test_mixed_layouts_fall_back_to_the_compiler(devices):
    # Eager calls on concrete NamedShardings take the one-psum path too; leaves on
    # two meshes (same devices, other shape) or beside a numpy array take the
    # plain path. Every case is exact.
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices, axis_types=(AxisType.Auto,))
    other = jax.make_mesh((2, 4), ("data", "fsdp"), devices=devices, axis_types=(AxisType.Auto,) * 2)
    host = {"a": np.arange(16, dtype=np.float32), "b": np.ones((8, 3), np.float32)}
    b = jax.device_put(host["b"], NamedSharding(mesh, P("fsdp")))
    for a in (jax.device_put(host["a"], NamedSharding(mesh, P("fsdp"))),  # one mesh: the shard_map path
              jax.device_put(host["a"], NamedSharding(other, P(("data", "fsdp")))),  # two meshes
              host["a"]):  # numpy
        g, per = _call(get_sharded_global_norm, {"a": a, "b": b})
        _check(g, per, host)


def test_norm_metrics_shard_map_equals_jit(setup):
    mesh, layout, host, glob = setup
    boxed = unflatten_dict({k: nn.Partitioned(glob[k], names=spec) for k, (_, spec) in layout.items()})
    inside = _in_shard_map(lambda t: norm_metrics(grads=t, params=t, per_param=True), mesh, boxed)
    outside = _call(jax.jit(lambda t: norm_metrics(grads=t, params=t, per_param=True)), unflatten_dict(glob))
    eager = _call(lambda t: norm_metrics(grads=t, params=t, per_param=True), unflatten_dict(glob))
    g, per = _expected(host)
    for m in (inside, outside, eager):
        np.testing.assert_allclose(float(m["grad_norm"]), g, rtol=RTOL)
        np.testing.assert_allclose(float(m["param_norm"]), g, rtol=RTOL)
        assert int(m["nonfinite_grads"]) == 0
        for k, v in per.items():
            np.testing.assert_allclose(float(m[f"grad_norm/{k}"]), v, rtol=RTOL, err_msg=k)


def test_partial_manual_shard_map_sums_only_manual_axes(devices):
    # Only 'fsdp' is manual; 'tp' stays automatic, so the box is global over it.
    mesh = jax.make_mesh((2, 4), ("tp", "fsdp"), devices=devices)
    host = _host_arrays({"w": ((8, 8), None)})["w"]
    x = jax.device_put(host, NamedSharding(mesh, P("tp", "fsdp")))
    box = nn.Partitioned(x, names=("tp", "fsdp"))

    def inside(b):
        assert b.value.shape == (8, 2)  # split over fsdp only
        return get_sharded_norm_logits(b)

    # in_specs may name only the manual axis; the box still says ('tp', 'fsdp').
    fn = jax.shard_map(inside, mesh=mesh, in_specs=(P(None, "fsdp"),), out_specs=P(), axis_names={"fsdp"})
    with jax.set_mesh(mesh):
        got = _call(jax.jit(fn), box)
    np.testing.assert_allclose(float(got), _sq64(host), rtol=RTOL)


def test_logically_partitioned_maps_rules_to_mesh_axes(devices):
    mesh = jax.make_mesh((2, 4), ("tp", "fsdp"), devices=devices)
    rules = (("embed", "fsdp"), ("mlp", "tp"), ("norm", None))
    layout = {"wi": ((8, 12), ("embed", "mlp")), "scale": ((8,), ("norm",))}
    mesh_specs = {"wi": P("fsdp", "tp"), "scale": P(None)}
    host = _host_arrays(layout)
    tree = {
        k: nn.LogicallyPartitioned(jax.device_put(host[k], NamedSharding(mesh, mesh_specs[k])), names=names, rules=rules)
        for k, (_, names) in layout.items()
    }
    for k in tree:
        assert leaf_sharding(tree[k]).spec == mesh_specs[k]

    def inside(t):
        assert t["wi"].value.shape == (2, 6)
        return get_sharded_global_norm(t)

    g, per = _in_shard_map(inside, mesh, tree)
    _check(g, per, host)


def test_explicit_axes_for_a_bare_local_shard(devices):
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices)
    host = _host_arrays({"w": ((16, 4), None)})["w"]
    x = jax.device_put(host, NamedSharding(mesh, P("fsdp")))
    fn = jax.shard_map(
        lambda s: (get_sharded_norm_logits(s, axes=("fsdp",)), get_sharded_norm_logits(s)[None]),
        mesh=mesh,
        in_specs=P("fsdp"),
        out_specs=(P(), P("fsdp")),
    )
    total, local = _call(jax.jit(fn), x)
    np.testing.assert_allclose(float(total), _sq64(host), rtol=RTOL)
    # Without a box or axes= a bare array is taken as whole: each device sees its shard only.
    np.testing.assert_allclose(np.asarray(local), [_sq64(host[2 * i : 2 * i + 2]) for i in range(8)], rtol=RTOL)


def _logical_tree(mesh):
    """A LogicallyPartitioned box split over both mesh axes once the rules map its names."""
    rules = (("embed", "fsdp"), ("mlp", "tp"))
    host = _host_arrays({"wi": ((8, 12), None), "scale": ((8,), None)}, seed=3)
    with nn.logical_axis_rules(rules):
        spec = nn.logical_to_mesh_axes(("embed", "mlp"))
    assert spec == P("fsdp", "tp")
    tree = {"wi": nn.LogicallyPartitioned(jax.device_put(host["wi"], NamedSharding(mesh, spec)), names=("embed", "mlp")),
            "scale": nn.LogicallyPartitioned(jax.device_put(host["scale"], NamedSharding(mesh, P())), names=("norm",))}
    return rules, host, tree, {"wi": spec, "scale": P()}


def test_logical_boxes_in_shard_map_without_rules_raise(devices):
    # Issue 14: traced outside any logical_axis_rules context, the box's names
    # map to nothing and only the local shard was summed (a silent wrong norm).
    mesh = jax.make_mesh((2, 4), ("tp", "fsdp"), devices=devices)
    rules, host, tree, specs = _logical_tree(mesh)
    truth = np.sqrt(sum(_sq64(v) for v in host.values()))

    def run(fn, out_specs=P()):
        # check_vma=False as in trainers that return per-device values: jax's own check cannot help then.
        return _call(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=out_specs, check_vma=False)), tree)

    calls = {
        "get_sharded_global_norm": (lambda t: get_sharded_global_norm(t)[0], P()),
        "norm_metrics": (lambda t: norm_metrics(grads=t)["grad_norm"], P()),
        "clip_by_global_norm": (lambda t: clip_by_global_norm(1.0).update(t, None)[0]["wi"].value, P("fsdp", "tp")),
        "get_sharded_norm_logits": (lambda t: get_sharded_norm_logits(t["wi"]), P()),
    }
    for name, (fn, out_specs) in calls.items():
        with pytest.raises(ValueError, match=r"logical names \('embed', 'mlp'\).*nn\.logical_axis_rules") as err:
            run(fn, out_specs)
        # Every offending leaf named, each on its own line (a single leaf: one line).
        lines = str(err.value).splitlines()
        if name == "get_sharded_norm_logits":
            assert lines[0].startswith("leaf `x` is a LogicallyPartitioned box"), name
        else:
            assert lines[0].startswith("inside shard_map, 2 boxes"), name
            assert "leaf `scale`" in lines[1] and "leaf `wi`" in lines[2], name

    # Where the mapping is knowable, the answer is the global one.
    def inside_rules(t):
        with nn.logical_axis_rules(rules):
            return get_sharded_global_norm(t)[0]

    np.testing.assert_allclose(float(run(inside_rules)), truth, rtol=RTOL)
    with nn.logical_axis_rules(rules):  # the context around the trace is what counts
        np.testing.assert_allclose(float(run(lambda t: norm_metrics(grads=t)["grad_norm"])), truth, rtol=RTOL)
    with_rules = {k: nn.LogicallyPartitioned(b.value, names=b.names, rules=rules) for k, b in tree.items()}
    got = _call(jax.jit(jax.shard_map(lambda t: get_sharded_global_norm(t)[0], mesh=mesh, in_specs=(specs,),
                                      out_specs=P(), check_vma=False)), with_rules)
    np.testing.assert_allclose(float(got), truth, rtol=RTOL)
    # Outside shard_map the arrays are global: no rules needed, no error.
    np.testing.assert_allclose(float(_call(jax.jit(lambda t: get_sharded_global_norm(t)[0]), tree)), truth, rtol=RTOL)


def test_box_naming_an_axis_the_mesh_lacks_raises_in_shard_map(devices):
    # An nnx Variable whose names are logical (no sharding_rules): inside shard_map
    # they name no mesh axis, so its local sum cannot be placed; an error, not a local norm.
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices)
    host = _host_arrays({"w": ((16, 4), None)})["w"]
    x = jax.device_put(host, NamedSharding(mesh, P("fsdp")))
    tree = {"layer": {"w": nnx.Param(x, out_sharding=("embed", None), eager_sharding=False)}}
    fn = jax.shard_map(lambda t: get_sharded_global_norm(t)[0], mesh=mesh, in_specs=({"layer": {"w": P("fsdp")}},),
                       out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=r"`layer/w` is split over \['embed'\].*\('fsdp',\)"):
        _call(jax.jit(fn), tree)


# --------------------------------------------------------------------------- #
# Complex leaves: |z|^2, as optax
# --------------------------------------------------------------------------- #


def _complex_host(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    z = (rng.normal(size=(8, 6)) + 1j * rng.normal(size=(8, 6)) * 3).astype(np.complex64)
    return {"z": z, "w": rng.normal(size=(8,)).astype(np.float32), "u": (1j * rng.normal(size=(16,))).astype(np.complex64)}


def test_complex_norms_match_optax_and_float64():
    # Issue 14: the float32 cast dropped the imaginary part (3.0 for |3+4i|); the
    # cast's DeprecationWarning was muted. Errors on any warning here.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = {"z": jnp.array([3 + 4j])}
        assert float(get_sharded_global_norm(one)[0]) == float(optax.tree.norm(one)) == 5.0
        assert float(get_sharded_norm_logits(one["z"])) == 25.0
        host = _complex_host()
        tree = {k: jnp.asarray(v) for k, v in host.items()}
        truth = np.sqrt(sum(float(np.sum(np.abs(v.astype(np.complex128)) ** 2)) for v in host.values()))
        for g, per in (get_sharded_global_norm(tree), _call(jax.jit(get_sharded_global_norm), tree)):
            assert g.dtype == jnp.float32 and per["z"].dtype == jnp.float32
            np.testing.assert_allclose(float(g), truth, rtol=RTOL)
            np.testing.assert_allclose(float(g), float(optax.tree.norm(tree)), rtol=RTOL)
            for k, v in host.items():
                np.testing.assert_allclose(float(per[k]), np.linalg.norm(v.astype(np.complex128)), rtol=RTOL, err_msg=k)
                np.testing.assert_allclose(float(per[k]), float(optax.tree.norm(tree[k])), rtol=RTOL, err_msg=k)
        m = jax.jit(lambda t: norm_metrics(grads=t, params=t, per_param=True))(tree)
        np.testing.assert_allclose(float(m["grad_norm"]), truth, rtol=RTOL)
        np.testing.assert_allclose(float(m["grad_norm/u"]), np.linalg.norm(host["u"].astype(np.complex128)), rtol=RTOL)
        assert int(m["nonfinite_grads"]) == 0


def test_complex_nonfinite_counted_per_element():
    z = np.array([1 + 1j, complex(np.nan, 0), complex(0, np.inf), complex(np.inf, np.nan), 2j], np.complex64)
    m = jax.jit(lambda t: norm_metrics(grads=t))({"z": z, "w": np.array([np.nan, 1.0], np.float32)})
    assert int(m["nonfinite_grads"]) == 3 + 1  # elements, not parts: inf+nan*i is one
    assert np.isnan(float(m["grad_norm"]))


def test_complex_sharded_in_shard_map_and_jit(devices):
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices)
    host = _complex_host(1)
    specs = {"z": P("fsdp"), "w": P("fsdp"), "u": P()}
    glob = {k: jax.device_put(host[k], NamedSharding(mesh, specs[k])) for k in host}
    boxed = {k: nn.Partitioned(glob[k], names=tuple(specs[k]) or (None,)) for k in host}
    truth = np.sqrt(sum(float(np.sum(np.abs(v.astype(np.complex128)) ** 2)) for v in host.values()))
    inside = _in_shard_map(lambda t: norm_metrics(grads=t, per_param=True), mesh, boxed)
    outside = _call(jax.jit(lambda t: norm_metrics(grads=t, per_param=True)), glob)
    for m in (inside, outside):
        np.testing.assert_allclose(float(m["grad_norm"]), truth, rtol=RTOL)
        np.testing.assert_allclose(float(m["grad_norm/z"]), np.linalg.norm(host["z"].astype(np.complex128)), rtol=RTOL)
        assert int(m["nonfinite_grads"]) == 0


@pytest.mark.parametrize("max_norm", [1.0, 1e3])
def test_clip_complex_as_optax(max_norm):
    # Issue 14: clip_by_global_norm(1.0) left a complex tree at norm 1.67.
    host = _complex_host(2)
    tree = {k: jnp.asarray(v) for k, v in host.items()}
    truth = np.sqrt(sum(float(np.sum(np.abs(v.astype(np.complex128)) ** 2)) for v in host.values()))
    ours, _ = jax.jit(clip_by_global_norm(max_norm).update)(tree, optax.EmptyState())
    ref, _ = jax.jit(optax.clip_by_global_norm(max_norm).update)(tree, optax.EmptyState())
    clipped = {k: np.asarray(v).astype(np.complex128) for k, v in ours.items()}
    np.testing.assert_allclose(np.sqrt(sum(float(np.sum(np.abs(v) ** 2)) for v in clipped.values())), min(max_norm, truth), rtol=1e-6)
    for k, v in host.items():
        assert ours[k].dtype == v.dtype, k
        np.testing.assert_allclose(clipped[k], v.astype(np.complex128) * min(1.0, max_norm / truth), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(ref[k]), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- #
# Precision, empty trees, non-finite values
# --------------------------------------------------------------------------- #


def test_bf16_ten_million_elements_match_float64(devices):
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices)
    rng = np.random.default_rng(7)
    host = {
        "a": rng.normal(size=(2000, 2500)).astype(jnp.bfloat16),  # 5e6
        "b": (rng.normal(size=(5_000_000,)) * 3).astype(jnp.bfloat16),  # 5e6
    }
    tree = {k: jax.device_put(v, NamedSharding(mesh, P("fsdp"))) for k, v in host.items()}
    g, per = _call(jax.jit(get_sharded_global_norm), tree)
    assert g.dtype == jnp.float32 and per["a"].dtype == jnp.float32
    expected = np.sqrt(sum(_sq64(v) for v in host.values()))
    np.testing.assert_allclose(float(g), expected, rtol=1e-5)
    np.testing.assert_allclose(float(per["b"]), np.sqrt(_sq64(host["b"])), rtol=1e-5)


def test_fp16_squares_beyond_fp16_range_do_not_overflow():
    x = jnp.full((1000,), 300.0, jnp.float16)  # 300**2 = 9e4 > fp16 max 65504
    assert not np.isfinite(float(jnp.sum(x * x)))  # squaring in fp16 overflows
    expected = 300.0 * np.sqrt(1000.0)
    np.testing.assert_allclose(float(get_sharded_norm_logits(x)), 300.0**2 * 1000, rtol=RTOL)
    for g in (get_sharded_global_norm({"x": x})[0], jax.jit(lambda t: get_sharded_global_norm(t)[0])({"x": x})):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(float(g), expected, rtol=RTOL)
    m = jax.jit(lambda t: norm_metrics(grads=t))({"x": x})
    assert int(m["nonfinite_grads"]) == 0


@pytest.mark.parametrize("empty", [{}, [], (), {"a": {}, "b": None}])
def test_empty_tree_is_zero(empty):
    g, per = get_sharded_global_norm(empty)
    assert float(g) == 0.0 and g.dtype == jnp.float32
    assert jax.tree.structure(per) == jax.tree.structure(empty)
    assert float(jax.jit(lambda t: get_sharded_global_norm(t)[0])(empty)) == 0.0
    m = jax.jit(lambda t: norm_metrics(grads=t, params=t, per_param=True))(empty)
    assert {k: float(v) for k, v in m.items() if k != "update_ratio"} == {
        "grad_norm": 0.0,
        "param_norm": 0.0,
        "nonfinite_grads": 0.0,
    }
    assert get_grad_norms(empty, True) == {"grad_norm": 0.0}


def test_nonfinite_propagate_and_are_counted(setup):
    mesh, layout, host, glob = setup
    host = dict(host)
    kernel = host["dense/kernel"].copy()
    kernel[0, 0], kernel[5, 15], kernel[3, 2] = np.nan, np.inf, -np.inf
    scale = host["ln/scale"].copy()
    scale[1] = np.nan  # replicated leaf: counted once, not once per device
    host["dense/kernel"], host["ln/scale"] = kernel, scale
    glob = {k: jax.device_put(host[k], NamedSharding(mesh, P(*spec))) for k, (_, spec) in layout.items()}
    n_bad = sum(int(np.sum(~np.isfinite(v))) for v in host.values())
    assert n_bad == 4

    boxed = unflatten_dict({k: nn.Partitioned(glob[k], names=spec) for k, (_, spec) in layout.items()})
    inside = _in_shard_map(lambda t: norm_metrics(grads=t, per_param=True), mesh, boxed)
    outside = _call(jax.jit(lambda t: norm_metrics(grads=t, per_param=True)), unflatten_dict(glob))
    for m in (inside, outside):
        assert int(m["nonfinite_grads"]) == n_bad
        assert np.isnan(float(m["grad_norm"]))
        assert np.isnan(float(m["grad_norm/dense/kernel"]))
        # A finite leaf beside them keeps its finite norm.
        np.testing.assert_allclose(float(m["grad_norm/embed"]), np.sqrt(_sq64(host["embed"])), rtol=RTOL)

    # Inf alone gives an Inf norm; a finite value whose square overflows float32 counts 0.
    inf_only = {"a": jnp.array([1.0, jnp.inf, -jnp.inf]), "b": jnp.ones(3)}
    m = jax.jit(lambda t: norm_metrics(grads=t))(inf_only)
    assert float(m["grad_norm"]) == np.inf and int(m["nonfinite_grads"]) == 2
    m = jax.jit(lambda t: norm_metrics(grads=t))({"a": jnp.array([1e30, 1.0])})
    assert float(m["grad_norm"]) == np.inf and int(m["nonfinite_grads"]) == 0


# --------------------------------------------------------------------------- #
# One pass: every array is read once
# --------------------------------------------------------------------------- #


def _program(fn, args, platform: str) -> tuple[list[list[tuple]], list[str]]:
    """What ``fn``'s traced program does to each input leaf once lowered for ``platform``.

    Returns, per leaf of ``args``, the reductions its data flows into, each as
    ``(primitive, axes, inside a conditional)``, and the data-dependent
    conditionals and loops met on the way. Nested calls (jit, custom_jvp,
    shard_map) are followed; a ``cond`` made by ``jax.lax.platform_dependent``
    is resolved to ``platform``'s branch, as jax's lowering does.
    """
    from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

    closed = jax.make_jaxpr(fn)(args)
    reductions: list[list[tuple]] = [[] for _ in closed.jaxpr.invars]
    conditionals: list[str] = []

    def inner_jaxprs(eqn):
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(j, (Jaxpr, ClosedJaxpr)):
                    yield j.jaxpr if isinstance(j, ClosedJaxpr) else j

    def walk(jaxpr, env, in_cond):  # env: var -> the leaves its value is computed from
        for eqn in jaxpr.eqns:
            srcs = frozenset().union(*(env.get(v, frozenset()) for v in eqn.invars if not isinstance(v, Literal)))
            name = eqn.primitive.name
            if name == "cond":
                platforms = eqn.params.get("branches_platforms")
                branches = eqn.params["branches"]
                if platforms is None:  # data-dependent: every branch may run
                    conditionals.append(name)
                    picked, inside = range(len(branches)), True
                else:
                    mine = [i for i, p in enumerate(platforms) if p is not None and platform in p]
                    picked, inside = (mine or [platforms.index(None)])[:1], in_cond
                outs = [frozenset()] * len(eqn.outvars)
                for b in picked:
                    br = branches[b].jaxpr
                    res = walk(br, {iv: env.get(ov, frozenset()) for iv, ov in zip(br.invars, eqn.invars[1:])
                                    if not isinstance(ov, Literal)}, inside)
                    outs = [o | r for o, r in zip(outs, res)]
            elif name.startswith("reduce") and name != "reduce_precision":
                for i in srcs:
                    reductions[i].append((name, eqn.params.get("axes", eqn.params.get("dimensions")), in_cond))
                outs = [frozenset()] * len(eqn.outvars)  # a scalar: what follows is not a read of the leaf
            elif name == "while":
                conditionals.append(name)
                outs = [srcs] * len(eqn.outvars)
            elif subs := list(inner_jaxprs(eqn)):
                sub = subs[0]
                res = walk(sub, {iv: env.get(ov, frozenset()) for iv, ov in zip(sub.invars, eqn.invars)
                                 if not isinstance(ov, Literal)}, in_cond)
                outs = res if len(res) == len(eqn.outvars) else [srcs] * len(eqn.outvars)
            else:
                outs = [srcs] * len(eqn.outvars)
            for ov, o in zip(eqn.outvars, outs):
                env[ov] = o
        return [env.get(v, frozenset()) if not isinstance(v, Literal) else frozenset() for v in jaxpr.outvars]

    walk(closed.jaxpr, {v: frozenset([i]) for i, v in enumerate(closed.jaxpr.invars)}, False)
    return reductions, conditionals


def _gpu_tree(seed: int, dtype=jnp.float32) -> dict:
    # Leaf shapes of a transformer block; ShapeDtypeStructs: nothing is allocated.
    shapes = {"embed": (512, 64), "attn/q": (64, 64), "mlp/wi": (64, 256), "mlp/bi": (256,), "ln/scale": (64,)}
    return {f"{k}_{seed}": jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
def test_accelerators_get_no_conditional_and_fusible_sibling_reductions(platform):
    # Issue 15: on a GPU the lax.cond that skipped the non-finite count made the
    # rest of the step wait for its predicate. Lowered for an accelerator: no
    # conditional, and each gradient feeds exactly two reductions over the same
    # axes (its sum of squares and its non-finite count: siblings that XLA:GPU/TPU
    # fuse into one kernel, i.e. the program a trainer writes with optax);
    # params and updates one each.
    g, p, u = _gpu_tree(0), _gpu_tree(1, jnp.bfloat16), _gpu_tree(2)
    n = len(g)
    fn = lambda t: norm_metrics(grads=t[0], params=t[1], updates=t[2], per_param=True)  # noqa: E731
    reductions, conditionals = _program(fn, (g, p, u), platform)
    assert conditionals == []
    for red in reductions[:n]:
        assert [name for name, _, _ in red] == ["reduce_sum", "reduce_sum"]
        assert red[0][1] == red[1][1]  # same axes: fusible siblings
    assert [[name for name, _, _ in red] for red in reductions[n:]] == [["reduce_sum"]] * (2 * n)
    # The global-only forms: the same, without per-leaf outputs.
    reductions, conditionals = _program(lambda t: norm_metrics(grads=t), g, platform)
    assert conditionals == [] and [len(r) for r in reductions] == [2] * n
    reductions, conditionals = _program(lambda t: get_sharded_global_norm(t), p, platform)
    assert conditionals == [] and [len(r) for r in reductions] == [1] * n
    # The checker can fail: a lazy count behind lax.cond, as the code had before.
    lazy = lambda t: jax.lax.cond(optax.tree.norm(t) < 1, lambda: 0, lambda: sum(jnp.sum(~jnp.isfinite(x)) for x in t.values()))  # noqa: E731
    assert _program(lazy, g, platform)[1] == ["cond"]


def test_cpu_keeps_the_lazy_count():
    # XLA:CPU fuses neither the sibling reductions nor a variadic one into one
    # fast pass, and a conditional there is an in-process branch: the count
    # runs only when the norm is not finite. Each leaf: one reduction outside it.
    g, p = _gpu_tree(0), _gpu_tree(1)
    n = len(g)
    reductions, conditionals = _program(lambda t: norm_metrics(grads=t[0], params=t[1], per_param=True), (g, p), "cpu")
    assert conditionals == ["cond"]
    assert [[inside for _, _, inside in red] for red in reductions] == [[False, True]] * n + [[False]] * n


def _case_regions(text: str) -> list[list[str]]:
    """The regions (branch bodies) of every ``stablehlo.case`` in an MLIR module's text."""
    out = []
    for match in re.finditer(r'"stablehlo\.case"\([^)]*\) \(\{', text):
        depth, start, regions = 1, match.end(), []
        for i in range(match.end(), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    regions.append(text[start:i])
                    if not text.startswith("}, {", i):
                        break
                    depth, start = 0, i + 4  # the loop meets that region's "{" next
        out.append(regions)
    return out


def test_lowered_for_gpu_has_no_branch_around_reductions():
    # The StableHLO jax hands to XLA:GPU, exported without a GPU: 2 reductions per
    # gradient and 1 per param/update leaf, none of them in a two-way branch
    # (the platform choice lowers to a one-region case that XLA inlines); for
    # CPU the counting reductions sit in the lazy two-way branch.
    g, p, u = _gpu_tree(0), _gpu_tree(1), _gpu_tree(2)
    fn = jax.jit(lambda g, p, u: norm_metrics(grads=g, params=p, updates=u, per_param=True))
    n = len(g)
    for platform in ("cuda", "cpu"):
        text = jax.export.export(fn, platforms=[platform])(g, p, u).mlir_module()
        assert "stablehlo.if" not in text and "stablehlo.while" not in text
        assert text.count("stablehlo.reduce(") == 4 * n, platform
        branched = [regions for regions in _case_regions(text) if len(regions) > 1 and "stablehlo.reduce(" in "".join(regions)]
        if platform == "cuda":
            assert branched == []
        else:
            assert len(branched) == 1 and sum(r.count("stablehlo.reduce(") for r in branched[0]) == n


def test_compiled_cpu_program_reads_each_array_once():
    # XLA's own accounting of the compiled program (no count branch without grads).
    # Leaves big enough for XLA:CPU's one-pass reduction (tiny ones are reduced in two stages).
    def tree(seed):
        return {f"w{i}_{seed}": jax.ShapeDtypeStruct((256, 128 * (i + 1)), jnp.float32) for i in range(4)}

    p, u = tree(1), tree(2)
    nbytes = 2 * sum(x.size * 4 for x in p.values())
    for fn in (lambda p, u: norm_metrics(params=p, updates=u, per_param=True), lambda p, u: get_sharded_global_norm((p, u))):
        cost = jax.jit(fn).lower(p, u).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        assert nbytes <= cost["bytes accessed"] <= 1.01 * nbytes


def test_gradient_through_the_counting_form():
    # The count's platform choice sits beside the norm: d||g|| / dg = g / ||g||, forward and reverse.
    tree = {k: jnp.asarray(v) for k, v in _model_tree(5).items()}
    total = np.sqrt(sum(_sq64(v) for v in tree.values()))
    grads = jax.jit(jax.grad(lambda t: norm_metrics(grads=t)["grad_norm"]))(tree)
    for k, v in tree.items():
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(v, np.float64) / total, rtol=1e-5, atol=1e-7)
    ones = jax.tree.map(jnp.ones_like, tree)
    _, tangent = jax.jvp(lambda x: norm_metrics(grads=x, per_param=True)["grad_norm"], (tree,), (ones,))
    np.testing.assert_allclose(float(tangent), sum(float(np.sum(np.asarray(v, np.float64))) for v in tree.values()) / total, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Metric dictionaries
# --------------------------------------------------------------------------- #


def _model_tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {
        "encoder/layer_0/w": (4, 3),
        "encoder/layer_0/b": (3,),
        "encoder/layer_1/w": (3, 3),
        "decoder/layer_0/w": (3, 2),
        "head": (2,),
    }
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def test_norm_metrics_keys_exact_and_values():
    g, p, u = _model_tree(0), _model_tree(1), _model_tree(2)
    paths = list(g)
    m = jax.jit(lambda *t: norm_metrics(grads=t[0], params=t[1], updates=t[2], per_param=True))(
        unflatten_dict(g), unflatten_dict(p), unflatten_dict(u)
    )
    expected_keys = {"grad_norm", "param_norm", "update_norm", "update_ratio", "nonfinite_grads"}
    expected_keys |= {f"{kind}/{path}" for kind in ("grad_norm", "param_norm", "update_norm") for path in paths}
    # Turn 4 (issue 40): per leaf also the update ratio and the non-finite count.
    expected_keys |= {f"{kind}/{path}" for kind in ("update_ratio", "nonfinite_grads") for path in paths}
    assert set(m) == expected_keys
    for path in paths:
        np.testing.assert_allclose(float(m[f"update_ratio/{path}"]), np.sqrt(_sq64(u[path]) / _sq64(p[path])), rtol=RTOL)
        assert m[f"nonfinite_grads/{path}"].dtype == jnp.int32 and int(m[f"nonfinite_grads/{path}"]) == 0
    for kind, host in (("grad_norm", g), ("param_norm", p), ("update_norm", u)):
        np.testing.assert_allclose(float(m[kind]), np.sqrt(sum(_sq64(v) for v in host.values())), rtol=RTOL)
        for path in paths:
            np.testing.assert_allclose(float(m[f"{kind}/{path}"]), np.sqrt(_sq64(host[path])), rtol=RTOL)
    ratio = np.sqrt(sum(_sq64(v) for v in u.values())) / np.sqrt(sum(_sq64(v) for v in p.values()))
    np.testing.assert_allclose(float(m["update_ratio"]), ratio, rtol=RTOL)
    assert m["nonfinite_grads"].dtype == jnp.int32

    assert set(norm_metrics(grads=unflatten_dict(g))) == {"grad_norm", "nonfinite_grads"}
    assert set(norm_metrics(params=unflatten_dict(p))) == {"param_norm"}
    assert set(norm_metrics(updates=unflatten_dict(u))) == {"update_norm"}
    assert set(norm_metrics(params=unflatten_dict(p), updates=unflatten_dict(u))) == {"param_norm", "update_norm", "update_ratio"}
    with pytest.raises(ValueError, match="at least one"):
        norm_metrics()
    with pytest.raises(ValueError, match="depth"):
        norm_metrics(grads=unflatten_dict(g), depth=0)


def test_bare_array_has_no_empty_per_param_key():
    # A tree that is one array has the empty path: no "grad_norm/" entry, the global norm says it all.
    x = jnp.array([3.0, 4.0])
    m = norm_metrics(grads=x, params=x, per_param=True)
    assert sorted(m) == ["grad_norm", "nonfinite_grads", "param_norm"] and float(m["grad_norm"]) == 5.0
    assert sorted(get_grad_norms(x, True, depth=2)) == ["grad_norm"]
    assert sorted(norm_metrics(grads=[x], per_param=True)) == ["grad_norm", "grad_norm/0", "nonfinite_grads",
                                                               "nonfinite_grads/0"]


def test_depth_groups_are_sqrt_of_summed_squares():
    g = _model_tree(3)
    m = jax.jit(lambda t: norm_metrics(grads=t, depth=2))(unflatten_dict(g))
    groups = {
        "encoder/layer_0": ["encoder/layer_0/w", "encoder/layer_0/b"],
        "encoder/layer_1": ["encoder/layer_1/w"],
        "decoder/layer_0": ["decoder/layer_0/w"],
        "head": ["head"],  # shorter than depth: its own group
    }
    assert set(m) == {"grad_norm", "nonfinite_grads"} | {f"{kind}/{k}" for k in groups
                                                          for kind in ("grad_norm", "nonfinite_grads")}
    for prefix, members in groups.items():
        np.testing.assert_allclose(
            float(m[f"grad_norm/{prefix}"]), np.sqrt(sum(_sq64(g[p]) for p in members)), rtol=RTOL
        )
    sum_of_norms = sum(np.sqrt(_sq64(g[p])) for p in groups["encoder/layer_0"])
    assert abs(float(m["grad_norm/encoder/layer_0"]) - sum_of_norms) > 1e-3
    m1 = norm_metrics(grads=unflatten_dict(g), params=unflatten_dict(g), depth=1)
    np.testing.assert_allclose(
        float(m1["param_norm/encoder"]), np.sqrt(sum(_sq64(v) for k, v in g.items() if k.startswith("encoder/"))),
        rtol=RTOL,
    )


def test_grad_and_param_norm_dicts():
    g = _model_tree(4)
    tree = [unflatten_dict(g), {"count": jnp.ones(2)}]  # list index in the path, like an optax state
    total = np.sqrt(sum(_sq64(v) for v in g.values()) + 2.0)
    out = get_grad_norms(tree)
    assert set(out) == {"grad_norm"}
    np.testing.assert_allclose(float(out["grad_norm"]), total, rtol=RTOL)
    out = jax.jit(lambda t: get_param_norms(t, return_per_param=True))(tree)
    assert set(out) == {"param_norm", "param_norm/1/count"} | {f"param_norm/0/{k}" for k in g}
    np.testing.assert_allclose(float(out["param_norm/0/head"]), np.sqrt(_sq64(g["head"])), rtol=RTOL)
    np.testing.assert_allclose(float(out["param_norm/1/count"]), np.sqrt(2.0), rtol=RTOL)
    # Boxes are leaves: no "/value" in the path.
    boxed = {"Dense_0": {"kernel": nn.Partitioned(jnp.ones((2, 2)), names=(None, "fsdp"))}}
    assert set(get_grad_norms(boxed, True)) == {"grad_norm", "grad_norm/Dense_0/kernel"}
    with pytest.raises(TypeError, match="`name`"):
        get_grad_norms({"name": "not an array"})


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        hnp.arrays(
            st.sampled_from([np.float32, np.float16]),
            hnp.array_shapes(min_dims=0, max_dims=3, max_side=5),
            elements=st.floats(-100, 100, width=16),
        ),
        max_size=6,
    )
)
def test_global_is_sqrt_of_summed_leaf_squares(arrays):
    tree = {f"p{i}": a for i, a in enumerate(arrays)}
    g, per = get_sharded_global_norm(tree)
    leaf_sq = [float(v) ** 2 for v in jax.tree.leaves(per)]
    np.testing.assert_allclose(float(g), np.sqrt(sum(leaf_sq)), rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(float(g), np.sqrt(sum(_sq64(a) for a in arrays)), rtol=1e-5, atol=1e-30)
    m = norm_metrics(grads=tree, depth=1, stacked=False)  # leaves that share a leading axis are no layers here
    for k, a in tree.items():
        np.testing.assert_allclose(float(m[f"grad_norm/{k}"]), np.sqrt(_sq64(a)), rtol=1e-5, atol=1e-30)


# --------------------------------------------------------------------------- #
# Clipping
# --------------------------------------------------------------------------- #


def test_clip_by_global_norm_on_sharded_boxes(setup):
    mesh, layout, host, glob = setup
    g, _ = _expected(host)
    boxed = unflatten_dict({k: nn.Partitioned(glob[k], names=spec) for k, (_, spec) in layout.items()})
    for max_norm in (g / 3, 2 * g):
        tx = clip_by_global_norm(max_norm)

        def inside(t, tx=tx):
            out, _ = tx.update(t, tx.init(t))
            return out

        specs = nn.get_partition_spec(boxed)
        clipped = _call(jax.jit(jax.shard_map(inside, mesh=mesh, in_specs=(specs,), out_specs=specs)), boxed)
        assert all(isinstance(b, nn.Partitioned) for b in jax.tree.leaves(clipped, is_leaf=is_box))
        flat = {k: np.asarray(unbox(v), np.float64) for k, v in flatten(clipped).items()}
        np.testing.assert_allclose(np.sqrt(sum(_sq64(v) for v in flat.values())), min(max_norm, g), rtol=RTOL)
        scale = min(1.0, max_norm / g)
        for k, v in flat.items():
            np.testing.assert_allclose(v, host[k].astype(np.float64) * scale, rtol=1e-5, atol=1e-6, err_msg=k)

    # Same answer as optax's own clip under jit on the global arrays.
    ours, _ = _call(jax.jit(lambda t: clip_by_global_norm(g / 3).update(t, optax.EmptyState())), unflatten_dict(glob))
    ref, _ = _call(jax.jit(lambda t: optax.clip_by_global_norm(g / 3).update(t, optax.EmptyState())), unflatten_dict(glob))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_clip_keeps_dtype_and_nnx_boxes():
    tree = {"w": nnx.Param(jnp.full((4,), 3.0, jnp.bfloat16)), "b": jnp.full((4,), 4.0, jnp.float16)}
    out, _ = clip_by_global_norm(1.0).update(tree, optax.EmptyState())
    assert isinstance(out["w"], nnx.Param)
    assert out["w"].get_value().dtype == jnp.bfloat16 and out["b"].dtype == jnp.float16
    np.testing.assert_allclose(float(get_sharded_global_norm(out)[0]), 1.0, rtol=1e-2)  # bf16/fp16 storage


# --------------------------------------------------------------------------- #
# Logging
# --------------------------------------------------------------------------- #


class _Untouchable(Mapping):
    """A metric dict that fails if anything reads it (i.e. on a would-be host sync)."""

    def __getitem__(self, k):
        raise AssertionError("metrics read on a step that is not logged")

    def __iter__(self):
        raise AssertionError("metrics read on a step that is not logged")

    def __len__(self):
        raise AssertionError("metrics read on a step that is not logged")


def test_metrics_logger_writes_on_due_steps_only(tmp_path):
    seen = []
    log = MetricsLogger(lambda step, m: seen.append((step, m)), every=3)
    m = jax.jit(lambda t: norm_metrics(grads=t))({"w": jnp.array([3.0, 4.0])})
    for step in range(10):
        if step % 3:
            assert log(step, _Untouchable()) is False
        else:
            assert log(step, m) is True
    assert [s for s, _ in seen] == [0, 3, 6, 9]
    assert seen[0][1] == {"grad_norm": 5.0, "nonfinite_grads": 0}
    assert type(seen[0][1]["grad_norm"]) is float and type(seen[0][1]["nonfinite_grads"]) is int

    path = tmp_path / "logs" / "metrics.jsonl"
    log = MetricsLogger(str(path), every=2)
    for step in range(5):
        log(step, {"grad_norm": jnp.float32(step), "loss": jnp.array(np.nan)})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2, 4]
    assert [line["grad_norm"] for line in lines] == [0.0, 2.0, 4.0]
    assert lines[0]["loss"] is None  # strict JSON: NaN is null, its kind recorded; read back as a float NaN
    assert np.isnan(read_metrics(str(path))[0]["loss"])
    JsonlWriter(path)(6, {"x": 1.0})  # appends
    assert json.loads(path.read_text().splitlines()[-1]) == {"step": 6, "x": 1.0}

    with pytest.raises(ValueError, match="every"):
        MetricsLogger(print, every=0)
    with pytest.raises(TypeError, match="writer"):
        MetricsLogger(3)
