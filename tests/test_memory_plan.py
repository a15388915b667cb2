"""tt.memory_plan and treetools plan: the plan against reality on 8 fake CPU devices, and against hand-derived figures.

Reality is jax's own: the state placed with the plan's shardings, each device's ``addressable_shards`` nbytes
summed; a compiled step's figures are jax's ``memory_analysis()`` of the same program, lowered here by hand.
"""

from __future__ import annotations

import collections
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import treetools as tt
from tests import _models
from treetools.cli import main

AUTO = (AxisType.Auto, AxisType.Auto)


def _held(tree) -> dict:
    """Bytes each device holds of ``tree``: jax's addressable shards, summed per device."""
    out: dict = collections.Counter()
    for leaf in jax.tree.leaves(tt.unbox_tree(tree)):
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return out


def _assert_every_device_holds(tree, expected, devices):
    held = _held(tree)
    assert set(held) == set(devices), "the part is not on every device of the mesh"
    assert sorted(set(held.values())) == [expected], (dict(held), expected)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=AUTO)


def _box(shape, names, dtype=jnp.float32):
    return nn.Partitioned(jax.ShapeDtypeStruct(shape, dtype), names=names)


# ----------------------------------------------------------------------------- the plan against the placed state


def test_plan_equals_the_placed_state_per_device_and_per_part(mesh, devices):
    model, x = _models.BoxedMLP(), jnp.ones((4, 32))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    tx = optax.adamw(1e-3)
    plan = tt.memory_plan({"params": abstract, "params_ema": abstract}, mesh=mesh, optimizer=tx)
    # Per device, by hand: in/kernel (32,64)/(2*4) + in/bias 64/4 + ln scale, bias 64+64 (replicated) +
    # out/kernel (64,16)/(4*2) + out/bias 16 (replicated) = 256 + 16 + 128 + 128 + 16 = 544 floats.
    assert plan.by_part["params"] == plan.by_part["grads"] == plan.by_part["params_ema"] == 544 * 4
    assert plan.by_part["opt_state"] == 2 * 544 * 4 + 4  # adamw's mu and nu, and its int32 count
    assert list(plan.by_part) == ["params", "grads", "opt_state", "params_ema"]

    init = jax.jit(lambda k: nn.unbox(model.init(k, x)["params"]), out_shardings=plan.shardings["params"])
    params = init(jax.random.key(0))
    placed = {
        "params": params,
        "params_ema": jax.jit(lambda k: nn.unbox(model.init(k, x)["params"]),
                              out_shardings=plan.shardings["params_ema"])(jax.random.key(1)),
        "opt_state": jax.jit(tx.init, out_shardings=plan.shardings["opt_state"])(params),
        "grads": jax.jit(jax.grad(lambda p: model.apply({"params": p}, x).sum()),
                         out_shardings=plan.shardings["grads"])(params),
    }
    for part, tree in placed.items():
        _assert_every_device_holds(tree, plan.by_part[part], devices)
    _assert_every_device_holds(placed, plan.per_device_bytes, devices)
    # The arrays' own placement (no mesh=, no boxes) plans the same: where each array is.
    again = tt.memory_plan({k: v for k, v in placed.items() if k != "grads"})
    assert again.by_part == plan.by_part and again.mesh == {"fsdp": 2, "tp": 4}


# Adafactor factors a dimension of 128 or more: a (256, 512) kernel, a square one, a vector.
OPT_PARAMS = {"w": ((256, 512), ("fsdp", "tp")), "sq": ((256, 256), ("fsdp", "tp")), "b": ((512,), ("tp",)),
              "embed": ((512, 64), ("tp", None))}
