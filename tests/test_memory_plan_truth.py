"""tt.memory_plan against what jax really does, round 4 (issue 47, points 6-11): layouts jax cannot place, frozen
parameters, the estimates beside the state. Ground truth: jax's own placement on the 8 fake CPU devices
(``addressable_shards``), a compiled step's ``memory_analysis()``, optax's own states."""

from __future__ import annotations

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import treetools as tt


def _held(tree) -> dict:
    """Bytes each device holds of ``tree``: jax's addressable shards, summed per device."""
    out: dict = collections.Counter()
    for leaf in jax.tree.leaves(tt.unbox_tree(tree)):
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return out


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
    # Truth: the compiled step with embed frozen holds no buffer the size of embed's gradient; the same step
    # training embed does (its gradient, and adam's update of it).
    assert _step_temp_bytes(frozen, shapes) < embed_bytes <= _step_temp_bytes(optax.adam(1e-3), shapes)
    # A global-norm clip before the split reads every gradient: the compiled step computes embed's, so does the plan.
    clipped = optax.chain(optax.clip_by_global_norm(1.0), frozen)
    assert tt.memory_plan(params, optimizer=clipped).by_part["grads"] == embed_bytes + 512 * 64 * 4
    assert _step_temp_bytes(clipped, shapes) >= embed_bytes
