"""treetools' norms alone on one device, against optax, the naive optax dict and the bandwidth floor.

Run (from the repo root; any backend, a GPU when there is one)::

    .venv/bin/python benchmarks/gpu_norms.py                              # full size: 303M params, 203 leaves
    TREETOOLS_BENCH_SCALE=0.01 ROUNDS=5 .venv/bin/python benchmarks/gpu_norms.py   # a quick run on CPU

Environment: ``TREETOOLS_BENCH_SCALE`` (parameter count, leaf count stays 203),
``ROUNDS`` (default 15), ``DTYPES`` (default ``float32,bfloat16``), ``OUT``
(a folder: results as ``gpu_norms.json``).

Issue 15's targets, printed as met / not met:

* ``norm_metrics(grads=g)`` and ``get_sharded_global_norm(g)`` cost no more
  than ``optax.tree.norm(g)``;
* ``norm_metrics(grads=g, per_param=True)`` runs at >= 50% of the floor's
  bandwidth (the floor: one fused sum of squares over one flat array of the
  same bytes, which no norm of the tree can beat);
* ``norm_metrics(grads=g, params=p, updates=u, per_param=True)`` costs no
  more than the same dict written naively with optax (same keys).

The last section times four ways to count non-finite gradients beside the
sum of squares (none; a sibling reduction; one variadic reduction; a lazy
``lax.cond``), which is how treetools chose its per-backend form.
"""

from __future__ import annotations

import math
import os

import gpu_common as common
import jax
import jax.numpy as jnp
import numpy as np
import optax

import treetools as tt

N_LAYERS = 20


def _dim(full: int) -> int:
    return max(8, int(round(full * math.sqrt(common.SCALE) / 8)) * 8)


def shapes() -> dict[str, tuple[int, ...]]:
    """GPT-2-medium-like: 20 blocks of attention + MLP + 2 norms, embedding, final norm (203 leaves)."""
    d, vocab = _dim(1024), _dim(50304)
    out = {"embed": (vocab, d), "final_ln/scale": (d,), "final_ln/bias": (d,)}
    for i in range(N_LAYERS):
        block = {f"attn/{n}": (d, d) for n in "qkvo"}
        block |= {"mlp/wi": (d, 4 * d), "mlp/bi": (4 * d,), "mlp/wo": (4 * d, d), "mlp/bo": (d,)}
        block |= {"ln1/scale": (d,), "ln2/scale": (d,)}
        out |= {f"layer_{i}/{k}": s for k, s in block.items()}
    return out


def build(dtype, seed: int) -> dict[str, jax.Array]:
    """Random leaves made on the device (no host transfer), one compiled program per shape."""
    key = jax.random.PRNGKey(seed)
    make = jax.jit(lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype), static_argnums=1)
    return jax.block_until_ready({k: make(jax.random.fold_in(key, i), s) for i, (k, s) in enumerate(shapes().items())})


# --------------------------------------------------------------------------- #
# What a trainer writes with optax today: the same keys as ours
# --------------------------------------------------------------------------- #


def _leaf_norm(x):
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def _nonfinite(t):
    return sum(jnp.sum(~jnp.isfinite(x)) for x in t.values())


def naive_grads(g):
    return {"grad_norm": optax.tree.norm(g), "nonfinite_grads": _nonfinite(g)}


def _nonfinite_per_leaf(g):
    return {f"nonfinite_grads/{k}": jnp.sum(~jnp.isfinite(x)) for k, x in g.items()}


def naive_grads_per_param(g):
    return naive_grads(g) | {f"grad_norm/{k}": _leaf_norm(x) for k, x in g.items()} | _nonfinite_per_leaf(g)


def naive_gpu_dict(g, p, u):
    out = naive_grads(g) | {"param_norm": optax.tree.norm(p), "update_norm": optax.tree.norm(u)}
    out["update_ratio"] = out["update_norm"] / out["param_norm"]
    for kind, t in (("grad_norm", g), ("param_norm", p), ("update_norm", u)):
        out |= {f"{kind}/{k}": _leaf_norm(x) for k, x in t.items()}
    out |= {f"update_ratio/{k}": out[f"update_norm/{k}"] / out[f"param_norm/{k}"] for k in g}
    return out | _nonfinite_per_leaf(g)