# Per device (floats): w 256*512/8 = 16384, sq 256*256/8 = 8192, b 512/4 = 128, embed 512/4*64 = 8192.
OPT_PER_DEVICE = {"w": 16384, "sq": 8192, "b": 128, "embed": 8192}
PARAMS_PER_DEVICE = sum(OPT_PER_DEVICE.values())  # 32896
OPTIMIZERS = {
    # mu and nu like their params, + the int32 count
    "adamw": (lambda: optax.adamw(1e-3), 4 * 2 * PARAMS_PER_DEVICE + 4),
    # one moment, + the count
    "lion": (lambda: optax.lion(1e-4), 4 * PARAMS_PER_DEVICE + 4),
    # Every leaf gets v_row, v_col and v (optax); a factored one keeps v_row and v_col, the others (1,) placeholders.
    # w (256, 512) factored: v_row (256,) drops axis 1, so over fsdp: 128; v_col (512,) drops axis 0, over tp: 128;
    #   v (1,): 1.   sq (256, 256) factored: optax's argsort picks d1 = 0, d0 = 1, so v_row keeps axis 0 (over
    #   fsdp: 128) and v_col axis 1 (over tp: 64), as a jitted update places them; v 1.
    # b (512,) not factored: v like b over tp: 128; v_row, v_col 1 + 1.   embed (512, 64): 64 < 128, not factored:
    #   v like embed: 8192; v_row, v_col 1 + 1.   And the int32 count.
    "adafactor": (optax.adafactor, 4 * ((128 + 128 + 1) + (128 + 64 + 1) + (1 + 1 + 128) + (1 + 1 + 8192)) + 4),
    # adam for all but the frozen embedding (set_to_zero: no state): mu and nu of w, sq, b, + adam's count
    "multi_transform": (lambda: optax.multi_transform(
        {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()},
        tt.get_param_label_fn([(r"^embed$", "frozen")], default="train")),
        4 * 2 * (PARAMS_PER_DEVICE - OPT_PER_DEVICE["embed"]) + 4),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optax_states_are_laid_out_like_their_params(name, mesh, devices):
    make, expected = OPTIMIZERS[name]
    tx = make()
    abstract = {k: _box(shape, names) for k, (shape, names) in OPT_PARAMS.items()}
    plan = tt.memory_plan(abstract, mesh=mesh, optimizer=tx)
    assert plan.by_part["params"] == 4 * PARAMS_PER_DEVICE
    assert plan.by_part["opt_state"] == expected
    params = jax.jit(lambda: {k: jnp.ones(s) for k, (s, _) in OPT_PARAMS.items()},
                     out_shardings=plan.shardings["params"])()
    opt_state = jax.jit(tx.init, out_shardings=plan.shardings["opt_state"])(params)
    _assert_every_device_holds(opt_state, plan.by_part["opt_state"], devices)
    # Unboxed params with the same layout as placed arrays plan the same moments (matched by path, no boxes).
    placed = tt.memory_plan(params, mesh=mesh, optimizer=tx)
    assert placed.by_part == plan.by_part


def test_a_state_sitting_on_one_device_is_planned_where_it_is(mesh, devices):
    # jax.jit(tx.init) without out_shardings: zeros that depend on no input are put on device 0, whole. The plan
    # of the live state says so (device 0 holds every moment); the plan on the mesh says where they should go.
    params = jax.device_put({"w": jnp.ones((256, 512))}, NamedSharding(mesh, P("fsdp", "tp")))
    opt_state = jax.jit(optax.adam(1e-3).init)(params)
    live = tt.memory_plan({"params": params, "opt_state": opt_state}, grads=False)
    held = _held(opt_state)
    assert live.by_part["opt_state"] == held[devices[0]] == max(held.values()) == 2 * 256 * 512 * 4 + 4
    planned = tt.memory_plan(params, mesh=mesh, optimizer=optax.adam(1e-3), grads=False)
    assert planned.by_part["opt_state"] == 2 * 256 * 512 * 4 // 8 + 4


def test_moments_match_their_param_by_the_longest_path_tail():
    # `count` of an opt state must not take the layout of a param named `count`; `0/mu/a/w` is `a/w`, not `w`.
    params = {"w": _box((64, 8), ("fsdp", None)), "a": {"w": _box((64, 8), (None, "tp"))}}
    plan = tt.memory_plan(params, mesh={"fsdp": 8, "tp": 8}, optimizer=optax.adam(1e-3), grads=False)
    specs = {leaf.name: str(leaf.sharding) for leaf in plan.leaves}
    assert specs["opt_state/0/mu/w"] == "P('fsdp')" and specs["opt_state/0/nu/a/w"] == "P(None, 'tp')"
    assert specs["opt_state/0/count"] == "replicated"


# ----------------------------------------------------------------------------- nnx, linen logical names, TrainState


def test_nnx_module_and_its_abstract_twin(mesh, devices):
    tx = optax.adamw(1e-3)
    with jax.set_mesh(mesh):
        model = _models.NnxNet(nnx.Rngs(0))
        abstract = nnx.eval_shape(lambda: _models.NnxNet(nnx.Rngs(0)))
    plan = tt.memory_plan(model, optimizer=tx)  # the mesh: where the arrays are
    assert plan.mesh == {"fsdp": 2, "tp": 4}
    params, rest = nnx.state(model, nnx.Param), nnx.state(model, nnx.Not(nnx.Param))
    # up/kernel (8,16) over fsdp = 64 floats; up/bias 16, bn scale+bias 32, out kernel 64 + bias 4: 180 floats
    assert plan.by_part["params"] == 4 * (_models.NNX_PARAMS - 8 * 16 // 2) == 4 * 180
    _assert_every_device_holds(params, plan.by_part["params"], devices)
    _assert_every_device_holds(rest, plan.by_part["state"], devices)
    with jax.set_mesh(mesh):
        opt_state = jax.jit(tx.init, out_shardings=plan.shardings["opt_state"])(params)
    _assert_every_device_holds(opt_state, plan.by_part["opt_state"], devices)
    twin = tt.memory_plan(abstract, mesh=mesh, optimizer=tx)
    assert twin.by_part == plan.by_part
    # The whole State: its Params are the params (grads for them only, not for BatchStat), the rest `state`.
    assert tt.memory_plan(nnx.state(model), optimizer=tx).by_part == plan.by_part
    assert list(tt.memory_plan(params).by_part) == ["params", "grads"]


def test_linen_logical_names_go_through_flax_rules(mesh, devices):
    rules = (("embed", "fsdp"), ("mlp", "tp"))
    tree = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((64, 32), jnp.float32), names=("embed", "mlp")),
            "v": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((32,), jnp.float32), names=("mlp",))}
    with pytest.raises(ValueError, match=r"params/\w.*logical names.*pass `rules=`"):
        tt.memory_plan(tree, mesh=mesh)
    plan = tt.memory_plan(tree, mesh=mesh, rules=rules, grads=False)
    assert plan.by_part == {"params": 4 * (64 * 32 // 8 + 32 // 4)}
    with nn.logical_axis_rules(rules):
        assert tt.memory_plan(tree, mesh=mesh, grads=False).by_part == plan.by_part
    # A scanned model whose boxes carry their own rules (the `layers` axis replicated), placed: the same.
    lm = _models.ScannedLM()
    tokens = jnp.zeros((2, 5), jnp.int32)
    variables = jax.eval_shape(lm.init, jax.random.key(0), tokens)
    plan = tt.memory_plan(variables, mesh=jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,)))
    placed = jax.jit(lambda k: nn.unbox(lm.init(k, tokens)["params"]),
                     out_shardings=plan.shardings["params"])(jax.random.key(0))
    _assert_every_device_holds(placed, plan.by_part["params"], devices)
    assert plan.by_part["params"] < tt.get_num_bytes(variables)  # mlp and vocab split 8 ways


