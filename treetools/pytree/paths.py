"""Key paths and the one path string: ``"a/b/0/c"``.

Inside treetools a path is a ``jax.tree_util`` key path (a tuple of key
entries); it becomes a string only at the edge: dict keys as-is, sequence
indices as integers, attributes by name, joined with ``/``. A flax box or nnx
``Variable`` is a leaf, so no path ends in ``/value``. Patterns over these
strings are ``treetools.shared.patterns`` (no jax).

>>> import jax.numpy as jnp
>>> flatten({"params": {"Dense_0": {"kernel": jnp.ones((2, 3))}}}).keys()
dict_keys(['params/Dense_0/kernel'])
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import jax

from treetools.shared.aliases import KeyPath, PathStr, PyTree
from treetools.pytree.partitioning import is_box

SEP = "/"


def is_leaf(x: Any) -> bool:
    """The ``is_leaf`` every treetools traversal uses: boxes are leaves.

    >>> import flax.linen as nn, numpy as np
    >>> jax.tree.leaves({"k": nn.Partitioned(np.ones(2), names=("x",))}, is_leaf=is_leaf)[0].names
    ('x',)
    """
    return is_box(x)


_KEY_FIELD = {jax.tree_util.DictKey: "key", jax.tree_util.FlattenedIndexKey: "key", jax.tree_util.SequenceKey: "idx",
              jax.tree_util.GetAttrKey: "name"}


def _entry_str(entry: Any) -> str:
    field = _KEY_FIELD.get(type(entry))  # jax's own key types, by exact type: one lookup per path part
    if field is not None:
        value = getattr(entry, field)
        return value if type(value) is str else str(value)
    if isinstance(entry, (jax.tree_util.DictKey, jax.tree_util.FlattenedIndexKey)):
        return str(entry.key)
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return entry.name
    # Custom key types: prefer a ``key``/``name``/``idx`` field over repr noise.
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_parts(keypath: KeyPath) -> tuple[str, ...]:
    """The printable parts of a key path, before they are joined.

    >>> from jax.tree_util import DictKey, SequenceKey
    >>> path_parts((DictKey("layers"), SequenceKey(3)))
    ('layers', '3')
    """
    return tuple(_entry_str(e) for e in keypath)


def path_str(keypath: KeyPath) -> PathStr:
    """Turn a key path into the one path string.

    >>> from jax.tree_util import DictKey, SequenceKey, GetAttrKey
    >>> path_str((SequenceKey(0), GetAttrKey("mu"), DictKey("Dense_0"), DictKey("kernel")))
    '0/mu/Dense_0/kernel'
    """
    return SEP.join(path_parts(keypath))


def path_prefix(path: PathStr, depth: int | None) -> PathStr:
    """The first ``depth`` parts of ``path`` (all of it when depth is None).

    >>> path_prefix("params/encoder/layer_0/kernel", 2)
    'params/encoder'
    """
    if depth is None:
        return path
    if depth < 1:
        raise ValueError(f"`depth` must be a positive integer, got {depth}.")
    return SEP.join(path.split(SEP)[:depth])


def leaves_with_paths(tree: PyTree, *, also_leaf: Callable[[Any], bool] | None = None) -> list[tuple[PathStr, Any]]:
    """``[(path_string, leaf), ...]`` in tree order, boxes kept as leaves.

    Args:
      tree: any pytree.
      also_leaf: nodes to report as leaves besides boxes (e.g. optax's
        ``MaskedNode``, which otherwise has no leaves and no path).

    Raises:
      ValueError: two leaves print to the same path string (e.g. a dict key
        ``"a/b"`` next to ``{"a": {"b": ...}}``), which would make patterns ambiguous.

    >>> import numpy as np
    >>> leaves_with_paths({"layers": [{"w": np.ones(2)}], "step": 3})
    [('layers/0/w', array([1., 1.])), ('step', 3)]
    """
    leaf = is_leaf if also_leaf is None else (lambda x: is_leaf(x) or also_leaf(x))
    pairs = [(path_str(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=leaf)]
    if len({p for p, _ in pairs}) != len(pairs):
        dup = sorted(p for p, n in collections.Counter(p for p, _ in pairs).items() if n > 1)
        raise ValueError(
            f"leaves share the path string(s) {dup[:5]}; rename the keys so that each leaf has one path."
        )
    return pairs


def flatten(tree: PyTree) -> dict[PathStr, Any]:
    """``{path_string: leaf}`` in tree order, boxes kept as leaves.

    >>> flatten({"b": [1.0, 2.0], "a": {"w": 3.0}})
    {'a/w': 3.0, 'b/0': 1.0, 'b/1': 2.0}
    """
    return dict(leaves_with_paths(tree))


def unflatten(flat: dict[PathStr, Any], like: PyTree) -> PyTree:
    """Rebuild a tree with the structure of ``like`` from ``{path: leaf}``.

    Raises:
      ValueError: ``flat`` misses paths of ``like`` or has paths it lacks.

    >>> unflatten({"a/0": 1.0, "a/1": 2.0}, like={"a": (0.0, 0.0)})
    {'a': (1.0, 2.0)}
    """
    pairs, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_leaf)
    paths = [path_str(p) for p, _ in pairs]
    missing = [p for p in paths if p not in flat]
    extra = sorted(set(flat) - set(paths))
    if missing or extra:
        raise ValueError(f"`flat` does not match the tree: missing {missing[:5]}, unexpected {extra[:5]}.")
    return jax.tree_util.tree_unflatten(treedef, [flat[p] for p in paths])


def unflatten_dict(flat: dict[PathStr, Any]) -> dict[str, Any]:
    """Nested dicts from ``{path: leaf}`` when no template tree exists.

    >>> unflatten_dict({"a/b": 1, "a/c": 2})
    {'a': {'b': 1, 'c': 2}}
    """
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, last = path.split(SEP)
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return out


def map_with_path(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """``jax.tree.map`` with the path string as first argument; boxes are leaves.

    >>> map_with_path(lambda path, x: f"{path}={x}", {"a": [1, 2]})
    {'a': ['a/0=1', 'a/1=2']}
    """
    return jax.tree_util.tree_map_with_path(lambda p, *xs: fn(path_str(p), *xs), tree, *rest, is_leaf=is_leaf)
