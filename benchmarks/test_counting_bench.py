"""Counting and tabulating a 10,000-leaf abstract tree (nothing allocated).

Anchor: ``sum(x.size for x in jax.tree.leaves(tree))``, the one-liner every
trainer writes, measured in the same run. Targets: get_num_params at most
1.5x the anchor; tabulate_params under 1 s.
"""

import time

import jax
import jax.numpy as jnp
import pytest
from conftest import SCALE, report

import treetools as tt

N_LEAVES = max(int(10_000 * SCALE), 20)


def _tree(n):
    # Transformer-like nesting: layers/i/{attn,mlp}/{kernel,bias}, 4 leaves a layer.
    layers = {}
    for i in range(n // 4):
        layers[str(i)] = {
            "attn": {"kernel": jax.ShapeDtypeStruct((512, 512), jnp.bfloat16), "bias": jax.ShapeDtypeStruct((512,), jnp.float32)},
            "mlp": {"kernel": jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16), "bias": jax.ShapeDtypeStruct((2048,), jnp.float32)},
        }
    return {"layers": layers}


def _best_of(fn, repeat=7):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.fixture(scope="module")
def tree():
    return _tree(N_LEAVES)


def test_get_num_params_vs_sum_of_sizes(benchmark, tree):
    anchor = lambda: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    assert tt.get_num_params(tree) == anchor()
    ours_t, anchor_t = _best_of(lambda: tt.get_num_params(tree)), _best_of(anchor)
    report(f"get_num_params, {len(jax.tree.leaves(tree))} leaves", ours_t, anchor_t, "sum(x.size)", target="<= 1.5")
    benchmark(tt.get_num_params, tree)


def test_tabulate_params_under_a_second(benchmark, tree):
    t = _best_of(lambda: tt.tabulate_params(tree), repeat=3)
    anchor_t = _best_of(lambda: sum(x.size for x in jax.tree.leaves(tree)), repeat=3)
    report(f"tabulate_params, {len(jax.tree.leaves(tree))} leaves", t, anchor_t, "sum(x.size)", target="ours < 1 s")
    benchmark(tt.tabulate_params, tree)