def test_train_state_is_planned_part_by_part(mesh, devices):
    tx = optax.adamw(1e-3)
    abstract = {k: _box(shape, names) for k, (shape, names) in OPT_PARAMS.items()}
    shardings = tt.memory_plan(abstract, mesh=mesh, grads=False).shardings["params"]
    params = jax.jit(lambda: {k: jnp.ones(s) for k, (s, _) in OPT_PARAMS.items()}, out_shardings=shardings)()
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    plan = tt.memory_plan(state)
    assert list(plan.by_part) == ["params", "grads", "opt_state", "step"]
    _assert_every_device_holds(state.params, plan.by_part["params"], devices)
    # TrainState.create runs tx.init eagerly: adam's count sits on device 0 alone, the fullest device.
    held = _held(state.opt_state)
    assert max(held.values()) == held[devices[0]] == plan.by_part["opt_state"] == 2 * 4 * PARAMS_PER_DEVICE + 4
    with pytest.raises(ValueError, match="holds an `opt_state` already"):
        tt.memory_plan(state, optimizer=tx)


# ----------------------------------------------------------------------------- a 70B model on 1,024 devices, by hand

VOCAB, D, LAYERS, HEADS_KV, HEAD, FF = 32000, 8192, 80, 8, 128, 28672  # Llama-2-70B


