"""Training-health metric dicts for the step benchmarks (CPU suite and GPU script alike).

Each variant is ``fn(g, p, u, o, i, h) -> (metrics, h)``: gradients, params,
updates, the new optimizer state, the step number (traced) and the health
state (detector + recorder, threaded through the step; None where unused).

* ``tt health``: ``norm_metrics(grads, params, updates, opt_state, depth=DEPTH,
  abs_max=True)``: per-module grad/param/update norms, update ratios,
  non-finite counts, largest |g|, Adam's mu/nu norms, global and per module.
* ``naive health``: the same keys and values as a trainer writes them with
  optax today (``optax.tree.norm`` per module subtree, ``jnp.max(jnp.abs)``,
  ``jnp.isfinite`` counts), the anchor.
* ``+ detector + recorder``: ``tt health`` plus ``SpikeDetector.update`` and
  ``HealthRecorder.record`` (a step that writes nothing to the host).
* ``every_n(10)``: ``tt health`` behind ``lax.cond`` on ``i % 10 == 0``, timed
  on a step that skips it and on one that computes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import treetools as tt
from treetools.pytree.paths import leaves_with_paths

DEPTH = 1


def tt_health(g, p, u, o):
    return tt.norm_metrics(grads=g, params=p, updates=u, opt_state=o, depth=DEPTH, abs_max=True)


def _modules(tree) -> dict[str, list]:
    out: dict[str, list] = {}
    for path, x in leaves_with_paths(tree):
        out.setdefault("/".join(path.split("/")[:DEPTH]), []).append(x)
    return out


def _moments(o) -> dict[str, object]:
    """Adam's mu and nu trees, reached by hand as a trainer would (optax.adamw's first state)."""
    adam = next(s for s in jax.tree.leaves(o, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    return {"mu_norm": adam.mu, "nu_norm": adam.nu}


def naive_health(g, p, u, o):
    """``tt_health``'s keys and values, written with optax and jnp per module."""
    out = {"grad_norm": optax.tree.norm(g),
           "nonfinite_grads": sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree.leaves(g)).astype(jnp.int32),
           "grad_abs_max": jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in jax.tree.leaves(g)])),
           "param_norm": optax.tree.norm(p), "update_norm": optax.tree.norm(u)}
    out["update_ratio"] = out["update_norm"] / out["param_norm"]
    moments = _moments(o)
    out |= {kind: optax.tree.norm(t) for kind, t in moments.items()}
    per = {}
    for kind, tree in (("grad_norm", g), ("param_norm", p), ("update_norm", u), *moments.items()):
        for name, leaves in _modules(tree).items():
            per[f"{kind}/{name}"] = optax.tree.norm(leaves)
    for name, leaves in _modules(g).items():
        per[f"nonfinite_grads/{name}"] = sum(jnp.sum(~jnp.isfinite(x)) for x in leaves).astype(jnp.int32)
        per[f"grad_abs_max/{name}"] = jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in leaves]))
    for name in _modules(p):
        per[f"update_ratio/{name}"] = per[f"update_norm/{name}"] / per[f"param_norm/{name}"]
    return out | per


def train_step(loss_fn, tx, metric_fn):
    """``step(p, o, h, tok, i) -> (p, o, h, loss, metrics)``: loss, grads, the optimizer, one metric variant.

    The step number ``i`` is an argument, not a constant, so ``every_n``'s conditional is decided at run time.
    """
    def step(p, o, h, tok, i):
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        u, o = tx.update(g, o, p)
        metrics, h = metric_fn(g, p, u, o, i, h)
        return optax.apply_updates(p, u), o, h, loss, metrics

    return step


DETECTOR = tt.SpikeDetector(keys=("grad_norm",), warmup=5)
RECORDER = tt.HealthRecorder(length=64)


def health_state(g, p, u, o):
    """The detector's and the recorder's states for these trees (from shapes)."""
    metrics = jax.eval_shape(tt_health, g, p, u, o)
    return {"detector": DETECTOR.init(metrics), "recorder": RECORDER.init(metrics)}


def with_detector(g, p, u, o, i, h):
    metrics = tt_health(g, p, u, o)
    det, report = DETECTOR.update(h["detector"], metrics)
    rec = RECORDER.record(h["recorder"], i, metrics, report["flagged"])
    metrics["flagged"] = report["flagged"]
    return metrics, {"detector": det, "recorder": rec}


def every_10(g, p, u, o, i, h):
    ran, metrics = tt.every_n(i, 10, tt_health, g, p, u, o)
    return metrics, h


def _nothing(g, p, u, o, i, h):
    return {}, h


VARIANTS = {
    "none": _nothing,
    "none, again (A/A control)": _nothing,  # the same program in another slot
    "naive health dict (optax)": lambda g, p, u, o, i, h: (naive_health(g, p, u, o), h),
    "tt.norm_metrics health": lambda g, p, u, o, i, h: (tt_health(g, p, u, o), h),
    "tt health + detector + recorder": with_detector,
    "tt health every_n(10), a skipped step": every_10,
    "tt health every_n(10), a computing step": every_10,
}
# The step number each variant is timed at (every_n skips on i % 10 != 0).
STEP_OF = {"tt health every_n(10), a skipped step": 1}
