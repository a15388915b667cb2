"""tt.memory_plan against what jax really does, round 4 (issue 47, points 6-11): layouts jax cannot place, frozen
parameters, the estimates beside the state. Ground truth: jax's own placement on the 8 fake CPU devices
(``addressable_shards``), a compiled step's ``memory_analysis()``, optax's own states."""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import treetools as tt
from tests.test_memory_plan import _held


def _box(shape, names, dtype=jnp.float32):
    return nn.Partitioned(jax.ShapeDtypeStruct(shape, dtype), names=names)


# ----------------------------------------------------------------------------- point 6: indivisible dimensions

VOCAB = 50257  # GPT-2's vocabulary: prime to 8


def test_a_dimension_the_axis_does_not_divide_is_planned_as_jit_places_it(devices):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    shapes = {"wte": ((VOCAB, 16), ("fsdp", None)), "h": ((64, 256), ("fsdp", None))}
    plan = tt.memory_plan({k: _box(s, n) for k, (s, n) in shapes.items()}, mesh=mesh, optimizer=optax.adam(1e-3))
    # jax refuses the layout asked for, outright (device_put) and as jit's out_shardings.
    asked = NamedSharding(mesh, P("fsdp", None))
    with pytest.raises(ValueError, match="divide"):
        jax.device_put(np.ones((VOCAB, 16), np.float32), asked)
    # Under jit, with_sharding_constraint (what flax's boxes and nnx's init apply) leaves the dimension unsplit.
    init = jax.jit(lambda: {k: jax.lax.with_sharding_constraint(jnp.ones(s), NamedSharding(mesh, P(*n)))
                            for k, (s, n) in shapes.items()})
    placed = init()
    held = _held(placed)
    assert set(held.values()) == {plan.by_part["params"]}  # wte whole on each device, h split 8 ways
    assert plan.by_part["params"] == VOCAB * 16 * 4 + 64 * 256 * 4 // 8
    # The plan's shardings are that layout: usable as out_shardings, where the asked one raises.
    again = jax.jit(lambda: {k: jnp.ones(s) for k, (s, _) in shapes.items()},
                    out_shardings=plan.shardings["params"])()
    assert _held(again) == held
    opt = jax.jit(optax.adam(1e-3).init, out_shardings=plan.shardings["opt_state"])(again)
    assert set(_held(opt).values()) == {plan.by_part["opt_state"]}
    # Which leaf, and why, first in the text.
    assert [(x.name, x.dim, x.axes, x.size) for x in plan.indivisible if x.part == "params"] == [
        ("params/wte", 0, ("fsdp",), 8)]
    assert len(plan.indivisible) == 3  # wte, and adam's mu and nu of it
    text = str(plan)
    assert text.startswith("warning: `params/wte`") and "50257" in text and "IndivisibleError" in text
    assert plan.to_json()["indivisible"][0] == {"path": "params/wte", "shape": [VOCAB, 16], "dim": 0,
                                                "axes": ["fsdp"], "axis_size": 8}


def test_only_the_indivisible_dimension_is_left_unsplit(devices):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    cases = [((VOCAB, 16), P("fsdp", "tp")), ((VOCAB, 16), P(("fsdp", "tp"), None)), ((16, VOCAB), P("fsdp", "tp")),
             ((VOCAB, 6), P("tp", "fsdp"))]
    for shape, spec in cases:
        plan = tt.memory_plan({"w": _box(shape, tuple(spec))}, mesh=mesh, grads=False)
        placed = jax.jit(lambda s=shape, sp=spec: jax.lax.with_sharding_constraint(
            jnp.ones(s), NamedSharding(mesh, sp)))()
        got = tuple(placed.sharding.spec)
        assert tuple(plan.shardings["params"]["w"].spec) == got + (None,) * (len(shape) - len(got)), (shape, spec)
        assert set(_held(placed).values()) == {plan.per_device_bytes}, (shape, spec)