def _llama_70b():
    kv = HEADS_KV * HEAD  # 1024: grouped-query attention
    layer = {"attn": {"q": _box((D, D), ("fsdp", "tensor")), "k": _box((D, kv), ("fsdp", "tensor")),
                      "v": _box((D, kv), ("fsdp", "tensor")), "o": _box((D, D), ("tensor", "fsdp"))},
             "mlp": {"gate": _box((D, FF), ("fsdp", "tensor")), "up": _box((D, FF), ("fsdp", "tensor")),
                     "down": _box((FF, D), ("tensor", "fsdp"))},
             "attn_norm": _box((D,), (None,)), "mlp_norm": _box((D,), (None,))}
    return {"embed": _box((VOCAB, D), ("tensor", "fsdp")), **{f"layers_{i}": layer for i in range(LAYERS)},
            "norm": _box((D,), (None,)), "lm_head": _box((D, VOCAB), ("fsdp", "tensor"))}


def test_llama_70b_on_1024_devices_against_hand_derived_figures():
    mesh = {"data": 32, "fsdp": 8, "tensor": 4}
    plan = tt.memory_plan(_llama_70b(), mesh=mesh, optimizer=optax.adamw(1e-4), device_memory="80GiB")
    abstract_mesh = jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh))
    assert tt.memory_plan(_llama_70b(), mesh=abstract_mesh, optimizer=optax.adamw(1e-4)).by_part == plan.by_part
    # Params: embed 32000*8192 + lm_head 8192*32000 + norm 8192 + 80 layers of
    #   q, o 8192*8192 + k, v 8192*1024 + gate, up, down 8192*28672 + 2 norms 8192 = 855,654,400
    # = 68,976,648,192 parameters (Llama-2-70B), float32.
    assert tt.get_num_params(_llama_70b()) == 68_976_648_192
    # Per device (fsdp*tensor = 32 ways; data replicates): embed and lm_head (8000, 1024) or (1024, 8000) =
    # 8,192,000 each; per layer q, o (1024, 2048) = 2,097,152 each, k, v (1024, 256) = 262,144 each,
    # gate, up, down (1024, 7168) or (7168, 1024) = 7,340,032 each, 2 norms whole = 8,192 each:
    # 26,755,072 a layer; 80 layers + embed + lm_head + norm = 2,156,797,952 floats = 8,627,191,808 bytes.
    params = 8_627_191_808
    assert plan.by_part == {"params": params, "grads": params, "opt_state": 2 * params + 4}
    assert plan.per_device_bytes == 34_508_767_236  # 32.14 GiB: 16 bytes a parameter (+ adam's count)
    assert plan.devices == 1024 and plan.fits and plan.headroom_bytes == 80 * 2**30 - 34_508_767_236
    assert plan.rows[0].name == "params/embed" and plan.rows[0].bytes == 8_192_000 * 4
    assert plan.host.largest_block.bytes == 32_768_000 and plan.host.restore_peak_bytes == 2 * 32_768_000
    assert plan.host.largest_array.global_bytes == VOCAB * D * 4
    assert plan.replicated == []  # the norms are 32 KiB, under the 1 MiB threshold
    assert all(len(line) <= 100 for line in str(plan).splitlines())


