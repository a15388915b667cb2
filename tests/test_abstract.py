import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treetools as tt
from tests import _models


def test_make_abstract_one_sharding_on_8_devices(devices):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tree = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": np.zeros(4, np.int32), "name": "x"}
    rep = NamedSharding(mesh, P())
    ab = tt.make_abstract(tree, rep)
    assert ab["w"] == jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=rep)
    assert ab["b"].dtype == np.int32 and ab["b"].sharding == rep
    assert ab["name"] == "x"


def test_make_abstract_tree_of_shardings_and_boxes(devices):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    variables = _models.BoxedMLP().init(jax.random.key(0), jnp.ones((1, 32)))
    ab = tt.make_abstract(variables, mesh=mesh)
    k = ab["params"]["in"]["kernel"]
    assert isinstance(k, nn.Partitioned) and isinstance(k.value, jax.ShapeDtypeStruct)
    assert k.value.sharding == NamedSharding(mesh, P("fsdp", "tp")) and k.value.shape == (32, 64)
    # Tree of PartitionSpecs with the mesh.
    specs = {"a": P("fsdp"), "b": P(None, "tp")}
    ab2 = tt.make_abstract({"a": np.ones(8), "b": np.ones((2, 8))}, specs, mesh=mesh)
    assert ab2["b"].sharding.spec == P(None, "tp")
    with pytest.raises(ValueError, match="pass `mesh=`"):
        tt.make_abstract({"a": np.ones(8)}, {"a": P("fsdp")})


def test_make_abstract_keeps_own_sharding(devices):
    mesh = jax.make_mesh((8,), ("fsdp",))
    arr = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("fsdp")))
    assert tt.make_abstract({"x": arr})["x"].sharding == arr.sharding
    sds = jax.ShapeDtypeStruct((3,), jnp.float32)
    assert tt.make_abstract(sds).shape == (3,)


def test_replicate_places_every_leaf(devices):
    mesh = jax.make_mesh((8,), ("data",))
    host = {"w": np.arange(12.0).reshape(3, 4), "box": nn.Partitioned(np.ones(5), names=(None,))}
    out = tt.replicate(host, NamedSharding(mesh, P()))
    assert out["w"].sharding.is_fully_replicated and len(out["w"].addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(out["w"]), host["w"])
    assert isinstance(out["box"], nn.Partitioned) and out["box"].value.sharding.is_fully_replicated
    sharded = tt.replicate({"w": np.arange(16.0)}, NamedSharding(mesh, P("data")))["w"]
    assert sharded.addressable_shards[3].data.tolist() == [6.0, 7.0]
    with pytest.raises(TypeError, match="`sharding` must be"):
        tt.replicate(host, "data")


def test_update_ema_stable_form_and_dtype():
    ema = {"w": jnp.full((4,), 1.0, jnp.bfloat16), "v": jnp.full((3,), 2.0)}
    params = {"w": jnp.full((4,), 3.0, jnp.bfloat16), "v": jnp.full((3,), 4.0)}
    out = tt.update_ema(ema, params, 0.75)
    assert out["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out["v"]), 2.0 - 0.25 * (2.0 - 4.0))
    np.testing.assert_allclose(np.asarray(out["w"], np.float32), 1.5)
    # decay close to 1: the stable form moves by exactly (1-decay)*delta in float32.
    e = tt.update_ema({"x": jnp.float32(1.0)}, {"x": jnp.float32(2.0)}, 0.9999)["x"]
    np.testing.assert_allclose(float(e), 1.0 + 1e-4, rtol=1e-6)
    boxed = tt.update_ema({"k": nn.Partitioned(jnp.zeros(2), names=(None,))},
                          {"k": nn.Partitioned(jnp.ones(2), names=(None,))}, 0.5)
    np.testing.assert_allclose(np.asarray(boxed["k"].value), 0.5)
    jitted = jax.jit(tt.update_ema)(ema, params, jnp.float32(0.75))
    np.testing.assert_array_equal(np.asarray(jitted["v"]), np.asarray(out["v"]))


def test_update_ema_bf16_is_correctly_rounded():
    # The difference is taken in float32: a bf16 `ema - params` would round the step itself
    # (about 1 in 400 elements at decay 0.5 came out one bf16 ulp off).
    rng = np.random.default_rng(0)
    e = rng.normal(size=20000).astype(jnp.bfloat16)
    p = (e.astype(np.float64) + rng.normal(size=20000) * 0.01).astype(jnp.bfloat16)
    for decay in (0.5, 0.9):
        e64, p64 = e.astype(np.float64), p.astype(np.float64)
        want = (e64 - (1 - decay) * (e64 - p64)).astype(jnp.bfloat16)  # float64, rounded once to bf16
        got = np.asarray(tt.update_ema({"w": jnp.asarray(e)}, {"w": jnp.asarray(p)}, decay)["w"])
        np.testing.assert_array_equal(got, want)


def test_replicate_refuses_abstract_leaves(devices):
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(TypeError, match=r"leaf `layers/0/w` is a ShapeDtypeStruct"):
        tt.replicate({"layers": [{"w": jax.ShapeDtypeStruct((2,), jnp.float32)}]}, mesh)
