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
    # Unplaced (jax.eval_shape): the box names and the mesh say what each device will hold.
    variables = jax.eval_shape(_models.BoxedMLP().init, jax.random.key(0), jnp.ones((1, 32)))
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


def test_nnx_variables_per_device(devices):
    # Unplaced (numpy): the names and the mesh say it.
    state = {"w": nnx.Param(np.ones((8, 6), np.float32), out_sharding=("fsdp", None), eager_sharding=False),
             "s": nnx.BatchStat(np.ones(6, np.float32))}
    assert tt.get_num_params(state) == 54
    assert tt.get_num_params(state, per_device=True, mesh={"fsdp": 4}) == 2 * 6 + 6
    # Placed on device 0: device 0 holds all of it, whatever the names say.
    placed = jax.tree.map(jnp.asarray, state)
    assert tt.get_num_params(placed, per_device=True, mesh={"fsdp": 4}) == _held(placed) == 54


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


# --------------------------------------------------------------------------- #
# Per device: a placed array counts what each device really holds (issue 14)
# --------------------------------------------------------------------------- #


def _held(tree, unit="size"):
    """The truth: jax's own addressable shards, summed per device (elements, or ``unit="nbytes"``); the most
    any device holds."""
    per_device = {}
    for leaf in jax.tree.leaves(tt.unbox_tree(tree)):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + getattr(shard.data, unit)
    return max(per_device.values())


def test_per_device_linen_fsdp_recipe_reads_the_arrays_shardings(devices):
    # The standard recipe: init under jit with out_shardings from nn.get_sharding. The boxes carry no mesh;
    # the arrays do, and that is enough (no `mesh=` needed).
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    model, x = _models.BoxedMLP(), jnp.ones((1, 32))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    variables = jax.jit(model.init, out_shardings=nn.get_sharding(abstract, mesh))(jax.random.key(0), x)
    assert all(leaf.mesh is None for leaf in jax.tree.leaves(variables, is_leaf=tt.is_box))
    assert tt.get_num_params(variables, per_device=True) == _held(variables) == 544
    assert tt.get_num_bytes(variables, per_device=True) == _held(variables, "nbytes")
    # The plan (abstract, names + mesh) and the placed arrays agree.
    assert tt.get_num_params(abstract, per_device=True, mesh=mesh) == _held(variables)


def test_per_device_boxed_tree_on_one_device_counts_everything(devices):
    # model.init without jit: every buffer sits on device 0, whatever the names say.
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    variables = _models.BoxedMLP().init(jax.random.key(0), jnp.ones((1, 32)))
    assert _held(variables) == tt.get_num_params(variables) == 3280
    assert tt.get_num_params(variables, per_device=True, mesh=mesh) == _held(variables)
    on_3 = jax.device_put(variables, devices[3])
    assert tt.get_num_bytes(on_3, per_device=True, mesh=mesh) == _held(on_3, "nbytes") == 4 * 3280


def test_per_device_is_the_fullest_device_not_a_sum_of_largest_shards(devices):
    # Two leaves on two different devices: each device holds one of them.
    tree = {"a": jax.device_put(np.ones(10, np.float32), devices[0]),
            "b": jax.device_put(np.ones(6, np.float32), devices[1])}
    assert tt.get_num_params(tree, per_device=True) == _held(tree) == 10


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_per_device_box_names_do_not_override_a_replicated_array(devices, kind):
    mesh = jax.make_mesh((8,), ("fsdp",))
    arr = jax.device_put(np.ones((16, 16), np.float32), NamedSharding(mesh, P()))
    box = (nn.Partitioned(arr, names=("fsdp", None)) if kind == "linen"
           else nnx.Param(arr, out_sharding=("fsdp", None), eager_sharding=False))
    assert tt.get_num_params({"w": box}, per_device=True, mesh=mesh) == _held({"w": box}) == 256
    # The table's sharding column says the same: where the array is.
    row = tt.tabulate_params({"w": box}, tablefmt="tsv").splitlines()[1].split("\t")
    assert row[5].strip() == "replicated"


def test_per_device_nnx_state_after_replicate(devices):
    mesh = jax.make_mesh((8,), ("fsdp",))
    with jax.set_mesh(mesh):
        model = _models.NnxNet(nnx.Rngs(0))
    state = tt.replicate(nnx.state(model), mesh)  # every array whole on every device, names unchanged
    assert tt.get_num_params(state, per_device=True) == _held(state) == _models.NNX_STATE
    assert tt.get_num_bytes(state, per_device=True) == _held(state, "nbytes")