# ----------------------------------------------------------------------------- the compiled step


def _step(model, tx):
    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: model.apply({"params": p}, batch).astype(jnp.float32).mean())(
            state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return step


@pytest.mark.parametrize("donate", [False, True])
def test_compiled_step_reports_what_jax_reports_for_the_same_program(mesh, devices, donate):
    model, tx = _models.BoxedMLP(), optax.adam(1e-3)
    batch = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 32)))["params"]
    step = _step(model, tx)
    fn = jax.jit(step, donate_argnums=0) if donate else step
    plan = tt.memory_plan(abstract, mesh=mesh, optimizer=tx, step_fn=fn, step_args=(batch,))
    # The same program by hand: the state as given (boxed), each leaf on its box names (flax's nn.get_sharding;
    # adam's moments carry their param's box), the count replicated.
    opt_abstract = jax.eval_shape(tx.init, abstract)

    def structs(tree):
        boxed = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
        return jax.tree.map(lambda x, s: x.replace_boxed(jax.ShapeDtypeStruct(x.value.shape, x.value.dtype, sharding=s))
                            if boxed(x) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, nn.get_sharding(tree, mesh), is_leaf=boxed)

    state = {"params": structs(abstract), "opt_state": structs(opt_abstract)}
    want = jax.jit(step, donate_argnums=0 if donate else ()).lower(state, batch).compile().memory_analysis()
    c = plan.compiled
    assert (c.argument_bytes, c.output_bytes, c.temp_bytes, c.generated_code_bytes, c.alias_bytes) == (
        want.argument_size_in_bytes, want.output_size_in_bytes, want.temp_size_in_bytes,
        want.generated_code_size_in_bytes, want.alias_size_in_bytes)
    assert (c.alias_bytes > 0) == donate
    assert c.platform == "cpu" and c.devices == 8
    assert any("CPU devices stand in" in n and "XLA:CPU" in n for n in plan.notes)
    # The arguments are the state as planned, plus the batch's shard.
    assert c.argument_bytes >= plan.by_part["params"] + plan.by_part["opt_state"]


def test_compiled_step_on_a_dict_mesh_uses_this_process_devices_and_refuses_a_mesh_too_big(mesh):
    model, tx = _models.BoxedMLP(), optax.adam(1e-3)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 32)))["params"]
    batch = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    on_mesh = tt.memory_plan(abstract, mesh=mesh, optimizer=tx, step_fn=_step(model, tx), step_args=(batch,))
    on_dict = tt.memory_plan(abstract, mesh={"fsdp": 2, "tp": 4}, optimizer=tx, step_fn=_step(model, tx),
                             step_args=(batch,))
    assert on_dict.compiled == on_mesh.compiled
    # A dict of parts that holds its optimizer state already is handed to step_fn as it is: the same program.
    parts = {"params": abstract, "opt_state": jax.eval_shape(tx.init, abstract)}
    held = tt.memory_plan(parts, mesh=mesh, step_fn=_step(model, tx), step_args=(batch,))
    assert held.compiled == on_mesh.compiled and held.by_part == on_mesh.by_part
    with pytest.raises(ValueError, match="needs 16 devices.*xla_force_host_platform_device_count=16"):
        tt.memory_plan(abstract, mesh={"fsdp": 4, "tp": 4}, optimizer=tx, step_fn=_step(model, tx),
                       step_args=(batch,))


# ----------------------------------------------------------------------------- verdict, rows, rendering, JSON


def test_fits_headroom_and_shortfall():
    tree = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)}  # 2 MiB, replicated
    assert tt.memory_plan(tree, grads=False).fits is None
    plan = tt.memory_plan(tree, grads=False, device_memory="3MiB")
    assert plan.fits and plan.headroom_bytes == 2**20
    short = tt.memory_plan(tree, device_memory=3 * 2**20)  # + bf16 grads: 4 MiB
    assert short.fits is False and short.headroom_bytes == -(2**20)
    assert "DOES NOT FIT, 1.00 MiB short" in str(short)
    with pytest.raises(ValueError, match="`device_memory` 'lots' is not a size"):
        tt.memory_plan(tree, device_memory="lots")


