"""Planning the memory of a Llama-2-70B-shaped abstract model on 1,024 devices (nothing allocated).

``tt.memory_plan(params, mesh={"data": 32, "fsdp": 8, "tensor": 4}, optimizer=optax.adamw(...))`` on the
unscanned 80-layer tree (723 boxed leaves; params, grads and Adam's moments: 2,893 leaves laid out).
Anchor: ``jax.eval_shape(optimizer.init, params)``, the one call every plan of an optimizer state needs,
measured in the same run on the same tree. Targets: the whole plan in about a second (the issue's), and at
most 5x the anchor (laying out and counting every leaf of every part costs a few times tracing the init).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from conftest import SCALE, best, report

import treetools as tt

LAYERS = max(int(80 * SCALE), 1)
VOCAB, D, KV, FF = 32000, 8192, 1024, 28672
MESH = {"data": 32, "fsdp": 8, "tensor": 4}


def _box(shape, names):
    return nn.Partitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names=names)


def _llama():
    def layer():
        return {"attn": {"q": _box((D, D), ("fsdp", "tensor")), "k": _box((D, KV), ("fsdp", "tensor")),
                         "v": _box((D, KV), ("fsdp", "tensor")), "o": _box((D, D), ("tensor", "fsdp"))},
                "mlp": {"gate": _box((D, FF), ("fsdp", "tensor")), "up": _box((D, FF), ("fsdp", "tensor")),
                        "down": _box((FF, D), ("tensor", "fsdp"))},
                "attn_norm": _box((D,), (None,)), "mlp_norm": _box((D,), (None,))}

    return {"embed": _box((VOCAB, D), ("tensor", "fsdp")), **{f"layers_{i}": layer() for i in range(LAYERS)},
            "norm": _box((D,), (None,)), "lm_head": _box((D, VOCAB), ("fsdp", "tensor"))}


def test_memory_plan_of_a_70b_model_vs_eval_shape_of_the_optimizer_init(benchmark):
    params, tx = _llama(), optax.adamw(1e-4)
    plan = lambda: tt.memory_plan(params, mesh=MESH, optimizer=tx)  # noqa: E731
    anchor = lambda: jax.eval_shape(tx.init, params)  # noqa: E731
    result = plan()
    assert result.devices == 1024 and len(result.leaves) == 4 * len(jax.tree.leaves(params)) + 1
    ours_t, anchor_t = best(plan, 5), best(anchor, 5)
    n = tt.get_num_params(params)
    report(f"memory_plan, {n / 1e9:.1f}B params in {len(jax.tree.leaves(params))} leaves on 1,024 devices, adamw",
           ours_t, anchor_t, "jax.eval_shape(optimizer.init)", target="<= 5; ours about 1 s")
    benchmark(plan)
