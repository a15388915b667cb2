"""Sharded L2 norms, the norm dictionaries a trainer logs, and a clip that uses them.

The sums of squares are ``treetools.pytree.sums``'s: every leaf read once, in
float32, psum-ed over the mesh axes it is split over (under ``jit`` and inside
``shard_map`` alike), per layer for stacked leaves. This module groups them
into what a trainer logs: the global norm and its leaves
(``get_sharded_global_norm``), ``get_grad_norms`` / ``get_param_norms``, and
``norm_metrics`` (per module, per scanned layer, update ratios, non-finite
counts, largest ``|g|``, and the optimizer's moments matched to their params
by ``treetools.pytree.moments``).

>>> import jax.numpy as jnp
>>> g, per_leaf = get_sharded_global_norm({"w": jnp.full((4,), 2.0), "b": jnp.zeros(3)})
>>> float(g), float(per_leaf["w"])
(4.0, 4.0)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from treetools.shared.aliases import PathStr, PyTree
from treetools.pytree.paths import SEP, is_leaf, leaves_with_paths, path_str
from treetools.pytree.moments import moment_pairs
from treetools.pytree.sums import (  # noqa: F401  (get_sharded_norm_logits: tt's, exported from this module)
    EVERY_LAYER,
    find_leaf_stacks,
    get_sharded_norm_logits,
    global_shape,
    reduce_norms,
)
from treetools.pytree.stacked import Stack, Stacked, layer_parts, split_within


_F32 = jnp.float32


def get_sharded_global_norm(tree: PyTree, *, stacked: Stacked = False) -> tuple[jax.Array, PyTree]:
    """Global L2 norm of a tree and the norm of each leaf, in float32.

    Correct under ``jit``/GSPMD on global arrays and inside ``shard_map`` on
    boxed local shards (each box psum-ed over its own mesh axes, with one
    collective per distinct axis set). The global norm is the square root of
    the summed per-leaf squares, so every array is read once.

    Args:
      tree: any pytree of arrays or boxes; boxes are leaves.
      stacked: which leaves are stacked layers, whose norm is then one per
        layer (see ``norm_metrics``): False (default) none; None or True from
        ``layers`` axis names in their boxes; ``{pattern: axis}``.

    Returns:
      ``(global_norm, per_leaf_norms)``: a float32 scalar (0.0 for an empty
      tree) and a tree of the same structure holding one float32 scalar per
      leaf (boxes replaced by the scalar); a stacked leaf holds a float32
      vector of its L per-layer norms.

    Raises:
      TypeError: a leaf is not an array or a number.
      ValueError: inside ``shard_map``, a box whose layout cannot be known
        (see the module doc); a ``stacked`` pattern that matches no leaf.

    >>> import jax.numpy as jnp
    >>> g, leaves = get_sharded_global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])})
    >>> float(g), float(leaves["a"])
    (5.0, 3.0)
    >>> float(get_sharded_global_norm({"z": jnp.array([3 + 4j])})[0])  # |3 + 4i|
    5.0
    >>> g, leaves = get_sharded_global_norm({"w": jnp.array([[3.0, 4.0], [0.0, 12.0]])}, stacked={"w": 0})
    >>> float(g), leaves["w"].tolist()  # two layers: |(3, 4)| and |(0, 12)|
    (13.0, [5.0, 12.0])
    """
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    named = [(path_str(p), x) for p, x in pairs]
    stacks = find_leaf_stacks(named, stacked)
    groups = tuple(((i, None if s is None else EVERY_LAYER),) for i, s in enumerate(stacks))
    reduced = reduce_norms(named, groups=groups, stacks=stacks)
    return reduced.norm, jax.tree_util.tree_unflatten(treedef, reduced.groups)


# --------------------------------------------------------------------------- #
# Norm dictionaries
# --------------------------------------------------------------------------- #


def _module_groups(
    pairs: list[tuple[PathStr, Any]], stacks: list[Stack | None], *, depth: int | None
) -> tuple[dict[str, list[tuple[int, int | None]]], list[Stack | None]]:
    """``({module or leaf name: [(leaf index, layer or None)]}, the stacks read per layer)`` in tree order.

    A stacked leaf whose layer index falls within ``depth`` (see ``norm_metrics``)
    adds to one name per layer; it is then read per layer, in the same pass.
    """
    names: dict[str, list[tuple[int, int | None]]] = {}
    split: list[Stack | None] = [None] * len(pairs)
    for i, (path, _) in enumerate(pairs):
        # A bare array (empty path) has no per-parameter entry: it is the global norm.
        if not path:
            continue
        parts = tuple(path.split(SEP))
        stack = stacks[i]
        if split_within(stack, depth):  # depth counts the layer index as a path part
            split[i] = stack
            for layer in range(stack.length):
                names.setdefault(SEP.join(layer_parts(parts, stack, layer)[:depth]), []).append((i, layer))
        else:
            names.setdefault(SEP.join(parts[:depth]), []).append((i, None))
    return names, split


def _norm_entries(
    pairs: list[tuple[PathStr, Any]],
    kind: str,
    *,
    per_param: bool,
    depth: int | None,
    stacked: Stacked = None,
    stacks: list[Stack | None] | None = None,
    count_key: str | None = None,
    max_key: str | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """``({kind: norm, count_key: n, max_key: m}, {"<kind>/<name>": ..., "<count_key>/<name>": ...})``, in tree order.

    ``count_key``: count the NaN/Inf elements too; ``max_key``: the largest
    ``|x|`` too. ``stacks``: the leaves' stacks where the caller knows them
    (else found from ``stacked``). Entries per name only with ``per_param`` or ``depth``.
    """
    names: dict[str, list[tuple[int, int | None]]] = {}
    split: list[Stack | None] = [None] * len(pairs)
    if per_param or depth is not None:
        if stacks is None:
            stacks = find_leaf_stacks(pairs, stacked)
        names, split = _module_groups(pairs, stacks, depth=depth)
    per_name = bool(names)
    reduced = reduce_norms(pairs, groups=tuple(tuple(m) for m in names.values()), count_nonfinite=count_key is not None,
                     group_counts=per_name, abs_max=max_key is not None, stacks=split)
    totals: dict[str, jax.Array] = {kind: reduced.norm}
    per: dict[str, jax.Array] = {f"{kind}/{name}": g for name, g in zip(names, reduced.groups)}
    if count_key is not None and reduced.nonfinite is not None:  # computed when asked (count_nonfinite)
        totals[count_key] = reduced.nonfinite
        per.update({f"{count_key}/{name}": c for name, c in zip(names, reduced.group_nonfinite or [])})
    if max_key is not None and reduced.abs_max is not None:  # computed when asked (abs_max)
        totals[max_key] = reduced.abs_max
        per.update({f"{max_key}/{name}": m for name, m in zip(names, reduced.group_abs_max or [])})
    return totals, per


def get_grad_norms(
    grads: PyTree, return_per_param: bool = False, *, depth: int | None = None, stacked: Stacked = None
) -> dict[str, jax.Array]:
    """``{"grad_norm": g}`` plus ``{"grad_norm/<path>": ...}`` per parameter.

    Args:
      grads: gradient tree (arrays or boxes; sharded or not, see module doc).
      return_per_param: add one entry per leaf.
      depth: add one entry per module instead: leaves grouped by the first
        ``depth`` parts of their path, norm = sqrt of the group's summed squares.
      stacked: stacked (scanned) leaves, split per layer: as ``norm_metrics``.

    Returns:
      A dict of float32 scalars.

    >>> import jax.numpy as jnp
    >>> {k: float(v) for k, v in get_grad_norms({"w": jnp.array([3.0, 4.0])}, True).items()}
    {'grad_norm': 5.0, 'grad_norm/w': 5.0}
    """
    totals, per = _norm_entries(
        leaves_with_paths(grads), "grad_norm", per_param=return_per_param, depth=depth, stacked=stacked
    )
    return {**totals, **per}


def get_param_norms(
    params: PyTree, return_per_param: bool = False, *, depth: int | None = None, stacked: Stacked = None
) -> dict[str, jax.Array]:
    """``{"param_norm": p}`` plus ``{"param_norm/<path>": ...}`` per parameter.

    Same arguments as ``get_grad_norms``.

    >>> import jax.numpy as jnp
    >>> {k: float(v) for k, v in get_param_norms({"w": jnp.array([6.0, 8.0])}).items()}
    {'param_norm': 10.0}
    """
    totals, per = _norm_entries(
        leaves_with_paths(params), "param_norm", per_param=return_per_param, depth=depth, stacked=stacked
    )
    return {**totals, **per}


def norm_metrics(
    *,
    grads: PyTree = None,
    params: PyTree = None,
    updates: PyTree = None,
    opt_state: PyTree = None,
    per_param: bool = False,
    depth: int | None = None,
    stacked: Stacked = None,
    abs_max: bool = False,
) -> dict[str, jax.Array]:
    """The norm dictionary a trainer logs, in one fused, jit-safe pass: per-layer training health.

    Each array is read once: per-leaf sums of squares are computed once and
    the global and per-module norms are derived from them. Non-finite
    gradients propagate into the norms (NaN/Inf are never hidden) and are
    counted without a second read (see the module doc: on GPU/TPU in the
    same pass as the squares, with no branch; on CPU only on a non-finite step).
    Works under ``jit`` on global arrays (Explicit and Auto mesh axes) and
    inside ``shard_map`` on boxes.

    Stacked (scanned) leaves, which hold L layers on one axis, get one entry
    per layer: the layer index goes into the path where the layer axis is in
    the module path (``decoder/layers/attn/q`` of shape (L, ...) gives
    ``grad_norm/decoder/layers/3/attn/q`` with ``per_param``, and
    ``grad_norm/decoder/layers/3`` with ``depth=3``). ``depth`` counts the
    parts of that path, the layer index being one, as ``inspect --unstack
    --depth`` does (``depth=2`` gives ``grad_norm/decoder/layers``, all layers
    together; ``treetools.pytree.stacked.split_within``). Such a leaf is reduced over
    every axis but the layer axis, in the same read; the global norm is the
    sum of those per-layer squares.

    Optimizer moments (``opt_state=``): every optax state with moment fields,
    wherever it sits in the state (``chain``, ``multi_transform``, ``masked``,
    ``inject_hyperparams``), is matched to its params by the path below the
    field, so ``mu_norm/<module>`` groups exactly as ``grad_norm/<module>``.
    First moments (``mu_norm``): ``mu`` of Adam/AdamW/AMSGrad/Lion (Lion's one
    moment)/Belief/Novograd, ``trace`` of SGD momentum, ``ema`` of Adafactor with momentum. Second moments
    (``nu_norm``): ``nu`` of the Adam family and RMSProp; for Adafactor, the
    second-moment estimate optax divides by: ``v`` of an unfactored param,
    and for a factored one the product of its row and column factors (see
    ``factored_second_moment``; the factors themselves are not a moment of
    the param's shape). A param without a moment (frozen by
    ``multi_transform``) has no ``mu_norm/<module>`` entry; two states holding
    a moment of the same param add up (the norm of both together).

    Args:
      grads: gradient tree; gives ``grad_norm`` and ``nonfinite_grads``
        (the number of NaN/Inf gradient elements, int32).
      params: parameter tree; gives ``param_norm``.
      updates: optimizer updates; gives ``update_norm``, and with ``params``
        also ``update_ratio = update_norm / param_norm``.
      opt_state: an optax state; gives ``mu_norm`` and ``nu_norm`` where it
        holds such moments. Adafactor's factored moments need the params'
        shapes: pass ``params`` (or ``updates``/``grads``) too.
      per_param: add ``<kind>/<path>`` for every leaf (none for a tree that is
        one bare array: its path is empty and its norm is ``<kind>``).
      depth: add ``<kind>/<prefix>`` per module instead (leaves grouped by the
        first ``depth`` path parts; sqrt of summed squares). Overrides
        ``per_param``.
      stacked: which leaves are stacked layers (only used with ``per_param``
        or ``depth``). None (default) or True: those whose box names a
        ``layers`` axis (flax ``nn.scan`` with ``metadata_params={nn.PARTITION_NAME:
        "layers"}``, MaxText's ``layers`` logical axis, nnx Variables whose
        sharding names hold ``layers``), with the unboxed leaves of the same
        scanned module; ``{pattern: axis}``: the leaves whose path matches a
        pattern (``re.search``), stacked on ``axis``, the index placed right
        after the path part where the match ends (``{"layers": 0}`` for an
        nnx model built with ``nnx.vmap``); False: none. The rules in full:
        ``treetools.pytree.stacked``. Moments follow their params' stacks.
      abs_max: also ``grad_abs_max``, the largest ``|g|`` (float32; +inf
        where a gradient is NaN or Inf: a cross-device max drops NaN), global
        and per module: one more reduction of each gradient, a sibling of its
        sum of squares (fused with it on GPU/TPU, a second read on CPU).

    Returns:
      ``{"grad_norm", "nonfinite_grads", "grad_abs_max", "param_norm",
      "update_norm", "update_ratio", "mu_norm", "nu_norm"}`` for the inputs
      given, then with ``per_param``/``depth`` the same kinds per leaf or
      module: ``<kind>/<name>`` (``update_ratio/<name>`` where both the
      params and the updates have that name; ``nonfinite_grads/<name>`` the
      count there). float32 scalars, counts int32. An ``update_ratio`` is a
      plain division: inf or NaN when the param norm is 0.

    Raises:
      ValueError: no tree was given, ``depth`` is not positive, inside
        ``shard_map`` a box's layout cannot be known (see the module doc), a
        ``stacked`` pattern matches no leaf (``PatternError``, naming it and
        nearby paths) or a leaf without that axis; an Adafactor state whose
        params' shapes are not given, or inside ``shard_map``.

    >>> import jax, jax.numpy as jnp
    >>> m = jax.jit(norm_metrics)(grads={"w": jnp.array([3.0, 4.0])}, params={"w": jnp.array([0.0, 10.0])})
    >>> sorted(m), float(m["grad_norm"]), int(m["nonfinite_grads"])
    (['grad_norm', 'nonfinite_grads', 'param_norm'], 5.0, 0)
    >>> g = {"layers": {"q": jnp.array([[3.0, 4.0], [6.0, 8.0]])}}  # 2 layers of a stacked `q`
    >>> m = norm_metrics(grads=g, depth=2, stacked={"layers": 0})  # depth 2: `layers/<i>`
    >>> {k: float(v) for k, v in m.items() if k.startswith("grad_norm/")}
    {'grad_norm/layers/0': 5.0, 'grad_norm/layers/1': 10.0}
    >>> import optax
    >>> p = {"a": jnp.ones(4), "b": jnp.ones(9)}
    >>> u, state = optax.adam(0.1).update(p, optax.adam(0.1).init(p), p)
    >>> m = norm_metrics(params=p, updates=u, opt_state=state, depth=1)
    >>> round(float(m["mu_norm/b"]), 4), round(float(m["update_ratio/a"]), 4)   # (1 - b1) * |9 ones|; lr / 1
    (0.3, 0.1)
    """
    if grads is None and params is None and updates is None and opt_state is None:
        raise ValueError("`norm_metrics` needs at least one of `grads=`, `params=`, `updates=`, `opt_state=`.")
    if depth is not None and depth < 1:
        raise ValueError(f"`depth` must be a positive integer, got {depth}.")
    trees = {kind: leaves_with_paths(tree) for kind, tree in
             (("grad_norm", grads), ("param_norm", params), ("update_norm", updates)) if tree is not None}
    grouped = per_param or depth is not None
    # The params' tree (or the updates', the grads') says where moments go: their shapes and their stacks.
    reference = next((trees[k] for k in ("param_norm", "update_norm", "grad_norm") if k in trees), None)
    if opt_state is not None:
        shapes = {path: shape for path, x in reference or [] if (shape := global_shape(x)) is not None}
        trees.update({kind: pairs for kind, pairs in moment_pairs(opt_state, shapes).items() if pairs})
    ref_stacks = None
    if grouped and reference is not None and any(k in trees for k in ("mu_norm", "nu_norm")):
        ref_stacks = dict(zip((p for p, _ in reference), find_leaf_stacks(reference, stacked)))
    out: dict[str, jax.Array] = {}
    per: dict[str, jax.Array] = {}
    for kind in ("grad_norm", "param_norm", "update_norm", "mu_norm", "nu_norm"):
        if kind not in trees:
            continue
        pairs = trees[kind]
        stacks = None
        if kind in ("mu_norm", "nu_norm") and ref_stacks is not None:
            stacks = [ref_stacks.get(path) for path, _ in pairs]
        grad = kind == "grad_norm"
        totals, entries = _norm_entries(
            pairs, kind, per_param=per_param, depth=depth, stacked=stacked, stacks=stacks,
            count_key="nonfinite_grads" if grad else None, max_key="grad_abs_max" if grad and abs_max else None,
        )
        out.update(totals)
        per.update(entries)
        if kind == "update_norm" and "param_norm" in out:
            out["update_ratio"] = out["update_norm"] / out["param_norm"]
            prefix = len("update_norm/")
            per.update({f"update_ratio/{k[prefix:]}": v / per[f"param_norm/{k[prefix:]}"]
                        for k, v in entries.items() if f"param_norm/{k[prefix:]}" in per})
    out.update(per)
    return out


# --------------------------------------------------------------------------- #
# Clipping
# --------------------------------------------------------------------------- #


def clip_by_global_norm(max_norm: float) -> Any:
    """``optax.clip_by_global_norm`` computed with ``get_sharded_global_norm``.

    Drop-in for optax's transform that is also right inside ``shard_map`` on
    boxed local shards (optax's own norm would sum only the local shard there)
    and that accumulates the norm in float32 (complex leaves: ``|z|^2``, and
    both parts are scaled). If the global norm ``g`` exceeds
    ``max_norm`` every update is scaled by ``max_norm / g`` (in float32, cast
    back to each leaf's dtype), so the clipped tree's norm is ``max_norm`` to
    float32 rounding; otherwise updates pass through unchanged. Boxes are
    kept. A NaN/Inf norm propagates into the updates.

    Args:
      max_norm: the largest global norm an update may have.

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    >>> import optax, jax.numpy as jnp
    >>> tx = clip_by_global_norm(1.0)
    >>> u, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
    >>> [round(float(v), 6) for v in u["w"]]
    [0.6, 0.8]
    """
    import optax  # optional at import time: only the clip needs it

    def update_fn(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        del params
        g, _ = get_sharded_global_norm(updates)
        scale = jnp.where(g < max_norm, jnp.ones((), _F32), jnp.asarray(max_norm, _F32) / g)
        # tree.map without is_leaf descends into boxes and keeps their names.
        return jax.tree.map(lambda t: (t * scale).astype(jnp.result_type(t)), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