def test_grads_are_the_floating_params_only():
    tree = {"w": jax.ShapeDtypeStruct((8,), jnp.bfloat16), "i": jax.ShapeDtypeStruct((8,), jnp.int32),
            "key": jax.random.key(0)}
    plan = tt.memory_plan(tree)
    assert plan.by_part == {"params": 16 + 32 + 8, "grads": 16}


def test_replicated_leaves_that_an_axis_could_split_are_listed():
    tree = {"embed": jax.ShapeDtypeStruct((32000, 64), jnp.float32),      # 7.8 MiB, replicated, 32000 % 8 == 0
            "odd": jax.ShapeDtypeStruct((999, 999), jnp.float32),         # 3.8 MiB, no dimension splits evenly
            "small": jax.ShapeDtypeStruct((64, 64), jnp.float32),         # under the threshold
            "split": _box((4096, 512), ("fsdp", None))}                   # sharded already
    plan = tt.memory_plan(tree, mesh={"data": 2, "fsdp": 8}, grads=False)
    assert [(s.leaf.name, s.dim, s.axis) for s in plan.replicated] == [("params/embed", 0, "fsdp")]
    assert plan.to_json()["replicated"][0] == {"path": "params/embed", "shape": [32000, 64], "dtype": "float32",
                                               "bytes": 32000 * 64 * 4, "dim": 0, "axis": "fsdp", "axis_size": 8}
    assert "dim 0 over fsdp (8)" in str(plan)


def test_rows_are_the_largest_leaves_and_the_text_fits_100_columns():
    long = "a_very_long_module_name_that_goes_on/" * 4
    tree = {f"{long}{i}": jax.ShapeDtypeStruct((i + 1, 1000), jnp.float32) for i in range(20)}
    plan = tt.memory_plan(tree, optimizer=optax.adam(1e-3), top=5)
    assert [r.bytes for r in plan.rows] == [20 * 4000] * 4 + [19 * 4000]
    assert len(plan.to_json()["rows"]) == 5
    text = str(plan)
    assert all(len(line) <= 100 for line in text.splitlines()), text
    assert "…[+" in text  # long paths are cut, both ends kept


def test_errors_name_the_leaf_and_the_fix():
    with pytest.raises(ValueError, match=r"`params/w` is laid out as P\('model', None\).*\['model'\].*mesh"):
        tt.memory_plan({"w": _box((8, 8), ("model", None))}, mesh={"fsdp": 8})
    with pytest.raises(ValueError, match="more entries than the leaf has dimensions"):
        tt.memory_plan({"w": _box((8,), ("fsdp", None))}, mesh={"fsdp": 8})
    with pytest.raises(ValueError, match="no mesh gives"):
        tt.memory_plan({"w": _box((8, 8), ("fsdp", None))})
    with pytest.raises(TypeError, match="`mesh` must be"):
        tt.memory_plan({}, mesh=[8])
    with pytest.raises(ValueError, match="positive sizes"):
        tt.memory_plan({}, mesh={"fsdp": 0})
    with pytest.raises(TypeError, match="GradientTransformation"):
        tt.memory_plan({}, optimizer="adam")


def test_empty_tree_and_nothing_on_a_mesh():
    plan = tt.memory_plan({})
    assert plan.per_device_bytes == 0 and plan.rows == [] and plan.mesh == {} and plan.devices == 1
    assert "one device" in str(plan) and plan.to_json()["schema"] == 1


# ----------------------------------------------------------------------------- host memory


