import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
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


# --------------------------------------------------------------------------- #
# make_abstract(mesh=) puts every leaf on the mesh; sharding prefixes; AbstractMesh targets (issue 14)
# --------------------------------------------------------------------------- #


def _device_sets(tree):
    return {tt.unbox(x).sharding.device_set == frozenset(x for x in jax.devices())
            for x in jax.tree.leaves(tree, is_leaf=tt.is_box)}


def test_make_abstract_mesh_puts_unboxed_leaves_on_the_mesh_and_restore_jits(devices, tmp_path):
    # Auto axes: GSPMD picks the activations' layout, as in the classic linen FSDP setup.
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    model, x = _models.DenseKernelsBoxed(), jnp.ones((2, 16))
    params = model.init(jax.random.key(0), x)["params"]  # kernels boxed, biases unboxed; all on device 0
    target = tt.make_abstract(params, mesh=mesh)
    flat = tt.flatten(target)
    for path, leaf in flat.items():
        assert tt.unbox(leaf).sharding.mesh == mesh, path
    assert flat["up/bias"].sharding == NamedSharding(mesh, P())  # unboxed: replicated on the mesh
    assert flat["up/kernel"].value.sharding == NamedSharding(mesh, P(None, "fsdp"))  # boxed: per its names
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "ckpt")
    tt.save_checkpoint(mngr, 1, {"params": params}, wait=True)
    restored = tt.restore_checkpoint(mngr, "latest", {"params": target})["params"]
    mngr.close()
    assert _device_sets(restored) == {True}
    # jax.jit takes the restored tree (before: "incompatible devices", biases on device 0).
    out = jax.jit(lambda p: model.apply({"params": p}, x))(restored)
    np.testing.assert_allclose(np.asarray(out), np.asarray(model.apply({"params": params}, x)), rtol=1e-5)


def test_make_abstract_mesh_keeps_specs_of_arrays_from_another_mesh(devices):
    old = jax.make_mesh((8,), ("fsdp",))
    new = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    tree = {"w": jax.device_put(np.ones((8, 4)), NamedSharding(old, P("fsdp"))), "n": np.ones(3)}
    ab = tt.make_abstract(tree, mesh=new)
    assert ab["w"].sharding == NamedSharding(new, P("fsdp")) and ab["n"].sharding == NamedSharding(new, P())
    other = jax.make_mesh((8,), ("data",))
    with pytest.warns(UserWarning, match=r"`w` P\('fsdp',\) -> P\(None,\) \(replicated\)"):
        assert tt.make_abstract(tree, mesh=other)["w"].sharding == NamedSharding(other, P(None))


def test_make_abstract_carries_a_trained_layout_onto_another_mesh(devices):
    # Issue 39, point 19: params trained on a (data, fsdp) mesh, where XLA laid out an unboxed bias as P('data',),
    # refused on a mesh without `data` ("has no such axes"). Each dimension keeps the axes the new mesh has (where
    # they still divide it); the rest is replicated, and one warning names the leaves.
    train_mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    host = {"block_0": {"down": {"bias": np.arange(8.0, dtype=np.float32),            # XLA: P('data',)
                                 "kernel": np.arange(64.0, dtype=np.float32).reshape(8, 8)},  # P(None, 'fsdp')
                        "both": np.arange(16.0, dtype=np.float32),                       # P(('data', 'fsdp'),)
                        "odd": np.arange(12.0, dtype=np.float32).reshape(4, 3)},        # P('fsdp', None)
            "step": np.int32(7)}
    specs = {"block_0": {"down": {"bias": P("data"), "kernel": P(None, "fsdp")}, "both": P(("data", "fsdp")),
                         "odd": P("fsdp", None)}, "step": P()}
    trained = jax.jit(lambda t: t, out_shardings=jax.tree.map(lambda p: NamedSharding(train_mesh, p), specs))(host)
    mesh = jax.make_mesh((8,), ("fsdp",))
    with pytest.warns(UserWarning) as caught:
        target = tt.make_abstract(trained, mesh=mesh)
    (warning,) = caught
    assert warning.filename == __file__  # stacklevel=2: the caller's line
    assert str(warning.message).splitlines() == [
        "make_abstract: 3 leaves laid out on another mesh do not fit the mesh {'fsdp': 8} as they were "
        "(2 now replicated); their layout here:",
        "  `block_0/both` P(('data', 'fsdp'),) -> P('fsdp',)",
        "  `block_0/down/bias` P('data',) -> P(None,) (replicated)",
        "  `block_0/odd` P('fsdp', None) -> P(None, None) (replicated)",  # 4 rows do not split 8 ways
        "Pass `sharding=` (a tree or prefix of shardings) to lay them out otherwise.",
    ]
    want = {"block_0/down/bias": P(None), "block_0/down/kernel": P(None, "fsdp"), "block_0/both": P(("fsdp",)),
            "block_0/odd": P(None, None), "step": P()}
    assert {k: v.sharding for k, v in tt.flatten(target).items()} == {k: NamedSharding(mesh, p) for k, p in want.items()}
    # The target places the trained values: every leaf on all 8 devices of the new mesh, values unchanged.
    placed = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), trained, target)
    for path, x in tt.flatten(placed).items():
        assert x.sharding.mesh == mesh, path
        np.testing.assert_array_equal(np.asarray(x), tt.flatten(host)[path])
    # A layout that carries over whole warns nothing (filterwarnings=error would raise).
    same_names = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[::-1])
    tt.make_abstract(trained, mesh=same_names)


