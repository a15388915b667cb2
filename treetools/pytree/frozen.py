"""Which gradients a training step never needs: ``frozen_grads(optimizer, params, opt_state)``.

A parameter frozen by ``optax.set_to_zero`` (in ``optax.multi_transform``, as ``get_param_label_fn`` labels it)
gets an update of zeros that reads nothing of its gradient; a compiled step then drops that gradient (XLA
removes what no output uses), and ``memory_plan`` does not count it. Found from ``optimizer.update`` itself:
its jaxpr, traced on abstract values, walked back from every output (the updates and the new state); a
gradient no output reaches is never needed. A transform that reads every gradient before the split (a global
norm clip) keeps them all, as it does in the compiled step. Nothing is allocated.
"""

from __future__ import annotations

from typing import Any

import jax

from treetools.pytree.paths import is_leaf, path_parts


def _needed_inputs(jaxpr: Any) -> list[bool]:
    """For each input of ``jaxpr``, whether some output depends on it (backward liveness; an equation with a
    sub-program counts all its inputs, which is conservative)."""
    live = {id(v) for v in jaxpr.outvars}  # a literal is no equation's output: harmless in the set
    for eqn in reversed(jaxpr.eqns):
        if any(id(v) in live for v in eqn.outvars) or eqn.effects:
            live.update(id(v) for v in eqn.invars)
    return [id(v) in live for v in jaxpr.invars]


def frozen_grads(optimizer: Any, params: Any, opt_state: Any) -> set[str] | None:
    """The ``/``-joined paths of the params whose gradient no output of ``optimizer.update(grads, opt_state,
    params)`` depends on; None when the update cannot be traced on abstract values (nothing is then left out).

    ``params`` and ``opt_state`` are abstract (``ShapeDtypeStruct``s, boxes allowed); the gradients are taken
    as the params' structs.

    >>> import jax, jax.numpy as jnp, optax
    >>> p = {"embed": jax.ShapeDtypeStruct((8, 4), jnp.float32), "w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    >>> tx = optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()},
    ...                            {"embed": "frozen", "w": "train"})
    >>> frozen_grads(tx, p, jax.eval_shape(tx.init, p))
    {'embed'}
    >>> clipped = optax.chain(optax.clip_by_global_norm(1.0), tx)  # the global norm reads every gradient
    >>> frozen_grads(clipped, p, jax.eval_shape(clipped.init, p))
    set()
    """
    try:
        closed = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(params, opt_state, params)
    except Exception:  # an optimizer that needs concrete values or extra arguments: count every gradient
        return None
    names = [name for keypath, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)[0]
             for name in ["/".join(path_parts(keypath))] * len(jax.tree.leaves(leaf))]  # a box: its one array
    needed = _needed_inputs(closed.jaxpr)[: len(names)]
    return {name for name, used in zip(names, needed) if not used}
