"""Norms on a ~300M-parameter transformer-shaped tree, against optax and a bandwidth floor.

Anchors, measured in the same run with the same timer:

* ``optax.tree.norm`` computing the global norm alone (what trainers use today);
* the floor: one fused sum of squares over a single flat float32 array of the
  same bytes (no tree, no per-leaf outputs): no norm of the tree can beat it.

Ours returns more (per-leaf norms; ``norm_metrics`` also counts non-finite
gradients) yet should take the same time: every array is read once.
Each test prints ``ours``, the anchor and the ratio (``make bench`` runs with -s).

Sizes: ``TREETOOLS_BENCH_SCALE`` (float, default 1.0) scales the parameter
count (the leaf count, ~200, stays); ``TREETOOLS_BENCH_ROUNDS`` (default 10)
sets the timed rounds; the median is reported (best-of swings by 10% on a
shared 2-core machine, the median by a few percent). The FSDP tests need 8 devices
(benchmarks/conftest.py forces 8 fake CPU devices before jax starts).
"""

from __future__ import annotations

import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import SCALE, report

from treetools.norms import get_sharded_global_norm, norm_metrics

ROUNDS = int(os.environ.get("TREETOOLS_BENCH_ROUNDS", "10"))
N_LAYERS = 20
# Always jitted: eager ops on sharded arrays put many collective programs in
# flight at once, which XLA:CPU on fake devices can deadlock on.
_OPTAX_NORM = jax.jit(optax.tree.norm)


def _dim(full: int) -> int:
    # Parameters scale with the square of the widths; keep multiples of 8 so
    # every leaf splits evenly over 8 devices.
    return max(8, int(round(full * math.sqrt(SCALE) / 8)) * 8)


D, VOCAB = _dim(1024), _dim(50304)


def _shapes() -> dict[str, tuple[int, ...]]:
    """GPT-2-medium-like: 20 blocks of attention + MLP + 2 norms, embedding, final norm (203 leaves)."""
    shapes = {"embed": (VOCAB, D), "final_ln/scale": (D,), "final_ln/bias": (D,)}
    for i in range(N_LAYERS):
        block = {f"attn/{n}": (D, D) for n in "qkvo"}
        block |= {"mlp/wi": (D, 4 * D), "mlp/bi": (4 * D,), "mlp/wo": (4 * D, D), "mlp/bo": (D,)}
        block |= {"ln1/scale": (D,), "ln2/scale": (D,)}
        shapes |= {f"layer_{i}/{k}": s for k, s in block.items()}
    return shapes


def _fsdp_spec(shape: tuple[int, ...]) -> P:
    # Shard the largest dimension over fsdp, as FSDP does.
    big = int(np.argmax(shape))
    return P(*("fsdp" if i == big else None for i in range(len(shape))))


def _build(shapes, shardings=None) -> dict[str, jax.Array]:
    # Host random numbers, placed leaf by leaf: no compile per shape, one leaf on the host at a time.
    rng = np.random.default_rng(0)
    out = {}
    for k, s in shapes.items():
        host = rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)
        out[k] = jax.device_put(host, shardings[k] if shardings else None)
    return jax.block_until_ready(out)


def _compare(name: str, ours: tuple, anchors: dict[str, tuple]) -> None:
    """Time ``ours`` and each anchor, ``(fn, *args)``, in interleaved rounds; print median ratios.

    Interleaving keeps a shared machine's load changes from landing on one side only.
    """
    fns = {**anchors, "ours": ours}
    for fn, *args in fns.values():
        jax.block_until_ready(fn(*args))  # compile + warm up
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(ROUNDS):
        for key, (fn, *args) in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[key].append(time.perf_counter() - start)
    median = {key: statistics.median(t) for key, t in times.items()}
    for anchor in anchors:
        report(name + " [median]", median["ours"], median[anchor], anchor,
               target="<= 1.0" if anchor.startswith("optax") else "")


def _bench(benchmark, fn, *args) -> None:
    benchmark.pedantic(lambda: jax.block_until_ready(fn(*args)), rounds=ROUNDS, iterations=1, warmup_rounds=1)


@pytest.fixture(scope="module")
def tree():
    t = _build(_shapes())
    n = sum(x.size for x in t.values())
    print(f"\ntree: {len(t)} leaves, {n / 1e6:.1f}M float32 params ({n * 4 / 2**30:.2f} GiB), scale {SCALE}")
    return t


