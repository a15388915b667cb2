import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treetools as tt
from tests import _models
from tests._models import NET_PARAMS


def test_counts_of_flax_model_match_hand_derived():
    variables = _models.init_net()
    assert tt.get_num_params(variables) == NET_PARAMS == 16362
    assert tt.get_num_bytes(variables) == 4 * NET_PARAMS


def test_counts_of_adamw_state():
    params = _models.init_net()["params"]
    state = optax.adamw(1e-3).init(params)
    # mu + nu (float32 each) + the int32 step count; EmptyStates add nothing.
    assert tt.get_num_params(state) == 2 * NET_PARAMS + 1
    assert tt.get_num_bytes(state) == 4 * (2 * NET_PARAMS + 1)


def test_abstract_counts_equal_concrete():
    abstract = jax.eval_shape(lambda: _models.init_net())
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert tt.get_num_params(abstract) == NET_PARAMS


def test_non_array_leaves_count_zero():
    tree = {"none": None, "name": "adamw", "lr": 3e-4, "empty": optax.EmptyState(), "x": jnp.zeros((2, 2), jnp.bfloat16)}
    assert tt.get_num_params(tree) == 4
    assert tt.get_num_bytes(tree) == 8
    assert tt.get_num_params({}) == 0 == tt.get_num_bytes([])


def test_7b_abstract_model_without_allocation():
    d, ff, vocab, layers = 4096, 11008, 32000, 32

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            for name in ("q", "k", "v", "o"):
                x = nn.Dense(d, use_bias=False, name=name)(x)
            h = nn.Dense(ff, use_bias=False, name="gate")(x) * nn.Dense(ff, use_bias=False, name="up")(x)
            x = nn.Dense(d, use_bias=False, name="down")(h)
            x = nn.RMSNorm(name="attn_norm")(x)
            return nn.RMSNorm(name="mlp_norm")(x), None

    class Llama(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, d)(tokens)
            x, _ = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers)()(x, None)
            return nn.Dense(vocab, use_bias=False)(nn.RMSNorm()(x))

    abstract = jax.eval_shape(Llama().init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    # 32 * (4*d*d + 3*d*ff + 2*d) + embed + head + final norm = the LLaMA-7B count.
    expected = layers * (4 * d * d + 3 * d * ff + 2 * d) + 2 * vocab * d + d
    assert expected == 6_738_415_616
    assert tt.get_num_params(abstract) == expected
    assert tt.get_num_bytes(abstract) == 4 * expected


def test_per_device_fsdp_kernel_example():
    mesh = jax.make_mesh((8,), ("fsdp",))
    kernel = jax.ShapeDtypeStruct((4096, 4096), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
    assert tt.get_num_params(kernel, per_device=True) == 2_097_152  # 4096*4096/8
    assert tt.get_num_bytes(kernel, per_device=True) == 4 * 2_097_152


@pytest.mark.parametrize("shape,axes", [((8,), ("fsdp",)), ((2, 4), ("fsdp", "tp")), ((4, 2), ("fsdp", "tp"))])
def test_per_device_matches_addressable_shards(devices, shape, axes):
    mesh = jax.make_mesh(shape, axes)
    tp = "tp" if "tp" in axes else None
    specs = {"fsdp": P("fsdp", None), "tp": P(None, tp), "both": P("fsdp", tp), "repl": P(), "vec": P(tp)}
    arrays = {
        name: jax.device_put(np.ones((16, 32) if name != "vec" else (24,), np.float32), NamedSharding(mesh, spec))
        for name, spec in specs.items()
    }
    expected = sum(a.addressable_shards[0].data.size for a in arrays.values())
    assert tt.get_num_params(arrays, per_device=True) == expected
    assert tt.get_num_bytes(arrays, per_device=True) == 4 * expected
    # The same layout written as boxes with a mesh gives the same answer.
    boxed = {n: nn.Partitioned(np.ones(a.shape, np.float32), names=tuple(specs[n]) + (None,) * (a.ndim - len(specs[n])))
             for n, a in arrays.items()}
    assert tt.get_num_params(boxed, per_device=True, mesh=mesh) == expected


def test_per_device_boxed_flax_model_and_logical_names(devices):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    variables = _models.BoxedMLP().init(jax.random.key(0), jnp.ones((1, 32)))
    # in: kernel (32,64)/(2*4) + bias 64/4; ln: 64 + 64; out: kernel (64,16)/(4*2) + bias 16
    expected = 32 * 64 // 8 + 64 // 4 + 64 + 64 + 64 * 16 // 8 + 16
    assert tt.get_num_params(variables, per_device=True, mesh=mesh) == expected
    with jax.set_mesh(mesh):
        assert tt.get_num_params(variables, per_device=True) == expected
    logical = {"w": nn.LogicallyPartitioned(np.ones((16, 8)), names=("embed", "mlp"),
                                            rules=(("embed", "fsdp"), ("mlp", "tp")))}
    assert tt.get_num_params(logical, per_device=True, mesh=mesh) == 16 * 8 // 8


def test_per_device_without_mesh_is_a_clear_error():
    boxed = {"w": nn.Partitioned(np.ones((4, 4)), names=("fsdp", None))}
    with pytest.raises(ValueError, match="mesh axis `fsdp`.*pass `mesh=`"):
        tt.get_num_params(boxed, per_device=True)


def test_nnx_variables_per_device():
    state = {"w": nnx.Param(jnp.ones((8, 6)), out_sharding=("fsdp", None), eager_sharding=False),
             "s": nnx.BatchStat(jnp.ones(6))}
    assert tt.get_num_params(state) == 54
    assert tt.get_num_params(state, per_device=True, mesh={"fsdp": 4}) == 2 * 6 + 6


def test_uneven_split_rounds_up():
    boxed = {"w": nn.Partitioned(np.ones((10, 3)), names=("fsdp", None))}
    assert tt.get_num_params(boxed, per_device=True, mesh={"fsdp": 4}) == 3 * 3  # ceil(10/4)=3 rows


_arrays = st.lists(st.integers(0, 4), max_size=3).map(lambda s: np.zeros(s, np.float16))
_trees = st.recursive(_arrays, lambda c: st.one_of(st.dictionaries(st.sampled_from("abcd"), c, max_size=3),
                                                   st.lists(c, max_size=3)), max_leaves=15)


@settings(max_examples=60, deadline=None)
@given(_trees, st.booleans())
def test_count_equals_numpy_size(tree, boxed):
    if boxed:
        tree = jax.tree.map(lambda x: nn.Partitioned(x, names=(None,) * x.ndim), tree)
    plain = tt.unbox_tree(tree)
    assert tt.get_num_params(tree) == sum(np.size(x) for x in jax.tree.leaves(plain))
    assert tt.get_num_bytes(tree) == sum(np.size(x) * 2 for x in jax.tree.leaves(plain))
    assert tt.get_num_params(tree) == sum(math.prod(x.shape) for x in jax.tree.leaves(plain))
