"""Weight-decay masks and ``optax.multi_transform`` labels from path patterns.

Patterns are Python regexes applied with ``re.search`` to the path string of
every leaf (``params/Dense_0/kernel``). A pattern that matches no leaf raises
``ValueError``: a typo must not silently decay (or freeze) everything.
The returned trees keep the params' structure, boxes included, so they plug
into ``optax.add_decayed_weights(mask=...)``, ``optax.masked``,
``optax.adamw(mask=...)`` and ``optax.multi_transform`` unchanged.

Nested transforms: inside ``optax.multi_transform`` (or ``optax.masked``) a
mask or label function sees the params with the other groups' leaves replaced
by ``optax.MaskedNode``. Those hidden leaves keep their paths for the "matches
no leaf" check, so ``adamw(mask=get_param_mask_fn([r"bias$"]))`` in a group
that holds no bias is fine, while a typo still raises. (A subtree hidden by a
*prefix* mask is one ``MaskedNode``; only its prefix path is known.)
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import jax

from treetools.shared.aliases import KeyPath, Params, PyTree
from treetools.pytree.partitioning import rebox, unbox
from treetools.shared.errors import PatternError
from treetools.pytree.paths import is_leaf, leaves_with_paths, path_parts
from treetools.shared.patterns import compile_patterns, match_patterns


def _visible_and_hidden_paths(params: Params, *, name: str, patterns: Sequence[Any]) -> tuple[list[str], list[str]]:
    """Paths of the leaves, and of the leaves an enclosing optax transform hid (``MaskedNode``)."""
    from optax import MaskedNode  # imported on first use: masks are built for optax anyway

    pairs = leaves_with_paths(params, also_leaf=lambda x: isinstance(x, MaskedNode))
    if patterns and [p for p, _ in pairs] == [""]:
        # What optax.inject_hyperparams does to a callable hyperparameter: calls it with the step count.
        raise ValueError(
            f"`{name}` patterns need a params tree, but the function got one bare array (no paths); under "
            "optax.inject_hyperparams, pass static_args=('mask',) so it is not called as a schedule."
        )
    visible = [p for p, x in pairs if not isinstance(x, MaskedNode)]
    return visible, [p for p, x in pairs if isinstance(x, MaskedNode)]


def _matches(paths: Sequence[str], patterns: Sequence[Any], *, name: str, allow_unmatched: bool) -> list[bool]:
    """For each path, whether a pattern matches it; strict: a pattern that matches no leaf raises."""
    if allow_unmatched:
        return [any(p.search(path) for p in patterns) for path in paths]
    try:
        return match_patterns(paths, patterns, name=name)
    except PatternError as e:
        raise PatternError(
            f"{e} (One config for several model families, where a pattern may match nothing in some: "
            "pass allow_unmatched=True.)"
        ) from None


def _with_leaf_values(params: Params, values: Sequence[Any]) -> PyTree:
    """``params`` with leaf ``i`` replaced by ``values[i]``, each inside its leaf's box."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_leaf)
    return jax.tree.unflatten(treedef, [rebox(leaf, v) for leaf, v in zip(leaves, values)])


