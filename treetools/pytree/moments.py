"""The optimizer's moments, matched to their params by path: what ``norm_metrics(opt_state=...)`` measures.

An optax state is found by its fields wherever it sits (``chain``,
``multi_transform``, ``masked``, ``inject_hyperparams``): Adam-family ``mu``
and ``nu``, SGD momentum's ``trace``, RMSProp's ``nu``, and Adafactor's
factored second moment, rebuilt as the estimate optax divides by.
"""


from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treetools.shared.aliases import PathStr, PyTree
from treetools.pytree.partitioning import unbox
from treetools.pytree.paths import is_leaf, leaves_with_paths, path_str


_F32 = jnp.float32


# --------------------------------------------------------------------------- #
# Optimizer moments, matched to their params by path
# --------------------------------------------------------------------------- #

# Adam/AdamW/AMSGrad/Belief/Novograd/Lion (``mu``); SGD momentum (``trace``); Adafactor's momentum (``ema``)
_FIRST_MOMENTS = ("mu", "trace", "ema")
_SECOND_MOMENTS = ("nu",)  # Adam-family, RMSProp (``scale_by_rms``)
_FACTORED = ("v_row", "v_col", "v")  # Adafactor's ``FactoredState``


_STATE_KEYS = frozenset({"count", *_FIRST_MOMENTS, *_SECOND_MOMENTS, *_FACTORED, "nu_max"})


def _fields(x: Any) -> tuple[str, ...]:
    fields = getattr(type(x), "_fields", None)  # optax states are NamedTuples
    if isinstance(x, tuple) and fields is not None:
        return tuple(fields)
    # ``nnx.state(optimizer)`` holds each optax state as a mapping of its fields (``opt_state/0/mu/...``): one
    # whose keys are all a state's fields, with a moment among them and the step count (SGD momentum: its trace).
    keys = getattr(x, "keys", None)
    if keys is None or isinstance(x, type) or not callable(keys):
        return ()
    try:
        names = {k for k in keys() if isinstance(k, str)}
    except TypeError:
        return ()
    if names and names <= _STATE_KEYS and ("count" in names or names == {"trace"}) and names & (
            {*_FIRST_MOMENTS, *_SECOND_MOMENTS} | {"v"}):
        return tuple(k for k in keys() if isinstance(k, str))
    return ()


def _field(node: Any, name: str) -> Any:
    """A state's field: a NamedTuple's attribute, a mapping's item."""
    return getattr(node, name) if isinstance(node, tuple) else node[name]


def _is_moment_state(x: Any) -> bool:
    fields = set(_fields(x))
    return bool(fields & {*_FIRST_MOMENTS, *_SECOND_MOMENTS}) or set(_FACTORED) <= fields


def moment_pairs(opt_state: PyTree, shapes: dict[PathStr, tuple[int, ...]]) -> dict[str, list[tuple[PathStr, Any]]]:
    """``{"mu_norm": [(param path, moment leaf)], "nu_norm": [...]}`` of every optax state in ``opt_state``.

    A state is found by its fields wherever it sits (``chain``, ``multi_transform``,
    ``masked``, ``inject_hyperparams``: ``optax.MaskedNode`` holds no leaf); the
    path of a moment leaf below its field is its param's path. ``shapes``:
    param path -> (global) shape, which Adafactor's factored moments need.
    """
    out: dict[str, list[tuple[PathStr, Any]]] = {"mu_norm": [], "nu_norm": []}
    nodes = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=lambda x: is_leaf(x) or _is_moment_state(x))[0]
    for where, node in nodes:
        if not _is_moment_state(node):
            continue
        for field in _fields(node):
            if field in _FIRST_MOMENTS:
                out["mu_norm"] += leaves_with_paths(_field(node, field))
            elif field in _SECOND_MOMENTS:
                out["nu_norm"] += leaves_with_paths(_field(node, field))
        if set(_FACTORED) <= set(_fields(node)):
            out["nu_norm"] += factored_second_moment(node, shapes, path_str(where))
    return out


def _factored_dims(shape: tuple[int, ...], rows: tuple[int, ...], cols: tuple[int, ...]) -> tuple[int, int] | None:
    """``(d1, d0)`` as optax's Adafactor factors a param of ``shape`` (its two largest axes), or None if unfactored."""
    if len(shape) < 2:
        return None
    d1, d0 = (int(d) for d in np.argsort(shape)[-2:])
    without = lambda axis: shape[:axis] + shape[axis + 1 :]  # noqa: E731
    return (d1, d0) if rows == without(d0) and cols == without(d1) else None


def factored_second_moment(state: Any, shapes: dict[PathStr, tuple[int, ...]], where: str) -> list[tuple[PathStr, Any]]:
    """Adafactor's second-moment estimate per param: ``v``, or rebuilt from its factors as optax uses them.

    A factored param (its two largest axes ``d1``, ``d0``) keeps a row factor
    ``r`` (the mean of ``g^2`` over ``d0``) and a column factor ``c`` (over
    ``d1``); optax divides the update by the square root of
    ``V = r / mean_d1(r) [at d0] * c [at d1]``, so that estimate, of the
    param's shape, is what ``nu_norm`` measures: a broadcast product that XLA
    reduces without writing it (it reads only the factors).
    """
    rows, cols = dict(leaves_with_paths(_field(state, "v_row"))), dict(leaves_with_paths(_field(state, "v_col")))
    out = []
    for path, v in leaves_with_paths(_field(state, "v")):
        shape = shapes.get(path)
        if shape is None:
            raise ValueError(
                f"Adafactor state `{where}` holds a second moment for `{path}`, but no `params=`, `updates=` or "
                "`grads=` tree has that path to give its shape; pass the params beside `opt_state=`."
            )
        r, c = unbox(rows[path]), unbox(cols[path])
        # An unfactored param's v has its shape (its factors are (1,) zero placeholders, which for a (1, 1) param
        # look like factors); a factored one's v is the (1,) placeholder.
        factored = tuple(np.shape(unbox(v))) != shape
        dims = _factored_dims(shape, tuple(np.shape(r)), tuple(np.shape(c))) if factored else None
        if dims is None:
            if tuple(np.shape(unbox(v))) != shape:
                raise ValueError(
                    f"Adafactor state `{where}`: the second moment of `{path}` has shape {np.shape(unbox(v))}, rows "
                    f"{np.shape(r)} and columns {np.shape(c)}, which fit no factoring of its param's shape {shape}; "
                    "pass the params the optimizer state was made for."
                )
            out.append((path, v))
            continue
        if jax.sharding.get_abstract_mesh().manual_axes:
            raise ValueError(
                f"Adafactor state `{where}`: the factored second moment of `{path}` cannot be rebuilt from local "
                "shards inside shard_map; take `nu_norm` outside shard_map (under jit)."
            )
        d1, d0 = dims
        r, c = jnp.asarray(r, _F32), jnp.asarray(c, _F32)
        reduced_d1 = d1 - 1 if d1 > d0 else d1
        mean = jnp.mean(r, axis=reduced_d1, keepdims=True)
        rows_scaled = jnp.where(mean == 0, 0.0, r / jnp.where(mean == 0, 1.0, mean))  # a fresh state: 0, not 0/0
        out.append((path, jnp.expand_dims(rows_scaled, d0) * jnp.expand_dims(c, d1)))
    return out
