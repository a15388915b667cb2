"""Training health in a train step on CPU: what it adds to the step, against the same dict written with optax.

A jitted train step (loss, grads, AdamW, apply) of a small MLP language model
(embedding, ``N_BLOCKS`` blocks of up/down Dense + LayerNorm, head; one device)
with each metric variant of ``health_variants.py``; the anchor is the plain
step (no metrics) measured in the same shuffled rounds, and the naive optax
dict with the same keys. Printed: each variant's step time over the plain
step's (paired median over rounds, IQR), ours over the naive dict, and the
``every_n(10)`` conditional on a step that skips the per-layer work against
the step that always computes it (is a conditional cheaper than the reductions
on CPU?).

Run: ``.venv/bin/python -m pytest -q -s benchmarks/test_health_bench.py --benchmark-enable``
(``make bench`` runs it). Sizes: ``TREETOOLS_BENCH_SCALE`` scales the widths.
"""

from __future__ import annotations

import math
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import SCALE, report
from health_variants import STEP_OF, VARIANTS, health_state, naive_health, train_step, tt_health
from test_norms_bench import ROUNDS, time_rounds

SMOKE = SCALE < 0.01  # the smoke run (make test) only proves the suite runs: 2 blocks compile in a fraction
N_BLOCKS = 2 if SMOKE else 8


def _dim(full: int) -> int:
    return max(16, int(round(full * math.sqrt(SCALE) / 16)) * 16)


D, VOCAB, T, B = _dim(256), _dim(1024), (8 if SMOKE else 64), 8


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D, name="down")(nn.gelu(nn.Dense(4 * D, name="up")(x)))
        return nn.LayerNorm(name="ln")(x + h)


class MLPLM(nn.Module):
    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, D, name="embed")(tok)
        for i in range(N_BLOCKS):
            x = Block(name=f"block_{i}")(x)
        return nn.Dense(VOCAB, name="head")(x)


def _setup():
    model = MLPLM()
    tok = jax.random.randint(jax.random.key(1), (B, T + 1), 0, VOCAB)
    params = jax.jit(model.init)(jax.random.key(0), tok[:, :-1])["params"]
    tx = optax.adamw(1e-3)
    opt = tx.init(params)

    def loss_fn(p, tok):
        logits = model.apply({"params": p}, tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    grads = jax.grad(loss_fn)(params, tok)
    upd, opt1 = tx.update(grads, opt, params)
    health = health_state(grads, params, upd, opt1)

    def make_step(metric_fn):
        return jax.jit(train_step(loss_fn, tx, metric_fn))

    return params, opt, health, tok, make_step, (grads, params, upd, opt1)


def test_health_step_overhead_on_cpu(benchmark):
    params, opt, health, tok, make_step, trees = _setup()
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"\nmodel: {n / 1e6:.2f}M params, {len(jax.tree.leaves(params))} leaves, {N_BLOCKS} blocks, width {D}, "
          f"batch {B} x {T}, scale {SCALE}")
    # Ours and the anchor give the same keys and values.
    ours, naive = jax.jit(tt_health)(*trees), jax.jit(naive_health)(*trees)
    assert ours.keys() == naive.keys()
    for k in naive:
        np.testing.assert_allclose(float(ours[k]), float(naive[k]), rtol=2e-5, err_msg=k)
    compiled: dict[int, object] = {}  # one program per metric function: the A/A slot and the two every_n slots
    steps = {}
    for name, fn in VARIANTS.items():
        if id(fn) not in compiled:
            compiled[id(fn)] = make_step(fn)
        steps[name] = compiled[id(fn)]
    fns = {name: (steps[name], params, opt, health, tok, jnp.int32(STEP_OF.get(name, 0))) for name in steps}
    times = time_rounds(fns, ROUNDS if SCALE >= 0.01 else 2)  # the smoke run (make test) only proves it runs
    median = {k: statistics.median(v) for k, v in times.items()}

    def paired(a, b, label, target=""):
        ratios = [x / y for x, y in zip(times[a], times[b])]
        report(f"{label} [paired median]", median[a], median[b], b, ratio=statistics.median(ratios),
               spread=np.percentile(ratios, [25, 75]), target=target)

    for name in VARIANTS:
        if name != "none":
            paired(name, "none", f"step with {name}")
    paired("tt.norm_metrics health", "naive health dict (optax)", "tt health vs the naive dict", "<= 1.0")
    paired("tt health + detector + recorder", "naive health dict (optax)", "tt health + detector + recorder vs naive")
    paired("tt health every_n(10), a skipped step", "tt.norm_metrics health",
           "every_n(10) skipped step vs computing the health every step", "< 1.0: the conditional is cheaper")
    benchmark.pedantic(lambda: jax.block_until_ready(steps["tt health + detector + recorder"](
        params, opt, health, tok, jnp.int32(0))), rounds=5, iterations=1, warmup_rounds=1)
