import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treetools as tt
from treetools import partitioning as pt


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