def test_per_device_nnx_module_created_under_set_mesh(devices):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    with jax.set_mesh(mesh):
        model = _models.NnxNet(nnx.Rngs(0))
    # Outside the mesh context, no mesh argument: the arrays know where they are.
    state = nnx.state(model)
    assert tt.get_num_params(state, per_device=True) == _held(state)
    assert tt.get_num_bytes(state, per_device=True) == _held(state, "nbytes")
    params = nnx.state(model, nnx.Param)
    assert tt.get_num_params(model, per_device=True) == _held(params) == _models.NNX_PARAMS - 8 * 16 // 2  # the kernel halved over fsdp=2
    # The abstract model (nnx.eval_shape under the mesh) plans the same layout.
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: _models.NnxNet(nnx.Rngs(0)))
    assert tt.get_num_params(nnx.state(abstract, nnx.Param), per_device=True) == _held(params)


# --------------------------------------------------------------------------- #
# Typed PRNG keys, TrainState and nnx Modules
# --------------------------------------------------------------------------- #


def test_typed_prng_keys_count_their_real_bytes(devices):
    key = jax.random.key(0)
    assert tt.get_num_bytes({"rng": key}) == key.nbytes == 8
    assert tt.get_num_params({"rng": key}) == key.size == 1
    rbg = jax.random.key(0, impl="rbg")
    keys = jax.random.split(key, 8)
    tree = {"rbg": rbg, "keys": keys, "raw": jax.random.PRNGKey(1)}
    assert tt.get_num_bytes(tree) == rbg.nbytes + keys.nbytes + 8
    mesh = jax.make_mesh((8,), ("data",))
    sharded = {"keys": jax.device_put(keys, NamedSharding(mesh, P("data")))}
    assert tt.get_num_bytes(sharded, per_device=True) == _held(sharded, "nbytes") == 8
    assert tt.get_num_bytes(jax.eval_shape(lambda: tree)) == tt.get_num_bytes(tree)


def test_tabulate_nnx_state_with_dropout_rngs():
    with jax.set_mesh(jax.make_mesh((8,), ("fsdp",))):
        model = _models.NnxNet(nnx.Rngs(0))
    state = nnx.state(model)
    text = tt.tabulate_params(state, tablefmt="tsv")
    rows = {r[0]: r for r in ([f.strip() for f in line.split("\t")] for line in text.split("\n\n")[0].splitlines()[1:])}
    key = state["drop"]["rngs"]["key"].get_value()
    assert rows["drop/rngs/key"][2] == str(key.dtype) and rows["drop/rngs/key"][4] == f"{key.nbytes} B"
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    assert f"Total: {_models.NNX_STATE:,} params, {total:,} bytes" in text
    assert tt.get_num_bytes(state) == total


def test_train_state_counts_its_params_as_the_table_shows():
    from flax.training import train_state

    params = nn.Dense(4).init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    assert tt.get_num_params(state) == tt.get_num_params(params) == 16  # not 49 (mu, nu, count, step)
    assert f"Total: {tt.get_num_params(state)} params, {tt.get_num_bytes(state)} bytes" in tt.tabulate_params(state)
    assert tt.get_num_params(state.opt_state) == 33  # the optimizer moments, when asked for


def test_nnx_module_counts_params_only_as_the_table_shows():
    with jax.set_mesh(jax.make_mesh((8,), ("fsdp",))):
        model = _models.NnxNet(nnx.Rngs(0))
    assert tt.get_num_params(model) == _models.NNX_PARAMS == 244  # not the BatchStats and RNG state
    assert tt.get_num_params(nnx.state(model)) == _models.NNX_STATE
    table = tt.tabulate_params(model)
    assert f"Total: {tt.get_num_params(model)} params, {tt.get_num_bytes(model):,} bytes" in table
    assert tt.get_num_bytes(model) == sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_per_device_struct_with_an_uneven_split_on_a_concrete_mesh_rounds_up(devices):
    # A plan (struct) whose split is uneven: jax cannot place it, the count rounds up as for boxes.
    # (10, 6) over P("model", "data") on a (2, 4) mesh: ceil(10 / 4) * ceil(6 / 2) = 3 * 3 = 9.
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    struct = jax.ShapeDtypeStruct((10, 6), jnp.float32, sharding=NamedSharding(mesh, P("model", "data")))
    on_abstract = jax.ShapeDtypeStruct((10, 6), jnp.float32, sharding=NamedSharding(mesh.abstract_mesh, P("model", "data")))
    assert tt.get_num_params({"emb": struct}, per_device=True) == 9
    assert tt.get_num_params({"emb": on_abstract}, per_device=True) == 9
    assert tt.get_num_bytes({"emb": struct}, per_device=True) == 36
