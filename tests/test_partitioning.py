import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treetools as tt
from treetools.pytree import partitioning as pt


def test_is_partitioned_kinds():
    assert tt.is_partitioned(nn.Partitioned(jnp.ones(2), names=("a",)))
    assert tt.is_partitioned(nn.LogicallyPartitioned(jnp.ones(2), names=("embed",)))
    assert tt.is_partitioned(nnx.Param(jnp.ones(2), out_sharding=("a",), eager_sharding=False))
    assert not tt.is_partitioned(nnx.Param(jnp.ones(2)))
    assert pt.is_box(nnx.Param(jnp.ones(2)))
    assert not tt.is_partitioned(jnp.ones(2)) and not tt.is_partitioned(None)


def test_logical_names_use_context_rules():
    box = nn.LogicallyPartitioned(np.ones((4, 4)), names=("embed", "mlp"))
    with nn.logical_axis_rules((("embed", "fsdp"), ("mlp", None))):
        assert tt.leaf_sharding(box, mesh={"fsdp": 2}).spec == P("fsdp", None)


def test_array_and_struct_shardings(devices):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    arr = jax.device_put(np.ones((4, 8)), NamedSharding(mesh, P(None, "model")))
    info = tt.leaf_sharding(arr)
    assert info.to_json() == {"mesh": {"data": 2, "model": 4}, "spec": [None, "model"]}
    sds = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P(("data", "model"))))
    assert pt.shard_shape(sds) == (1, 8)
    assert tt.leaf_sharding(np.ones(3)) is None
    assert pt.mesh_axes_of(("data", "model")) == ("data", "model") and pt.mesh_axes_of(None) == ()


def test_unbox_tree_and_rebox():
    var = nnx.Param(jnp.ones(2), out_sharding=("a",), eager_sharding=False)
    tree = {"v": var, "p": nn.Partitioned(jnp.zeros(3), names=("a",)), "x": 1}
    plain = tt.unbox_tree(tree)
    assert plain["v"].shape == (2,) and plain["p"].shape == (3,) and plain["x"] == 1
    assert pt.rebox(var, 5).get_metadata()["out_sharding"] == ("a",)
    assert pt.rebox(tree["p"], 5).names == ("a",) and pt.rebox(1, 5) == 5


# --------------------------------------------------------------------------- #
# Spec rules are flax's own (issue 14): nnx through get_var_pspec, linen through logical_to_mesh_axes
# --------------------------------------------------------------------------- #

RULES = (("embed", "fsdp"), ("mlp", None))


def test_nnx_logical_names_follow_flax_get_var_pspec(devices):
    mesh = jax.make_mesh((8,), ("fsdp",))
    with nn.logical_axis_rules(RULES):
        param = nnx.Param(np.ones((8, 4), np.float32), out_sharding=("embed", "mlp"), eager_sharding=False)
        assert nnx.spmd.get_var_pspec(param) == P("fsdp", None)
        assert tt.leaf_sharding(param).spec == nnx.spmd.get_var_pspec(param)
        held = jax.device_put(np.ones((8, 4)), NamedSharding(mesh, nnx.spmd.get_var_pspec(param)))
        assert tt.get_num_params({"p": param}, per_device=True, mesh=mesh) == held.addressable_shards[0].data.size
    # The Variable's own sharding_rules, without a context.
    local = nnx.Param(np.ones((8, 4), np.float32), out_sharding=("embed", "mlp"), sharding_rules=RULES,
                      eager_sharding=False)
    assert tt.leaf_sharding(local).spec == nnx.spmd.get_var_pspec(local) == P("fsdp", None)
    assert tt.get_num_params({"p": local}, per_device=True, mesh=mesh) == 4


def test_nnx_state_specs_match_flax_get_partition_spec(devices):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    with nn.logical_axis_rules((("embed", "fsdp"), ("hidden", "tp"))), jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: nnx.Linear(
            8, 16, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden")),
            rngs=nnx.Rngs(0)))
        state = nnx.state(abstract)
        flax_specs = tt.flatten(nnx.get_partition_spec(state))
        for path, var in tt.flatten(state).items():
            if tt.is_partitioned(var):
                assert tt.leaf_sharding(var).spec == flax_specs[path].get_value(), path
        assert tt.leaf_sharding(state["kernel"]).spec == P("fsdp", "tp")


def test_linen_logical_names_follow_flax_logical_to_mesh_axes():
    names = ("embed", "mlp", "heads")
    rules = (("embed", "fsdp"), ("mlp", "tp"), ("heads", "tp"))  # "tp" taken by mlp first: heads replicated
    box = nn.LogicallyPartitioned(np.ones((4, 4, 4)), names=names)
    with nn.logical_axis_rules(rules):
        assert tt.leaf_sharding(box).spec == nn.logical_to_mesh_axes(names) == P("fsdp", "tp", None)
    own = nn.LogicallyPartitioned(np.ones((4, 4, 4)), names=names, rules=rules)
    assert tt.leaf_sharding(own).spec == nn.logical_to_mesh_axes(names, rules)
    # A plain Partitioned box: flax's get_partition_spec.
    plain = nn.Partitioned(np.ones((4, 4)), names=("fsdp", None))
    assert tt.leaf_sharding(plain).spec == nn.get_partition_spec({"w": plain})["w"]


def test_box_spec_and_own_sharding(devices):
    mesh = jax.make_mesh((8,), ("fsdp",))
    arr = jax.device_put(np.ones((8, 2)), NamedSharding(mesh, P()))
    box = nn.Partitioned(arr, names=("fsdp", None))
    assert pt.box_spec(box) == P("fsdp", None)  # what the names say
    assert pt.own_sharding(box) == arr.sharding  # where the array is
    # Where the array is wins (the table's sharding column): replicated, on the array's mesh.
    assert tt.leaf_sharding(box).mesh == {"fsdp": 8} and tt.leaf_sharding(box).spec == P()
    # An unplaced box (numpy) answers with its names.
    assert tt.leaf_sharding(nn.Partitioned(np.ones((8, 2)), names=("fsdp", None))).spec == P("fsdp", None)
    assert pt.box_spec(arr) is None and pt.own_sharding(np.ones(2)) is None


def test_params_of_states():
    from flax.training import train_state
    import optax

    params = {"w": jnp.ones(3)}
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    assert pt.params_of(ts) is params
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    assert set(tt.flatten(pt.params_of(model))) == {"bias", "kernel"}
    state = nnx.state(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    assert pt.params_of(state) is state and pt.params_of(params) is params