# --------------------------------------------------------------------------- #
# Count formulations (one per leaf, beside its sum of squares)
# --------------------------------------------------------------------------- #


def _sq(x):
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


def count_none(g):
    return jnp.sqrt(sum(_sq(x) for x in g.values())), jnp.int32(0)


def count_siblings(g):
    sq = [_sq(x) for x in g.values()]
    return jnp.sqrt(sum(sq)), sum(jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in g.values())


def count_variadic(g):
    sq, bad = [], []
    for x in g.values():
        s, c = jax.lax.reduce(
            (jnp.square(x.astype(jnp.float32)), (~jnp.isfinite(x)).astype(jnp.int32)),
            (jnp.float32(0), jnp.int32(0)), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(x.ndim)),
        )
        sq.append(s)
        bad.append(c)
    return jnp.sqrt(sum(sq)), sum(bad)


def count_lazy_cond(g):
    total = sum(_sq(x) for x in g.values())
    count = jax.lax.cond(jnp.isfinite(total), lambda: jnp.int32(0),
                         lambda: sum(jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in g.values()))
    return jnp.sqrt(total), count


# --------------------------------------------------------------------------- #


def case(dtype_name: str) -> dict:
    dtype = jnp.dtype(dtype_name)
    g, p, u = build(dtype, 0), build(dtype, 1), build(dtype, 2)
    nbytes = sum(x.nbytes for x in g.values())
    n = sum(x.size for x in g.values())
    flat = jax.block_until_ready(jax.random.normal(jax.random.PRNGKey(9), (n,), jnp.float32).astype(dtype))
    j = jax.jit
    fns = {
        "floor (one flat array)": (j(lambda x: jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))), flat),
        "optax.tree.norm(g)": (j(optax.tree.norm), g),
        "optax.tree.norm(g), again (A/A control)": (j(lambda t: optax.tree.norm(t)), g),
        "tt.get_sharded_global_norm(g)": (j(tt.get_sharded_global_norm), g),
        "tt.norm_metrics(g)": (j(lambda t: tt.norm_metrics(grads=t)), g),
        "naive optax dict (g)": (j(naive_grads), g),
        "tt.norm_metrics(g, per_param)": (j(lambda t: tt.norm_metrics(grads=t, per_param=True)), g),
        "naive optax dict (g, per_param)": (j(naive_grads_per_param), g),
        "tt.norm_metrics(g, p, u, per_param)": (
            j(lambda g, p, u: tt.norm_metrics(grads=g, params=p, updates=u, per_param=True)), g, p, u),
        "naive optax dict (g, p, u, per_param)": (j(naive_gpu_dict), g, p, u),
    }
    reads = {k: (3 if "p, u" in k else 1) for k in fns}
    # Same keys and values as the naive dicts; the global norm against float64 on the host.
    for ours, naive in (("tt.norm_metrics(g)", "naive optax dict (g)"),
                        ("tt.norm_metrics(g, per_param)", "naive optax dict (g, per_param)"),
                        ("tt.norm_metrics(g, p, u, per_param)", "naive optax dict (g, p, u, per_param)")):
        a, b = (fns[k][0](*fns[k][1:]) for k in (ours, naive))
        assert a.keys() == b.keys(), (ours, sorted(set(a) ^ set(b))[:5])
        worst = max(abs(float(a[k]) - float(b[k])) / max(abs(float(b[k])), 1e-30) for k in b)
        assert worst < (1e-4 if dtype == jnp.float32 else 2e-2), (ours, worst)
    truth = math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in g.values()))
    got = float(fns["tt.get_sharded_global_norm(g)"][0](g)[0])
    got_optax = float(fns["optax.tree.norm(g)"][0](g))

    times = common.time_rounds(fns)
    floor = common.median_ms(times, "floor (one flat array)")
    rows = {}
    print(f"\n== {dtype_name}: {len(g)} leaves, {n / 1e6:.1f}M params, {nbytes / 1e9:.3f} GB per tree; "
          f"global norm rel. error vs float64: treetools {abs(got - truth) / truth:.1e}, optax {abs(got_optax - truth) / truth:.1e}")
    print(f"{'function':40s} {'thr ms':>8s} {'lat ms':>8s} {'GB/s':>6s} {'% floor bw':>10s}  compiled program")
    for key in fns:
        ms = common.median_ms(times, key)
        rows[key] = {
            "throughput_ms": ms, "latency_ms": common.median_ms(times, key, "latency"),
            "GBps": reads[key] * nbytes / ms / 1e6, "floor_bandwidth_pct": 100 * reads[key] * floor / ms,
            "structure": common.structure(fns[key][0], *fns[key][1:]),
        }
        r = rows[key]
        print(f"{key:40s} {ms:8.3f} {r['latency_ms']:8.3f} {r['GBps']:6.0f} {r['floor_bandwidth_pct']:9.0f}%  {r['structure']}")

    checks = [
        ("optax.tree.norm(g), again (A/A control)", "optax.tree.norm(g)", "= 1.0: the protocol's own spread"),
        ("tt.norm_metrics(g)", "optax.tree.norm(g)", "<= 1.0"),
        ("tt.get_sharded_global_norm(g)", "optax.tree.norm(g)", "<= 1.0"),
        ("tt.norm_metrics(g)", "naive optax dict (g)", "<= 1.0"),
        ("tt.norm_metrics(g, per_param)", "naive optax dict (g, per_param)", "<= 1.0"),
        ("tt.norm_metrics(g, p, u, per_param)", "naive optax dict (g, p, u, per_param)", "<= 1.0"),
    ]
    print("paired ratios (median over rounds, IQR), throughput:")
    verdicts = {}
    for who, against, target in checks:
        med, q1, q3 = common.paired(times, who, against)
        ok = med <= 1.0 or q1 <= 1.0 <= q3
        verdicts[f"{who} / {against}"] = {"ratio": med, "iqr": [q1, q3], "target": target, "met": ok}
        print(f"  {who} / {against}: {med:.3f} ({q1:.3f}-{q3:.3f}) target {target}: {'met' if ok else 'NOT met'}")
    pct = rows["tt.norm_metrics(g, per_param)"]["floor_bandwidth_pct"]
    verdicts["tt.norm_metrics(g, per_param) floor bandwidth"] = {"pct": pct, "target": ">= 50%", "met": pct >= 50}
    print(f"  tt.norm_metrics(g, per_param): {pct:.0f}% of the floor's bandwidth, target >= 50%: {'met' if pct >= 50 else 'NOT met'}")

    counts = {
        "sum of squares, no count": (jax.jit(count_none), g),
        "+ count, sibling reduction": (jax.jit(count_siblings), g),
        "+ count, one variadic reduction": (jax.jit(count_variadic), g),
        "+ count behind lax.cond": (jax.jit(count_lazy_cond), g),
    }
    ctimes = common.time_rounds(counts)
    print("count formulations (per leaf, beside the sum of squares), throughput:")
    crows = {}
    for key in counts:
        med, q1, q3 = common.paired(ctimes, key, "sum of squares, no count")
        norm = float(counts[key][0](g)[0])  # a variadic reduce may sum sequentially (XLA:CPU does): check it
        crows[key] = {"throughput_ms": common.median_ms(ctimes, key), "ratio_to_no_count": med,
                      "norm_rel_error_vs_f64": abs(norm - truth) / truth, "structure": common.structure(counts[key][0], g)}
        print(f"  {key:34s} {crows[key]['throughput_ms']:8.3f} ms  x{med:.3f} ({q1:.3f}-{q3:.3f})  "
              f"rel. error {crows[key]['norm_rel_error_vs_f64']:.1e}  {crows[key]['structure']}")
    return {"leaves": len(g), "params": n, "bytes": nbytes, "truth_f64": truth, "treetools": got, "optax": got_optax,
            "functions": rows, "targets": verdicts, "count_formulations": crows}


def main() -> None:
    info = common.header("gpu_norms")
    results = {"info": info}
    for name in os.environ.get("DTYPES", "float32,bfloat16").split(","):
        results[name] = case(name)
    common.dump("gpu_norms.json", results)


if __name__ == "__main__":
    main()
