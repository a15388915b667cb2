"""Why the norm benchmark is measured the way it is: three checks, one run.

Run: ``.venv/bin/python benchmarks/norm_diagnostics.py`` (about 1 min; not part
of ``make bench``); ``... norm_diagnostics.py programs`` prints the compiled
CPU programs' instructions instead (no clock: compare two checkouts). Same tree as ``test_norms_bench.py`` (303M float32
parameters, 203 leaves; ``TREETOOLS_BENCH_SCALE`` scales it).

1. Kernels: the per-leaf sum of squares written five ways, each compiled
   whole-tree under jit, in shuffled rounds. If they agree, no formulation of
   the reduction can beat ``optax.tree.norm`` on this backend.
2. Slot: one compiled program timed in a fixed order, right after the 1.2 GB
   floor and right before it. A difference is what a fixed order charges to
   whichever function sits in the slow slot.
3. Buffers: ``optax.tree.norm`` on the same shapes held in numpy-owned memory
   (``device_put`` may keep an aligned host array) and in XLA-allocated copies.
"""

from __future__ import annotations

import os
import statistics
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from test_norms_bench import _build, _device_owned, _shapes, time_rounds  # noqa: E402

ROUNDS = 15


def _print(title: str, times: dict[str, list[float]], base: str) -> None:
    print(title)
    for key, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, times[base]))
        print(f"  {key:44s} median {statistics.median(t) * 1e3:7.2f} ms   paired ratio to {base}: {ratio:.3f}")


def _whole_tree(leaf_sq):
    return jax.jit(lambda t: jnp.sqrt(sum(leaf_sq(x) for x in t.values())))


def main() -> None:
    shapes = _shapes()
    tree = _build(shapes)
    n = sum(x.size for x in tree.values())
    flat = _device_owned(jax.device_put(np.random.default_rng(1).standard_normal(n, dtype=np.float32)))
    optax_norm = jax.jit(optax.tree.norm)
    floor = jax.jit(lambda x: jnp.sqrt(jnp.vdot(x, x)))
    print(f"tree: {len(tree)} leaves, {n / 1e6:.1f}M float32 params, {ROUNDS} rounds")

    kernels = {
        "optax.tree.norm": (optax_norm, tree),
        "jnp.sum(jnp.square(x)) (treetools)": (_whole_tree(lambda x: jnp.sum(jnp.square(x))), tree),
        "jnp.vdot(x, x)": (_whole_tree(lambda x: jnp.vdot(x, x)), tree),
        "jnp.einsum('...,...->', x, x)": (_whole_tree(lambda x: jnp.einsum("...,...->", x, x)), tree),
        "jnp.dot(x.ravel(), x.ravel())": (_whole_tree(lambda x: jnp.dot(x.ravel(), x.ravel())), tree),
        "row sums, then sum": (_whole_tree(lambda x: jnp.sum(jnp.sum(x * x, axis=-1))), tree),
    }
    _print("1. kernels (shuffled rounds)", time_rounds(kernels, ROUNDS), "optax.tree.norm")

    slot = {
        "optax.tree.norm, first in the round": (optax_norm, tree),
        "floor": (floor, flat),
        "optax.tree.norm, right after the floor": (optax_norm, tree),
    }
    _print("2. slot (fixed order: the same program twice)", time_rounds(slot, ROUNDS, shuffle=False),
           "optax.tree.norm, first in the round")

    rng = np.random.default_rng(2)
    host = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    numpy_owned = jax.block_until_ready({k: jax.device_put(v) for k, v in host.items()})
    buffers = {
        "optax.tree.norm, XLA-allocated buffers": (optax_norm, {k: _device_owned(v) for k, v in numpy_owned.items()}),
        "optax.tree.norm, device_put of numpy arrays": (optax_norm, numpy_owned),
    }
    _print("3. buffers (shuffled rounds)", time_rounds(buffers, ROUNDS), "optax.tree.norm, XLA-allocated buffers")


def programs() -> None:
    """Print, as JSON, the instructions of the compiled XLA:CPU programs of the norm calls (no clock).

    Run it in two checkouts and compare: equal multisets mean the CPU runs the
    same program, so a change cannot have made it slower. Cases: per-leaf
    grads, the g/p/u dict, the global norm, and FSDP x8 with Auto and Explicit axes.
    """
    import collections
    import json
    import re

    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from treetools.pytree.norms import get_sharded_global_norm, norm_metrics

    def ops(fn, tree) -> dict[str, int]:
        text = jax.jit(fn).lower(tree).compile().as_text()
        entry = text[text.find("\nENTRY") :]
        return dict(sorted(collections.Counter(re.findall(r"= (?:\([^)]*\)|\S+) ([a-z][\w\-]*)\(", entry)).items()))

    tree = {f"w{i}": jax.ShapeDtypeStruct((256, 128 * (i + 1)), jnp.float32) for i in range(6)}
    out = {
        "norm_metrics(g, per_param)": ops(lambda t: norm_metrics(grads=t, per_param=True), tree),
        "norm_metrics(g, p, u, per_param)": ops(lambda t: norm_metrics(grads=t, params=t, updates=t, per_param=True), tree),
        "get_sharded_global_norm": ops(get_sharded_global_norm, tree),
    }
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(kind,))
        sharded = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P(None, "fsdp"))) for k, v in tree.items()}
        out[f"FSDP x8 {kind.name} norm_metrics(g, per_param)"] = ops(lambda t: norm_metrics(grads=t, per_param=True), sharded)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    programs() if sys.argv[1:] == ["programs"] else main()