def test_a_compiled_step_over_an_indivisible_layout_compiles_as_planned(devices):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    params = {"wte": _box((VOCAB, 16), ("fsdp", None))}
    plan = tt.memory_plan(params, mesh=mesh, step_fn=lambda p: jax.tree.map(lambda w: w * 2, nn.unbox(p)))
    by_hand = jax.jit(lambda w: w * 2).lower(
        jax.ShapeDtypeStruct((VOCAB, 16), jnp.float32, sharding=NamedSharding(mesh, P()))).compile()
    assert plan.compiled.argument_bytes == by_hand.memory_analysis().argument_size_in_bytes == VOCAB * 16 * 4


# ----------------------------------------------------------------------------- point 7: unannotated checkpoints


def _plan_cli(capsys, *argv):
    import json

    from treetools.cli import main

    rc = main(["plan", *map(str, argv)])
    out = capsys.readouterr().out
    return rc, (json.loads(out) if "json" in argv else out)


def test_cli_shard_largest_lays_out_an_hf_checkpoint_as_device_put_places_it(tmp_path, capsys, devices):
    from safetensors.numpy import save_file

    arrays = {"wte.weight": np.ones((VOCAB, 16), np.float32), "h.0.mlp.c_fc.weight": np.ones((64, 256), np.float32),
              "ln_f.weight": np.ones(64, np.float32), "odd": np.ones((3, 5), np.float32)}
    save_file(arrays, str(tmp_path / "model.safetensors"))
    ckpt = tmp_path / "model.safetensors"
    # Without a layout: every leaf replicated, and that comes first, not in a note at the bottom.
    rc, text = _plan_cli(capsys, ckpt, "--mesh", "fsdp=8")
    first = text.splitlines()[0]
    assert rc == 0 and first.startswith("warning: every leaf is replicated on all 8 devices") and "--shard-largest" \
        in text.split("\n\n")[0]
    rc, out = _plan_cli(capsys, ckpt, "--mesh", "fsdp=8", "--shard-largest", "fsdp", "--optimizer", "adam",
                        "--format", "json")
    assert rc == 0 and out["warnings"] == []
    plan = tt.plan_checkpoint(ckpt, mesh={"fsdp": 8}, shard_largest="fsdp", optimizer="adam")
    assert plan.to_json() == out
    # Truth: the arrays placed with the plan's shardings on the 8 devices, each device's shards summed.
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    from treetools.pytree.partitioning import resolve_sharding

    shardings = {k: resolve_sharding(s, mesh) for k, s in plan.shardings["params"].items()}
    placed = {k: jax.device_put(v, shardings[k]) for k, v in arrays.items()}
    assert set(_held(placed).values()) == {out["by_part"]["params"]}
    # By hand: wte splits its 16 columns (50257 is prime to 8), c_fc its 256, ln_f its 64; odd stays whole.
    assert out["by_part"]["params"] == 4 * (VOCAB * 2 + 64 * 32 + 8 + 15)
    opt_shardings = jax.tree.map(lambda s: resolve_sharding(s, mesh), plan.shardings["opt_state"])
    opt = jax.jit(optax.adam(1e-3).init, out_shardings=opt_shardings)(placed)
    assert set(_held(opt).values()) == {out["by_part"]["opt_state"]}
    from treetools.cli import main

    assert main(["plan", str(ckpt), "--mesh", "fsdp=8", "--shard-largest", "tensor"]) == 2 and "--shard-largest tensor" in capsys.readouterr().err


# ----------------------------------------------------------------------------- point 9: frozen parameters

EMBED = (4096, 512)  # 8 MiB of float32: a gradient of it would show in the compiled step's temporaries


def _frozen_setup(boxed):
    shapes = {"embed": EMBED, "w": (512, 64)}
    params = {k: (_box(s, (None,) * len(s)) if boxed else jax.ShapeDtypeStruct(s, jnp.float32))
              for k, s in shapes.items()}
    frozen = optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()},
                                   tt.get_param_label_fn([(r"^embed$", "frozen")], default="train"))
    return shapes, params, frozen


