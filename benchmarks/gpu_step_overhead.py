"""What a trainer feels: a jitted GPT train step with and without norm logging.

Run (from the repo root; any backend, a GPU when there is one)::

    .venv/bin/python benchmarks/gpu_step_overhead.py          # full size: 354M params, 387 leaves, batch 8 x 1024
    TREETOOLS_BENCH_SCALE=0.002 ROUNDS=3 .venv/bin/python benchmarks/gpu_step_overhead.py   # a quick run on CPU

Environment: ``TREETOOLS_BENCH_SCALE`` (1.0: 24 layers, width 1024, vocab
50304, batch 8 x 1024 tokens; smaller values shrink width, vocab and tokens,
never the 387 leaves), ``ROUNDS`` (default 6), ``STEPS`` per round (default
10), ``OUT`` (a folder: results as ``gpu_step_overhead.json``); ``LAYERS``
(default 24) only to smoke-test the script quickly.

Every variant is the same step (loss, grads, AdamW, apply) plus one metric
dict; its overhead is its step time minus the plain step's, medians over
interleaved rounds in shuffled order, with an A/A control (the plain step
timed twice). Issue 15's targets, printed as met / not met: each
``tt.norm_metrics`` form costs no more than the naive optax dict with the
same keys, and the global-only forms no more than ``optax.tree.norm``.

Issue 40 (training health, ``health_variants.py``): the per-module health
dict (update ratios, non-finite counts, largest |g|, Adam's moments) against
the same keys written with optax; plus the detector and the on-device
recorder (a step that writes nothing to the host); and ``every_n(10)``, the
health behind a ``lax.cond``, on a step that skips it and one that computes
it (on a GPU the conditional's predicate goes to the host: is skipping the
reductions still cheaper than doing them?). ``HEALTH=0`` leaves them out.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import gpu_common as common
import health_variants as health
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import treetools as tt
from treetools.pytree.paths import leaves_with_paths

LAYERS, HEADS = int(os.environ.get("LAYERS", "24")), 16  # LAYERS only to smoke-test the script (387 leaves at 24)
ROUNDS = int(os.environ.get("ROUNDS", "6"))
STEPS = int(os.environ.get("STEPS", "10"))


def _dim(full: int, multiple: int) -> int:
    return max(multiple, int(round(full * math.sqrt(common.SCALE) / multiple)) * multiple)


D, V, T, B = _dim(1024, HEADS * 8), _dim(50304, 64), _dim(1024, 16), 8


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.SelfAttention(num_heads=HEADS, dtype=jnp.bfloat16, deterministic=True)(h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        h = nn.Dense(4 * D, dtype=jnp.bfloat16)(h)
        return x + nn.Dense(D, dtype=jnp.bfloat16)(nn.gelu(h))


class GPT(nn.Module):
    @nn.compact
    def __call__(self, tok):
        emb = nn.Embed(V, D, dtype=jnp.bfloat16)
        x = emb(tok)
        for _ in range(LAYERS):
            x = Block()(x)
        return emb.attend(nn.LayerNorm(dtype=jnp.bfloat16)(x)).astype(jnp.float32)


# --------------------------------------------------------------------------- #
# Metric dicts: ours, and what a trainer writes with optax for the same keys
# --------------------------------------------------------------------------- #


def _leaf_norm(x):
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def _per_leaf(kind, t):
    return {f"{kind}/{path}": _leaf_norm(x) for path, x in leaves_with_paths(t)}


def naive(g, p=None, u=None, per_param=False):
    out = {"grad_norm": optax.tree.norm(g), "nonfinite_grads": sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree.leaves(g))}
    if p is not None:
        out |= {"param_norm": optax.tree.norm(p), "update_norm": optax.tree.norm(u)}
        out["update_ratio"] = out["update_norm"] / out["param_norm"]
    if per_param:
        for kind, t in (("grad_norm", g), ("param_norm", p), ("update_norm", u)):
            if t is not None:
                out |= _per_leaf(kind, t)
        # norm_metrics' per-leaf keys since issue 40: the non-finite count and, with params, the update ratio.
        out |= {f"nonfinite_grads/{path}": jnp.sum(~jnp.isfinite(x)) for path, x in leaves_with_paths(g)}
        if p is not None:
            out |= {f"update_ratio/{path}": out[f"update_norm/{path}"] / out[f"param_norm/{path}"]
                    for path, _ in leaves_with_paths(p)}
    return out


VARIANTS = {
    "none": lambda g, p, u: {},
    "none, again (A/A control)": lambda g, p, u: {},
    "optax.tree.norm(g)": lambda g, p, u: {"grad_norm": optax.tree.norm(g)},
    "tt.get_sharded_global_norm(g)[0]": lambda g, p, u: {"grad_norm": tt.get_sharded_global_norm(g)[0]},
    "tt.norm_metrics(g)": lambda g, p, u: tt.norm_metrics(grads=g),
    "naive optax dict (g)": lambda g, p, u: naive(g),
    "tt.norm_metrics(g, p, u)": lambda g, p, u: tt.norm_metrics(grads=g, params=p, updates=u),
    "naive optax dict (g, p, u)": lambda g, p, u: naive(g, p, u),
    "tt.norm_metrics(g, p, u, per_param)": lambda g, p, u: tt.norm_metrics(grads=g, params=p, updates=u, per_param=True),
    "naive optax dict (g, p, u, per_param)": lambda g, p, u: naive(g, p, u, per_param=True),
}
# Every variant as health_variants.py spells them: (g, p, u, new opt state, step, health state) -> (metrics, state).
VARIANTS = {name: (lambda fn: lambda g, p, u, o, i, h: (fn(g, p, u), h))(fn) for name, fn in VARIANTS.items()}
if os.environ.get("HEALTH", "1") != "0":
    VARIANTS |= {name: fn for name, fn in health.VARIANTS.items() if not name.startswith("none")}
# (ours, anchor): ours' overhead must not exceed the anchor's.
TARGETS = [
    ("tt.norm_metrics(g)", "optax.tree.norm(g)"),
    ("tt.get_sharded_global_norm(g)[0]", "optax.tree.norm(g)"),
    ("tt.norm_metrics(g)", "naive optax dict (g)"),
    ("tt.norm_metrics(g, p, u)", "naive optax dict (g, p, u)"),
    ("tt.norm_metrics(g, p, u, per_param)", "naive optax dict (g, p, u, per_param)"),
]
if "tt.norm_metrics health" in VARIANTS:
    TARGETS += [("tt.norm_metrics health", "naive health dict (optax)"),
                ("tt health every_n(10), a skipped step", "tt.norm_metrics health")]


def main() -> None:
    info = common.header("gpu_step_overhead")
    model = GPT()
    tok = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, V)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tok)["params"]
    n_leaves = len(jax.tree.leaves(params))
    print(f"model: {tt.get_num_params(params) / 1e6:.1f}M params, {n_leaves} leaves, batch {B} x {T}, width {D}, vocab {V}",
          flush=True)
    tx = optax.adamw(1e-4, weight_decay=0.1, mask=tt.get_param_mask_fn(exclude=[r"bias$", r"scale$", r"embedding$"]))
    opt = tx.init(params)

    def loss_fn(p, tok):
        logits = model.apply({"params": p}, tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    grads0 = jax.eval_shape(jax.grad(loss_fn), params, tok)
    hstate = health.health_state(grads0, params, grads0, opt)  # the detector's and the recorder's states

    def make_step(metric_fn):
        step = health.train_step(loss_fn, tx, metric_fn)
        return jax.jit(step).lower(params, opt, hstate, tok, jnp.int32(0)).compile()  # compiled once

    steps, structures = {}, {}
    at = {name: jnp.int32(health.STEP_OF.get(name, 0)) for name in VARIANTS}  # the step number each is timed at
    for name, fn in VARIANTS.items():
        start = time.perf_counter()
        steps[name] = make_step(fn)
        _, _, _, _, m = jax.block_until_ready(steps[name](params, opt, hstate, tok, at[name]))
        structures[name] = common.structure_of(steps[name].as_text())
        print(f"compile + first step {name}: {time.perf_counter() - start:.1f} s, {len(m)} metrics, {structures[name]}",
              flush=True)
    # Same keys and values, ours and naive.
    for ours, anchor in [t for t in TARGETS[2:] if "every_n" not in t[0]]:
        a = steps[ours](params, opt, hstate, tok, at[ours])[4]
        b = steps[anchor](params, opt, hstate, tok, at[anchor])[4]
        assert a.keys() == b.keys(), (ours, sorted(set(a) ^ set(b))[:5])
        worst = max(abs(float(a[k]) - float(b[k])) / max(abs(float(b[k])), 1e-30) for k in b)
        assert worst < 1e-3, (ours, worst)

    times = {k: [] for k in steps}
    for r in range(ROUNDS):
        for name in np.random.default_rng(r).permutation(list(steps)):
            p, o, h = params, opt, hstate
            start = time.perf_counter()
            for _ in range(STEPS):
                p, o, h, loss, m = steps[name](p, o, h, tok, at[name])
            jax.block_until_ready((p, m))
            times[name].append((time.perf_counter() - start) / STEPS)
    base = [t for t in times["none"]]
    overhead = {k: [a - b for a, b in zip(v, base)] for k, v in times.items()}
    print(f"\nstep time, median of {ROUNDS} rounds x {STEPS} steps; base {statistics.median(base) * 1e3:.2f} ms")
    rows = {}
    for name in steps:
        med, over = statistics.median(times[name]), statistics.median(overhead[name])
        q1, q3 = np.percentile(overhead[name], [25, 75])
        rows[name] = {"step_ms": med * 1e3, "overhead_ms": over * 1e3, "overhead_iqr_ms": [q1 * 1e3, q3 * 1e3],
                      "structure": structures[name]}
        print(f"  {name:40s} {med * 1e3:9.2f} ms  overhead {over * 1e3:+8.2f} ms (IQR {q1 * 1e3:+.2f} to {q3 * 1e3:+.2f})")
    control = rows["none, again (A/A control)"]["overhead_iqr_ms"]
    noise = max(abs(control[0]), abs(control[1]))
    print(f"targets (overhead of ours <= the anchor's; A/A control spread +-{noise:.2f} ms):")
    verdicts = {}
    for ours, anchor in TARGETS:
        diff = rows[ours]["overhead_ms"] - rows[anchor]["overhead_ms"]
        met = diff <= noise
        verdicts[f"{ours} vs {anchor}"] = {"difference_ms": diff, "met": met}
        print(f"  {ours} vs {anchor}: {diff:+.2f} ms: {'met' if met else 'NOT met'}")
    common.dump("gpu_step_overhead.json", {"info": info, "leaves": n_leaves, "rows": rows, "targets": verdicts})


if __name__ == "__main__":
    main()