def get_param_mask_fn(
    exclude: Sequence[str] | str | None = None,
    include: Sequence[str] | str | None = None,
    *,
    allow_unmatched: bool = False,
) -> Callable[[Params], PyTree]:
    """A function ``params -> bool tree``: True where weight decay applies.

    Args:
      exclude: patterns of leaves that are *not* decayed (everything else is);
        e.g. ``[r"bias$", r"scale$"]``. ``None`` or ``[]`` decays everything.
      include: patterns of the only leaves that are decayed. Give either
        ``exclude`` or ``include``, not both.
      allow_unmatched: let a pattern match no leaf (one optimizer config for
        model families with and without biases: ``[r"bias$", r"scale$"]`` on a
        LLaMA-style model). Strict by default: a pattern that matches nothing
        is taken for a typo and raises.

    Returns:
      ``mask_fn(params)`` returning a tree of Python bools with the structure
      of ``params`` (boxes kept).

    Raises:
      ValueError: both ``exclude`` and ``include`` are given, a pattern is not
        a valid regex, or (when the mask is built, unless ``allow_unmatched``) a
        pattern matches no leaf, counting leaves hidden by an enclosing
        ``optax.masked``/``multi_transform``.

    >>> import jax.numpy as jnp
    >>> params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}
    >>> get_param_mask_fn(exclude=[r"bias$"])(params)
    {'dense': {'bias': False, 'kernel': True}}
    >>> get_param_mask_fn(include=[r"kernel$"])(params)
    {'dense': {'bias': False, 'kernel': True}}
    """
    if exclude and include:
        raise ValueError("give `exclude` or `include` to get_param_mask_fn, not both; use `include` alone "
                         "to decay only the matching leaves.")
    use_include = bool(include)
    name = "include" if use_include else "exclude"
    patterns = compile_patterns(include if use_include else exclude, name=name)

    def mask_fn(params: Params) -> PyTree:
        visible, hidden = _visible_and_hidden_paths(params, name=name, patterns=patterns)
        hits = _matches(visible + hidden, patterns, name=name, allow_unmatched=allow_unmatched)
        return _with_leaf_values(params, [h if use_include else not h for h in hits[: len(visible)]])

    return mask_fn


def get_param_label_fn(
    rules: Sequence[tuple[str, Hashable]], default: Hashable = "default", *, allow_unmatched: bool = False
) -> Callable[[Params], PyTree]:
    """A function ``params -> label tree`` for ``optax.multi_transform``.

    Args:
      rules: ordered ``(pattern, label)`` pairs; the first pattern that
        ``re.search``-matches a leaf's path gives its label.
      default: the label of leaves no rule matches.
      allow_unmatched: let a rule's pattern match no leaf (one config for
        several model families). Strict by default: it raises.

    Returns:
      ``label_fn(params)`` returning a tree of labels with the structure of
      ``params`` (boxes kept).

    Raises:
      ValueError: a pattern is invalid or (when labels are built, unless
        ``allow_unmatched``) matches no leaf.

    >>> import jax.numpy as jnp, optax
    >>> label_fn = get_param_label_fn([(r"^embed/", "frozen")], default="train")
    >>> label_fn({"embed": {"table": jnp.ones(3)}, "head": {"w": jnp.ones(3)}})
    {'embed': {'table': 'frozen'}, 'head': {'w': 'train'}}
    >>> tx = optax.multi_transform({"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, label_fn)
    """
    rules = list(rules)
    compiled = compile_patterns([pat for pat, _ in rules], name="rules")

    def label_fn(params: Params) -> PyTree:
        visible, hidden = _visible_and_hidden_paths(params, name="rules", patterns=compiled)
        labels: list[Hashable | None] = [None] * len(visible)
        paths = visible + hidden
        for pat, (_, label) in zip(compiled, rules):
            # Every rule must match something, even where an earlier rule wins.
            hits = _matches(paths, [pat], name="rules", allow_unmatched=allow_unmatched)
            for i, hit in enumerate(hits[: len(visible)]):
                if hit and labels[i] is None:
                    labels[i] = label
        return _with_leaf_values(params, [default if lab is None else lab for lab in labels])

    return label_fn


def flattened_traversal(fn: Callable[[KeyPath, Any], Any]) -> Callable[[Params], PyTree]:
    """Kept for code written against flax's/optax's ``flattened_traversal``.

    ``fn(path_tuple, leaf) -> label`` where ``path_tuple`` is the path's parts
    as strings (``("params", "Dense_0", "kernel")``); returns ``params -> labels``.

    >>> import jax.numpy as jnp
    >>> flattened_traversal(lambda p, _: "decay" if p[-1] == "kernel" else "none")({"kernel": jnp.ones(2)})
    {'kernel': 'decay'}
    """

    def label_fn(params: Params) -> PyTree:
        pairs = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_leaf)
        return _with_leaf_values(params, [fn(path_parts(p), unbox(leaf)) for p, leaf in pairs])

    return label_fn
