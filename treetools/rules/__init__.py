"""The rules engine: rename, drop, keep, cast, transpose, stack/unstack over path strings (no jax)."""

from treetools.rules.engine import Rules

__all__ = ["Rules"]
