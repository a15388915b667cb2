"""Library functions on tens of thousands of leaves, and the norm hooks' compile, against their anchors (issue 48).

CPU time (``time.process_time``: other jobs on a shared machine do not count), the fastest of a few calls, each
function and its anchor in the same run on the same tree. Sizes (``TREETOOLS_BENCH_SCALE`` scales them):

* 100,000 abstract leaves (nothing allocated; transformer-like nesting, 4 leaves a layer): ``get_num_params``,
  ``tabulate_params``, ``get_param_mask_fn`` (20 patterns), ``make_abstract`` against a plain ``jax.tree.map``
  doing the least of the same per-leaf work (sizes; shape and dtype; a struct; the regexes); ``memory_plan``
  (8-device mesh, adamw) against ``jax.eval_shape(adamw.init)``, which it runs.
* ``norm_metrics(grads=g)`` trace + compile on 300 and 1,000 leaves against ``optax.tree.norm`` asked for the
  same outputs (the norm and the count of non-finite elements) and alone; per layer (``depth=2`` on this tree,
  one group a layer, what ``depth=1`` is on a flax model of ``block_i`` modules) and per leaf (``per_param``)
  against the same entries written with optax per group. 3,000 leaves take minutes of XLA compile on 2 cores
  for either side, so they run only with ``TREETOOLS_BENCH_NORMS_3000=1`` (not in ``make bench``).

Run: ``PYTHONPATH=$PWD .venv/bin/python -m pytest -q -s benchmarks/test_scale_library_bench.py``; the 3,000-leaf
compiles alone: ``TREETOOLS_BENCH_NORMS_3000=1 nice -n 10 .venv/bin/python -m pytest -q -s
benchmarks/test_scale_library_bench.py -k "norm and 3000"``
"""

from __future__ import annotations

import os
import re
import time

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import SCALE, report

import treetools as tt

N_LIBRARY = max(int(100_000 * SCALE), 80)  # at least the 19 layers PATTERNS names (4 leaves a layer)
LARGE_NORMS = (3_000,) if os.environ.get("TREETOOLS_BENCH_NORMS_3000") else ()  # minutes of XLA for optax
N_NORMS = [max(int(n * SCALE), 8) for n in (300, 1_000, *LARGE_NORMS)]
PATTERNS = [rf"layers/{i}/attn/bias$" for i in range(19)] + [r"mlp/bias$"]


def _tree(n: int) -> dict:
    def leaf(*shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype)

    return {"layers": {str(i): {
        "attn": {"kernel": leaf(64, 64, dtype=jnp.bfloat16), "bias": leaf(64)},
        "mlp": {"kernel": leaf(64, 256, dtype=jnp.bfloat16), "bias": leaf(256)},
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


def _trace_compile(fn, g) -> tuple[float, list[str]]:
    """CPU seconds to trace and compile ``fn`` on ``g`` (a new function each call: no cached trace), and its keys."""
    t0 = time.process_time()
    lowered = jax.jit(fn).lower(g)
    lowered.compile()
    out = lowered.out_info
    return time.process_time() - t0, sorted(out) if isinstance(out, dict) else []


def _count(leaves) -> jax.Array:  # the non-finite count, written plainly
    return sum(jnp.sum(~jnp.isfinite(x)).astype(jnp.int32) for x in leaves)


@pytest.mark.parametrize("n", N_NORMS)
def test_norm_metrics_compile_against_optax_with_the_same_outputs(n):
    g = _tree(n)

    def optax_same(g):  # what norm_metrics(grads=g) gives: the global norm and the non-finite count
        return {"grad_norm": optax.tree.norm(g), "nonfinite_grads": _count(jax.tree.leaves(g))}

    ours, keys = _trace_compile(lambda g: tt.norm_metrics(grads=g), g)
    same, same_keys = _trace_compile(optax_same, g)
    alone, _ = _trace_compile(lambda g: optax.tree.norm(g), g)
    assert keys == same_keys
    leaves = len(jax.tree.leaves(g))
    report(f"norm_metrics(grads=) trace+compile, {leaves} leaves (CPU)", ours, same, "optax norm + count",
           target="<= 1.5")
    report(f"norm_metrics(grads=) trace+compile, {leaves} leaves (CPU)", ours, alone, "optax.tree.norm alone")


def _groups(g: dict, per_param: bool) -> dict[str, object]:
    """The subtrees ``norm_metrics`` groups by on ``_tree``: each layer (``depth=2``), or each leaf (``per_param``)."""
    layers = {f"layers/{i}": sub for i, sub in g["layers"].items()}
    if not per_param:
        return layers
    return {f"{name}/{module}/{leaf}": x for name, sub in layers.items() for module, d in sub.items()
            for leaf, x in d.items()}


@pytest.mark.parametrize("n", N_NORMS)
@pytest.mark.parametrize("grouping", ["depth=2", "per_param"])
def test_grouped_norm_metrics_compile_against_optax_per_group(n, grouping):
    g = _tree(n)
    per_param = grouping == "per_param"
    options = {"per_param": True} if per_param else {"depth": 2}

    def optax_same(g):  # the same entries, one optax.tree.norm and one count a group
        out = {"grad_norm": optax.tree.norm(g), "nonfinite_grads": _count(jax.tree.leaves(g))}
        for name, sub in _groups(g, per_param).items():
            out[f"grad_norm/{name}"] = optax.tree.norm(sub)
            out[f"nonfinite_grads/{name}"] = _count(jax.tree.leaves(sub))
        return out

    ours, keys = _trace_compile(lambda g: tt.norm_metrics(grads=g, **options), g)
    same, same_keys = _trace_compile(optax_same, g)
    assert keys == same_keys
    leaves = len(jax.tree.leaves(g))
    report(f"norm_metrics(grads=, {grouping}) trace+compile, {leaves} leaves (CPU)", ours, same,
           "optax per group + counts", target="<= 1.5")