def _step_temp_bytes(tx, shapes):
    """The compiled train step's temporaries (jax's memory_analysis, one device)."""
    def step(p, s, x):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(p["embed"][x] @ p["w"])))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}
    s = jax.eval_shape(tx.init, p)
    c = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, jax.ShapeDtypeStruct((8,), jnp.int32)).compile()
    return c.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("boxed", [False, True])
def test_frozen_parameters_hold_no_gradient_as_in_the_compiled_step(boxed):
    shapes, params, frozen = _frozen_setup(boxed)
    plan = tt.memory_plan(params, optimizer=frozen)
    embed_bytes = EMBED[0] * EMBED[1] * 4
    assert plan.by_part["grads"] == 512 * 64 * 4  # w's gradient only
    assert any("frozen" in n for n in plan.notes)
    # An EMA copy mirrors every param, embed too: it does not hide that the optimizer holds no moment of embed.
    with_ema = tt.memory_plan({"params": params, "params_ema": params}, optimizer=frozen)
    assert with_ema.by_part["grads"] == 512 * 64 * 4
    # Truth: the compiled step with embed frozen holds no buffer the size of embed's gradient; the same step
    # training embed does (its gradient, and adam's update of it).
    assert _step_temp_bytes(frozen, shapes) < embed_bytes <= _step_temp_bytes(optax.adam(1e-3), shapes)
    # A global-norm clip before the split reads every gradient: the compiled step computes embed's, so does the plan.
    clipped = optax.chain(optax.clip_by_global_norm(1.0), frozen)
    assert tt.memory_plan(params, optimizer=clipped).by_part["grads"] == embed_bytes + 512 * 64 * 4
    assert _step_temp_bytes(clipped, shapes) >= embed_bytes


# ----------------------------------------------------------------------------- point 11: estimates with formulas


