"""Library functions on tens of thousands of leaves, and the norm hooks' compile, against their anchors (issue 48).

CPU time (``time.process_time``: other jobs on a shared machine do not count), the fastest of a few calls, each
function and its anchor in the same run on the same tree. Sizes (``TREETOOLS_BENCH_SCALE`` scales them):

* 100,000 abstract leaves (nothing allocated; transformer-like nesting, 4 leaves a layer): ``get_num_params``,
  ``tabulate_params``, ``get_param_mask_fn`` (20 patterns), ``make_abstract`` against a plain ``jax.tree.map``
  doing the least of the same per-leaf work (sizes; shape and dtype; a struct; the regexes); ``memory_plan``
  (8-device mesh, adamw) against ``jax.eval_shape(adamw.init)``, which it runs.
* ``norm_metrics(grads=g)`` trace + compile on 300 and 1,000 leaves against ``optax.tree.norm`` asked for the
  same outputs (the norm and the count of non-finite elements) and alone. 3,000 leaves take minutes of XLA
  compile on 2 cores for either (the report's 115 CPU s for optax alone), so they are left out here.

Run: ``PYTHONPATH=$PWD .venv/bin/python -m pytest -q -s benchmarks/test_scale_library_bench.py``
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import SCALE, report

import treetools as tt

N_LIBRARY = max(int(100_000 * SCALE), 80)  # at least the 19 layers PATTERNS names (4 leaves a layer)
N_NORMS = [max(int(n * SCALE), 8) for n in (300, 1_000)]
PATTERNS = [rf"layers/{i}/attn/bias$" for i in range(19)] + [r"mlp/bias$"]


def _tree(n: int) -> dict:
    return {"layers": {str(i): {
        "attn": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), "bias": jax.ShapeDtypeStruct((64,), jnp.float32)},
        "mlp": {"kernel": jax.ShapeDtypeStruct((64, 256), jnp.bfloat16), "bias": jax.ShapeDtypeStruct((256,), jnp.float32)},
    } for i in range(n // 4)}}


def _cpu(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


@pytest.fixture(scope="module")
def tree():
    return _tree(N_LIBRARY)


def test_library_functions_against_a_tree_map(tree):
    n = len(jax.tree.leaves(tree))
    joined = re.compile("|".join(PATTERNS))
    cases = {
        "get_num_params": (lambda: tt.get_num_params(tree), lambda: jax.tree.map(lambda x: x.size, tree),
                           "tree.map(size)"),
        # A table names every leaf: its anchor makes each leaf's line of text (path, shape, dtype, size), the least
        # a table of one row per leaf does; against tree.map(shape, dtype), which names nothing, it is ~20x.
        "tabulate_params": (lambda: tt.tabulate_params(tree),
                            lambda: "\n".join(jax.tree.leaves(jax.tree_util.tree_map_with_path(
                                lambda p, x: f"{jax.tree_util.keystr(p)} {x.shape} {x.dtype} {x.size}", tree))),
                            "tree.map_with_path(row text)"),
        "get_param_mask_fn (20 patterns)": (
            lambda: tt.get_param_mask_fn(PATTERNS)(tree),
            lambda: jax.tree_util.tree_map_with_path(lambda p, x: not joined.search(jax.tree_util.keystr(p)), tree),
            "tree.map_with_path(regex)"),
        "make_abstract": (lambda: tt.make_abstract(tree),
                          lambda: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree),
                          "tree.map(ShapeDtypeStruct)"),
    }
    assert tt.get_num_params(tree) == sum(x.size for x in jax.tree.leaves(tree))
    for name, (ours, anchor, anchor_name) in cases.items():
        report(f"{name}, {n} leaves (CPU)", _cpu(ours), _cpu(anchor), anchor_name, target="<= 2")


def test_memory_plan_against_eval_shape_of_the_optimizer(tree):
    n = len(jax.tree.leaves(tree))
    # A new optimizer for each call: jax caches a trace by function, and both sides trace adamw's init.
    anchor = _cpu(lambda: jax.eval_shape(optax.adamw(1e-3).init, tree), repeat=1)
    ours = _cpu(lambda: tt.memory_plan(tree, mesh={"data": 2, "fsdp": 4}, optimizer=optax.adamw(1e-3)), repeat=1)
    plan = tt.memory_plan(tree, mesh={"data": 2, "fsdp": 4}, optimizer=optax.adamw(1e-3))
    assert plan.by_part["params"] == plan.by_part["grads"]
    report(f"memory_plan (8 devices, adamw), {n} leaves (CPU)", ours, anchor, "eval_shape(adamw.init)",
           target="<= 2")


def _trace_compile(fn, g) -> float:
    t0 = time.process_time()
    jax.jit(fn).lower(g).compile()
    return time.process_time() - t0


@pytest.mark.parametrize("n", N_NORMS)
def test_norm_metrics_compile_against_optax_with_the_same_outputs(n):
    g = _tree(n)

    def optax_same(g):  # what norm_metrics(grads=g) gives: the global norm and the non-finite count
        return {"grad_norm": optax.tree.norm(g),
                "nonfinite_grads": sum(jnp.sum(~jnp.isfinite(x)).astype(jnp.int32) for x in jax.tree.leaves(g))}

    ours = _trace_compile(lambda g: tt.norm_metrics(grads=g), g)  # a new function each time: no cache hit
    same = _trace_compile(optax_same, g)
    alone = _trace_compile(lambda g: optax.tree.norm(g), g)
    leaves = len(jax.tree.leaves(g))
    report(f"norm_metrics(grads=) trace+compile, {leaves} leaves (CPU)", ours, same, "optax norm + count",
           target="<= 1.5")
    report(f"norm_metrics(grads=) trace+compile, {leaves} leaves (CPU)", ours, alone, "optax.tree.norm alone")
