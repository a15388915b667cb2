"""Key-path helpers shared by the writers: jax's key entries as the strings the trainers name them by."""

from __future__ import annotations

from typing import Any

import jax


def entry_name(entry: Any) -> str:
    """A jax key entry as a trainer writes it: dict key, sequence index, attribute or namedtuple field name."""
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    raise TypeError(f"unknown key entry {entry!r}")


def flat_with_names(tree: Any, sep: str = "/") -> dict[str, Any]:
    """``{joined key path: leaf}`` in jax's flatten order (None leaves dropped, as jax drops them)."""
    return {sep.join(entry_name(e) for e in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