def test_largest_block_is_what_restore_checkpoint_reads_at_a_time(mesh, tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    from treetools.checkpoint_io.readers import FileReader

    save_file({"w": np.ones((64, 32), np.float32), "b": np.ones(32, np.float32)}, str(tmp_path / "m.safetensors"))
    target = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp"))),
              "b": jax.ShapeDtypeStruct((32,), jnp.float32, sharding=NamedSharding(mesh, P()))}
    plan = tt.memory_plan(target, grads=False)
    read = []
    original = FileReader.read
    monkeypatch.setattr(FileReader, "read", lambda self, index: read.append(original(self, index)) or read[-1])
    tt.restore_checkpoint(tmp_path / "m.safetensors", None, {"default": target})
    assert max(block.nbytes for block in read) == plan.host.largest_block.bytes == 32 * 32 * 4
    assert plan.host.largest_block.name == "params/w" and plan.host.largest_array.global_bytes == 64 * 32 * 4


def test_stored_chunks_over_the_budget_are_named():
    tree = {"w": _box((1024, 1024), ("fsdp", None)), "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
    plan = tt.memory_plan(tree, mesh={"fsdp": 4}, memory_budget=2**20, chunk_bytes={"params/b": 4096})
    # w: a device block of 1 MiB, saved by this layout (a chunk = one block): block + chunk = 2 MiB.
    assert plan.host.restore_peak_bytes == 2 * 2**20 and plan.host.over_budget == ()
    plan = tt.memory_plan(tree, mesh={"fsdp": 4}, memory_budget=2**19, chunk_bytes={"params/w": 4 * 2**20})
    assert plan.host.over_budget == ("params/w",) and plan.host.restore_peak_bytes == 2**20 + 4 * 2**20
    assert "over the memory budget" in str(plan)


# ----------------------------------------------------------------------------- treetools plan


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An Orbax checkpoint of params, params_ema and an adamw state laid out on a data=2 x fsdp=4 mesh."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=AUTO)
    params = {"embed": jax.device_put(jnp.ones((512, 64)), NamedSharding(mesh, P("fsdp"))),
              "dense": {"kernel": jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P(None, "fsdp"))),
                        "bias": jax.device_put(jnp.zeros(256), NamedSharding(mesh, P()))}}
    # Eager init: the moments follow their params (zeros_like); the count, made on device 0, replicated.
    opt_state = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())) if x.ndim == 0 else x,
                             optax.adamw(1e-3).init(params))
    state = {"params": params, "params_ema": params, "opt_state": opt_state}
    root = tmp_path_factory.mktemp("plan") / "ckpt"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root)
    tt.save_checkpoint(mngr, 3, {**state, "data_iter": {"i": 1}}, wait=True)
    mngr.close()
    return root, state


def _plan_json(capsys, *argv, rc=0):
    got = main(["plan", *map(str, argv), "--format", "json"])
    out = capsys.readouterr().out
    assert got == rc, out
    return json.loads(out)


def test_cli_plans_the_checkpoint_as_the_library_plans_the_live_state(saved, capsys, devices):
    root, state = saved
    out = _plan_json(capsys, root)
    live = tt.memory_plan(state)  # the arrays that were saved, where they are
    assert out["by_part"] == live.by_part and out["mesh"] == {"data": 2, "fsdp": 4}
    for part in ("params", "params_ema", "opt_state"):
        _assert_every_device_holds(state[part], out["by_part"][part], devices)
    assert out == tt.plan_checkpoint(root).to_json()
    # Another mesh, and adafactor's state instead of the stored adamw one.
    out = _plan_json(capsys, root, "--mesh", "data=32,fsdp=8,tensor=4", "--optimizer", "adafactor", "--no-grads")
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tt.flatten(
        state["params"]).items()}
    want = tt.memory_plan({"params": abstract, "params_ema": abstract}, optimizer=optax.adafactor(), grads=False,
                          mesh={"data": 32, "fsdp": 8, "tensor": 4})
    assert out["by_part"] == want.by_part and out["devices"] == 1024
    assert any("stored one left out" in n for n in out["notes"])


