"""Why ``norm_metrics`` combines many per-leaf totals by halving a stack on CPU (issue 48): two checks, one run.

Run: ``PYTHONPATH=$PWD nice -n 10 .venv/bin/python benchmarks/norm_compile_diagnostics.py [N]`` (N leaves,
default 2,000; a few minutes of CPU; not part of ``make bench``). Compare two checkouts by PYTHONPATH.

1. Compile (trace + ``.compile()``, CPU time) of the sum of squares of N leaves of
   ``test_scale_library_bench._tree``, the totals combined five ways: returned unadded (the floor), a chain
   of adds (``optax.tree.norm``'s, ``_tree_total``'s before), a pairwise tree of adds, ``jnp.sum`` of the
   stack, and the stack halved (``treetools.pytree.sums._fold``'s on CPU).
2. ``norm_metrics(grads=)`` on N/2 random leaves: its global norm against numpy float64, and the compiled
   program's run time (median of 30 calls, CPU time).
"""

from __future__ import annotations

import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from test_scale_library_bench import _tree

import treetools as tt


def _sq(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


def _pairwise(xs: list[jax.Array]) -> jax.Array:
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def _halving(xs: list[jax.Array]) -> jax.Array:
    v = jnp.stack(xs)
    while v.shape[0] > 1:
        if v.shape[0] % 2:
            v = jnp.concatenate([v, jnp.zeros((1,), v.dtype)])
        v = v[0::2] + v[1::2]
    return v[0]


COMBINE = {
    "unadded (floor)": lambda xs: xs,
    "chain of adds": lambda xs: sum(xs),
    "pairwise tree of adds": _pairwise,
    "jnp.sum(jnp.stack)": lambda xs: jnp.sum(jnp.stack(xs)),
    "stack halved": _halving,
}


def main(n: int) -> None:
    tree = _tree(n)
    leaves = len(jax.tree.leaves(tree))
    for name, combine in COMBINE.items():
        t0 = time.process_time()
        jax.jit(lambda g, combine=combine: combine([_sq(x) for x in jax.tree.leaves(g)])).lower(tree).compile()
        print(f"compile, {leaves} leaves, {name}: {time.process_time() - t0:.2f} CPU s", flush=True)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), _tree(n // 2))
    fn = jax.jit(lambda g: tt.norm_metrics(grads=g))
    norm = float(jax.block_until_ready(fn(grads))["grad_norm"])
    exact = np.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(grads)))
    times = []
    for _ in range(30):
        t0 = time.process_time()
        jax.block_until_ready(fn(grads))
        times.append(time.process_time() - t0)
    print(f"norm_metrics, {len(jax.tree.leaves(grads))} leaves ({tt.__file__}): grad_norm {norm:.5f}, float64 "
          f"{exact:.5f} (relative error {abs(norm - exact) / exact:.1e}); run {1e3 * sorted(times)[15]:.2f} ms CPU")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2_000)