def test_make_abstract_accepts_a_tree_prefix_of_shardings_as_jit_does(devices):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tree = {"params": {"w": np.ones((8, 4), np.float32), "b": np.ones(4, np.float32)},
            "opt": [np.ones((8, 4), np.float32), np.zeros((), np.int32)]}
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    prefix = {"params": rows, "opt": [rep, None]}
    # jax.jit accepts this prefix as out_shardings (a None entry: jit's choice; make_abstract: the leaf's own).
    jitted = jax.jit(lambda: jax.tree.map(jnp.asarray, tree), out_shardings={"params": rows, "opt": rep})()
    ab = tt.make_abstract(tree, prefix)
    assert ab["params"]["w"].sharding == jitted["params"]["w"].sharding == rows
    assert ab["params"]["b"].sharding == rows and ab["opt"][0].sharding == rep
    assert ab["opt"][1].sharding is None
    # nn.get_sharding on boxed params (boxes become shardings) and nnx's Variables holding shardings.
    boxed = jax.eval_shape(_models.BoxedMLP().init, jax.random.key(0), jnp.ones((1, 32)))
    mesh2 = jax.make_mesh((2, 4), ("fsdp", "tp"))
    ab_boxed = tt.make_abstract(boxed, nn.get_sharding(boxed, mesh2))
    assert ab_boxed["params"]["in"]["kernel"].value.sharding == NamedSharding(mesh2, P("fsdp", "tp"))
    with jax.set_mesh(mesh2):
        state = nnx.state(nnx.eval_shape(lambda: _models.NnxNet(nnx.Rngs(0))))
    ab_nnx = tt.make_abstract(state, nnx.get_named_sharding(state, mesh2))
    assert ab_nnx["up"]["kernel"].get_value().sharding == NamedSharding(mesh2, P("fsdp", None))
    with pytest.raises(ValueError, match="prefix"):
        tt.make_abstract(tree, {"params": rep})


def test_make_abstract_incompatible_sharding_names_the_leaf(devices):
    mesh = jax.make_mesh((8,), ("fsdp",))
    tree = {"layers": [{"w": np.ones((3, 8))}]}
    with pytest.raises(ValueError, match=r"leaf `layers/0/w` \(float64\[3, 8\]\).*divide"):
        tt.make_abstract(tree, NamedSharding(mesh, P("fsdp")))
    with pytest.raises(ValueError, match=r"leaf `layers/0/w`.*rank"):
        tt.make_abstract(tree, {"layers": [{"w": NamedSharding(mesh, P(None, None, "fsdp"))}]})
    with pytest.raises(ValueError, match=r"leaf `layers/0/w`.*tp"):
        tt.make_abstract(tree, P(None, "tp"), mesh=mesh)
    boxed = {"k": nn.Partitioned(np.ones((4, 4)), names=("tp", None))}
    with pytest.raises(ValueError, match=r"leaf `k`"):
        tt.make_abstract(boxed, mesh=mesh)


def test_make_abstract_resolves_abstract_mesh_shardings_against_the_active_mesh(devices):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(mesh):
        state = nnx.state(nnx.eval_shape(lambda: _models.NnxNet(nnx.Rngs(0))))
    kernel = state["up"]["kernel"].get_value()
    assert isinstance(kernel.sharding.mesh, jax.sharding.AbstractMesh)
    with jax.set_mesh(mesh):
        ab = tt.make_abstract(state)
    for path, leaf in tt.flatten(ab).items():
        sharding = tt.unbox(leaf).sharding
        assert isinstance(sharding.mesh, jax.sharding.Mesh) and sharding.mesh == mesh, path
    assert ab["up"]["kernel"].get_value().sharding == NamedSharding(mesh, P("fsdp", None))
    assert tt.make_abstract(state, mesh=mesh)["up"]["kernel"].get_value().sharding.mesh == mesh
    with pytest.raises(ValueError, match=r"leaf `\w+/\w+`.*AbstractMesh.*jax.set_mesh"):
        tt.make_abstract(state)


def test_restore_into_nnx_eval_shape_targets_under_set_mesh(devices, tmp_path):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(mesh):
        model = _models.NnxNet(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "ckpt")
    tt.save_checkpoint(mngr, 1, {"params": params}, wait=True)
    mngr.close()
    with jax.set_mesh(mesh):
        target = nnx.state(nnx.eval_shape(lambda: _models.NnxNet(nnx.Rngs(1))), nnx.Param)
        restored = tt.restore_checkpoint(tmp_path / "ckpt", "latest", {"params": target})["params"]
    for path, leaf in tt.flatten(restored).items():
        value, saved = leaf.get_value(), tt.flatten(params)[path].get_value()
        np.testing.assert_array_equal(np.asarray(value), np.asarray(saved), err_msg=path)
        assert value.sharding == saved.sharding, path