def test_cli_exit_codes_fit_does_not_fit_and_usage(saved, capsys):
    root, _ = saved
    assert main(["plan", str(root), "--device-memory", "1GiB"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["plan", str(root), "--device-memory", "1KiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    for argv in (["--mesh", "data=8,,"], ["--mesh", "data=0"], ["--device-memory", "lots"],
                 ["--optimizer", "rmsprop"], ["--top", "-1"], ["--rules", str(root / "nope.toml")]):
        assert main(["plan", str(root), *argv]) == 2, argv
        assert "error:" in capsys.readouterr().err
    assert main(["plan", str(root / "missing")]) == 1
    assert "no such file or folder" in capsys.readouterr().err


def test_cli_names_the_leaf_whose_recorded_axis_the_mesh_lacks(saved, capsys):
    root, _ = saved
    assert main(["plan", str(root), "--mesh", "data=4,tensor=2"]) == 2
    err = capsys.readouterr().err
    assert "treetools plan: error: leaf `" in err and "['fsdp']" in err and "--mesh fsdp=N" in err


def test_cli_layout_rules_lay_out_a_file_without_shardings(tmp_path, capsys):
    from safetensors.numpy import save_file

    save_file({"model.embed.weight": np.ones((512, 64), np.float32), "model.norm.weight": np.ones(64, np.float32)},
              str(tmp_path / "m.safetensors"))
    (tmp_path / "layout.toml").write_text("partition = [['embed\\.weight$', ['fsdp', 'None']]]\n")
    out = _plan_json(capsys, tmp_path / "m.safetensors", "--mesh", "fsdp=8", "--rules", tmp_path / "layout.toml",
                     "--optimizer", "lion")
    # embed split 8 ways (64 rows of 64) + the norm whole: 4096 + 64 floats; lion's mu alike, + its count
    assert out["by_part"] == {"params": 4 * 4160, "grads": 4 * 4160, "opt_state": 4 * 4160 + 4}
    rows = {r["path"]: r["spec"] for r in out["rows"]}
    assert rows["params/model.embed.weight"] == ["fsdp", None] and rows["opt_state/0/mu/model.embed.weight"] == [
        "fsdp", None]
    (tmp_path / "bad.json").write_text('{"partition": [["(", ["fsdp"]]]}')
    assert main(["plan", str(tmp_path / "m.safetensors"), "--rules", str(tmp_path / "bad.json")]) == 2
    assert "not a valid regex" in capsys.readouterr().err


def test_cli_optimizer_names_are_the_library_ones():
    from treetools.checkpoint_jax.memory import OPTIMIZERS as LIBRARY
    from treetools.cli.plan import OPTIMIZERS as CLI

    assert CLI == LIBRARY


@pytest.mark.parametrize("key", ["params", "target"])
def test_a_file_holding_a_whole_train_state_is_planned_part_by_part(tmp_path, key):
    from flax import serialization

    params = {"dense": {"kernel": np.ones((64, 32), np.float32), "bias": np.zeros(32, np.float32)}}
    tree = {key: params, "opt_state": {"mu": params, "count": np.int32(3)}, "step": np.int64(7)}
    (tmp_path / "state.msgpack").write_bytes(serialization.msgpack_serialize(tree))
    plan = tt.plan_checkpoint(tmp_path / "state.msgpack")
    # One device, nothing sharded: params (64*32 + 32 floats), its grads, mu alike + the int32 count, the step.
    assert plan.by_part == {"params": 8320, "grads": 8320, "opt_state": 8324, "step": 8}
    assert plan.by_part == tt.memory_plan({"params": params, **{k: v for k, v in tree.items() if k != key}}).by_part
    assert any(f"the parameters are `{key}`" in n for n in plan.notes) == (key == "target")
    only = tt.plan_checkpoint(tmp_path / "state.msgpack", item="opt_state", grads=False)
    assert only.by_part == {"params": 0, "opt_state": 8324}
    with pytest.raises(tt.CheckpointNotFoundError, match="no item holds the parameters"):
        tt.plan_checkpoint(tmp_path / "state.msgpack", item="opt_state", optimizer="adam")