def _block(p, x, a):
    """A pre-norm transformer block (attention and a 4h GeLU MLP), float32."""
    b, s, h = x.shape

    def norm(x, scale):
        return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-6) * scale

    q, k, v = (t.reshape(b, s, a, h // a) for t in jnp.split(norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1))
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (h // a) ** 0.5, axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, h) @ p["o"]
    return x + jax.nn.gelu(norm(x, p["ln2"]) @ p["up"]) @ p["down"]


@pytest.mark.parametrize("b,s,h,a,layers", [(4, 128, 256, 4, 4), (4, 512, 64, 2, 2)])
def test_activation_estimate_is_within_a_factor_of_two_of_the_compiled_steps_temporaries(b, s, h, a, layers):
    f32 = jnp.float32
    shapes = {"ln1": (h,), "qkv": (h, 3 * h), "o": (h, h), "ln2": (h,), "up": (h, 4 * h), "down": (4 * h, h)}
    params = [{k: jax.ShapeDtypeStruct(v, f32) for k, v in shapes.items()} for _ in range(layers)]

    def loss(ps, x):
        for p in ps:
            x = _block(p, x, a)
        return jnp.sum(x ** 2)

    spec = {"batch": b, "seq": s, "hidden": h, "layers": layers, "heads": a, "itemsize": 4}
    plan = tt.memory_plan({"layers": params}, activations=spec, device_memory="1GiB")
    (act,) = [e for e in plan.estimates if e.name == "activations"]
    # The formula by hand: per layer 16 sbh + 2 a s^2 b elements, 4 bytes each.
    assert act.bytes == layers * 4 * (16 * s * b * h + 2 * a * s * s * b)
    assert "Korthikanti" in act.formula and "estimate: activations" in str(plan)
    # Truth: XLA's temporaries of the compiled gradient step (one device). A loose tolerance, documented: XLA
    # fuses and reuses buffers (on CPU it keeps more of the attention scores than the formula's 2 a s^2 b).
    temp = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((b, s, h), f32)).compile() \
        .memory_analysis().temp_size_in_bytes
    assert 0.5 <= act.bytes / temp <= 2.0, (act.bytes, temp)
    # The allocator: 75% of the device by default, what is left once the state and the activations are in.
    est = {e.name: e for e in plan.estimates}
    assert est["allocator_pool"].bytes == int(0.75 * 2**30)
    assert est["allocator_headroom"].bytes == int(0.75 * 2**30) - plan.per_device_bytes - act.bytes


def test_allocator_fraction_and_host_ram_estimates(monkeypatch):
    from treetools.pytree.estimates import mem_fraction

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert mem_fraction() == 0.9
    params = {"w": jax.ShapeDtypeStruct((1024, 256), jnp.float32), "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
    plan = tt.memory_plan(params, mesh={"fsdp": 8}, device_memory=10**9, optimizer=optax.adam(1e-3))
    est = {e.name: e for e in plan.estimates}
    assert est["allocator_pool"].bytes == int(0.9 * 10**9) and "0.9" in est["allocator_pool"].formula
    # Host RAM: load_parameters holds every param whole; restore_checkpoint one device block + its stored chunk.
    assert est["host_load_parameters"].bytes == (1024 * 256 + 256) * 4
    assert est["host_restore"].bytes == plan.host.restore_peak_bytes == 2 * 1024 * 256 * 4
    assert {e["name"] for e in plan.to_json()["estimates"]} == set(est)


# ----------------------------------------------------------------------------- point 8: Adafactor


def _adafactor_after_a_step(devices_mesh=None):
    tx = optax.adafactor(learning_rate=1e-2, momentum=0.9)
    params = {"one": jnp.full((1, 1), 2.0), "w": jnp.linspace(-1, 1, 256 * 512).reshape(256, 512),
              "sq": jnp.linspace(-2, 2, 256 * 256).reshape(256, 256), "b": jnp.linspace(0, 1, 300)}
    grads = jax.tree.map(lambda p: 0.5 * jnp.cos(p) + 0.5, params)
    _, state = tx.update(grads, tx.init(params), params)
    return tx, params, grads, state


def test_adafactor_moment_norms_are_numpys_over_optaxs_own_state():
    tx, params, grads, state = _adafactor_after_a_step()
    m = tt.norm_metrics(params=params, opt_state=state, per_param=True)
    (factored,) = [x for x in state if hasattr(x, "v_row")]
    (ema,) = [x for x in state if hasattr(x, "ema")]
    # (1, 1): not factored, its v is the moment (optax's v_row/v_col are (1,) zero placeholders).
    v_one = np.asarray(factored.v["one"], np.float64)
    assert v_one.shape == (1, 1) and float(m["nu_norm/one"]) == pytest.approx(np.sqrt(np.sum(v_one ** 2)), rel=1e-6)
    assert float(m["nu_norm/one"]) > 0
    # Momentum: the ema is the first moment, mu_norm, by numpy float64.
    for k in params:
        want = np.sqrt(np.sum(np.asarray(ema.ema[k], np.float64) ** 2))
        assert float(m[f"mu_norm/{k}"]) == pytest.approx(want, rel=1e-5), k
    assert float(m["mu_norm"]) == pytest.approx(
        np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in ema.ema.values())), rel=1e-5)
    # A factored param: optax's own estimate, r / mean(r) [outer] c, in float64.
    r, c = (np.asarray(x, np.float64) for x in (factored.v_row["w"], factored.v_col["w"]))
    want = np.sqrt(np.sum((np.outer(r / r.mean(), c)) ** 2))
    assert float(m["nu_norm/w"]) == pytest.approx(want, rel=1e-5)


def test_square_kernels_factors_are_planned_as_a_jitted_step_places_them(devices):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    tx = optax.adafactor(momentum=0.9)
    shapes = {"sq": (256, 256), "w": (256, 512)}
    plan = tt.memory_plan({k: _box(s, ("fsdp", "tp")) for k, s in shapes.items()}, mesh=mesh, optimizer=tx,
                          grads=False)
    params = {k: jax.device_put(jnp.ones(s), NamedSharding(mesh, P("fsdp", "tp"))) for k, s in shapes.items()}

    def step(p, s):
        return tx.update(jax.tree.map(lambda x: 0.5 * x, p), s, p)[1]

    placed = jax.jit(step)(params, tx.init(params))  # where jax puts the state a training step writes
    assert set(_held(placed).values()) == {plan.by_part["opt_state"]}
    v_row, v_col = placed[0].v_row["sq"], placed[0].v_col["sq"]
    assert (tuple(v_row.sharding.spec), tuple(v_col.sharding.spec)) == (("fsdp",), ("tp",))
    rows = {r.path: r.sharding.spec for r in plan.leaves if r.part == "opt_state"}
    assert tuple(rows["0/v_row/sq"]) == ("fsdp",) and tuple(rows["0/v_col/sq"]) == ("tp",)


# ----------------------------------------------------------------------------- point 10: nnx.state(optimizer)


@pytest.mark.parametrize("make", [lambda: optax.adam(1e-2), lambda: optax.adafactor(1e-2, momentum=0.9),
                                  lambda: optax.sgd(1e-2, momentum=0.9)])
def test_moment_norms_of_nnx_state_of_the_optimizer_are_numpys_over_optaxs_state(make):
    from flax import nnx

    model = nnx.Linear(256, 200, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, make(), wrt=nnx.Param)
    grads = jax.tree.map(lambda p: jnp.cos(p) + 0.5, nnx.state(model, nnx.Param))
    opt.update(model, grads)
    params = nnx.state(model, nnx.Param)
    via_state = tt.norm_metrics(params=params, opt_state=nnx.state(opt), depth=1)
    via_attr = tt.norm_metrics(params=params, opt_state=opt.opt_state, depth=1)
    assert "mu_norm" in via_state and set(via_state) == set(via_attr)
    for k in via_attr:
        assert float(via_state[k]) == pytest.approx(float(via_attr[k]), rel=1e-6), k
    # Truth for the first moment: numpy float64 over optax's own state (mu, ema or trace).
    states = [s for s in jax.tree.leaves(opt.opt_state, is_leaf=lambda x: hasattr(x, "_fields"))
              if hasattr(s, "_fields")]
    firsts = [getattr(s, f) for s in states for f in ("mu", "ema", "trace") if f in s._fields]
    want = np.sqrt(sum(np.sum(np.asarray(tt.unbox_tree(x), np.float64) ** 2) for m in firsts
                       for x in jax.tree.leaves(m)))
    assert float(via_state["mu_norm"]) == pytest.approx(want, rel=1e-5)


def test_logical_names_without_rules_are_refused_at_the_first_param_and_with_rules_moments_follow():
    # Point 10: logical names and no rules. The plan names the first param leaf and the fix (not the moments
    # alone); given the rules (or inside nn.logical_axis_rules), the moments are sharded as their params are.
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(16, kernel_init=init)(x)

    params = jax.eval_shape(M().init, jax.random.PRNGKey(0), jnp.ones((1, 8)))["params"]
    mesh = {"data": 2, "fsdp": 4}
    with pytest.raises(ValueError, match=r"`params/Dense_0/kernel` carries the logical names .*pass `rules=`"):
        tt.memory_plan(params, mesh=mesh, optimizer=optax.adamw(1e-3))
    rules = [("embed", "fsdp"), ("mlp", None)]
    given = tt.memory_plan(params, mesh=mesh, optimizer=optax.adamw(1e-3), rules=rules)
    with nn.logical_axis_rules(rules):
        ambient = tt.memory_plan(params, mesh=mesh, optimizer=optax.adamw(1e-3))
    # kernel (8, 16) float32 split 4 ways over `embed` -> fsdp: 128 bytes a device; bias (16,) replicated: 64.
    assert given.by_part["params"] == ambient.by_part["params"] == 8 * 16 * 4 // 4 + 16 * 4
    # Adam's mu and nu as their params (2 x 192), and its int32 count, replicated.
    assert given.by_part["opt_state"] == ambient.by_part["opt_state"] == 2 * 192 + 4