@pytest.fixture(scope="module")
def floor(tree):
    """``(fn, flat)``: one fused sum of squares over one flat array of the tree's bytes."""
    n = sum(x.size for x in tree.values())
    flat = jax.device_put(np.random.default_rng(1).standard_normal(n, dtype=np.float32))
    return jax.jit(lambda x: jnp.sqrt(jnp.vdot(x, x))), flat


def test_global_norm_vs_optax(benchmark, tree, floor):
    ours = jax.jit(get_sharded_global_norm)
    g, per_leaf = ours(tree)
    np.testing.assert_allclose(float(g), float(_OPTAX_NORM(tree)), rtol=1e-4)
    assert len(per_leaf) == len(tree)
    _compare("get_sharded_global_norm (+ per-leaf)", (ours, tree), {"optax.tree.norm": (_OPTAX_NORM, tree), "floor": floor})
    _bench(benchmark, ours, tree)


def test_global_norm_only_vs_optax(benchmark, tree, floor):
    """The same reduction with one output: separates the work from the cost of ~200 outputs."""
    ours = jax.jit(lambda t: norm_metrics(grads=t)["grad_norm"])
    np.testing.assert_allclose(float(ours(tree)), float(_OPTAX_NORM(tree)), rtol=1e-4)
    _compare("norm_metrics (global only)", (ours, tree), {"optax.tree.norm": (_OPTAX_NORM, tree), "floor": floor})
    _bench(benchmark, ours, tree)


def test_norm_metrics_per_param_vs_optax(benchmark, tree, floor):
    ours = jax.jit(lambda t: norm_metrics(grads=t, per_param=True))
    m = ours(tree)
    np.testing.assert_allclose(float(m["grad_norm"]), float(_OPTAX_NORM(tree)), rtol=1e-4)
    assert len(m) == 2 + len(tree) and int(m["nonfinite_grads"]) == 0
    _compare("norm_metrics(per_param=True)", (ours, tree), {"optax.tree.norm": (_OPTAX_NORM, tree), "floor": floor})
    _bench(benchmark, ours, tree)


# --------------------------------------------------------------------------- #
# FSDP over 8 devices: GSPMD (jit on global arrays) and shard_map on boxes
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def fsdp(tree):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (benchmarks/conftest.py forces 8 fake CPU devices)")
    # Auto axes: classic GSPMD, the compiler places the collectives.
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8], axis_types=(jax.sharding.AxisType.Auto,))
    shapes = _shapes()
    specs = {k: _fsdp_spec(s) for k, s in shapes.items()}
    return mesh, specs, _build(shapes, {k: NamedSharding(mesh, s) for k, s in specs.items()})


def test_fsdp_gspmd_vs_optax(benchmark, fsdp):
    mesh, specs, sharded = fsdp
    ours = jax.jit(lambda t: norm_metrics(grads=t, per_param=True))
    np.testing.assert_allclose(float(ours(sharded)["grad_norm"]), float(_OPTAX_NORM(sharded)), rtol=1e-4)
    _compare("FSDP x8 GSPMD norm_metrics(per_param=True)", (ours, sharded), {"optax.tree.norm (GSPMD)": (_OPTAX_NORM, sharded)})
    _bench(benchmark, ours, sharded)


def test_fsdp_shard_map_vs_optax(benchmark, fsdp):
    import flax.linen as nn

    mesh, specs, sharded = fsdp
    boxes = {k: nn.Partitioned(v, names=tuple(specs[k])) for k, v in sharded.items()}
    ours = jax.jit(
        jax.shard_map(
            lambda t: norm_metrics(grads=t, per_param=True), mesh=mesh, in_specs=(nn.get_partition_spec(boxes),), out_specs=P()
        )
    )
    np.testing.assert_allclose(float(ours(boxes)["grad_norm"]), float(_OPTAX_NORM(sharded)), rtol=1e-4)
    _compare(
        "FSDP x8 shard_map norm_metrics(per_param=True)", (ours, boxes), {"optax.tree.norm (GSPMD)": (_OPTAX_NORM, sharded)}
    )
    _bench(benchmark, ours, boxes)
