"""Type aliases shared by every treetools module."""

from __future__ import annotations

from typing import Any, TypeAlias

PyTree: TypeAlias = Any
"""Any JAX pytree: nested dicts, lists, tuples, namedtuples, dataclasses, optax states, nnx State."""

Params: TypeAlias = PyTree
"""A parameter tree, plain or with flax boxes (``Partitioned``, nnx ``Variable``) as leaves."""

KeyPath: TypeAlias = tuple[Any, ...]
"""A ``jax.tree_util`` key path: a tuple of ``DictKey``/``SequenceKey``/``GetAttrKey``/... entries."""

PathStr: TypeAlias = str
"""The one printable path form, key path entries joined with ``/`` (see ``treetools.pytree.paths``)."""
