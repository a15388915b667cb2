"""Dtypes in rules: names (numpy's and ml_dtypes'), kinds, and a source leaf's dtype as numpy's."""

from __future__ import annotations

from typing import Any

import numpy as np

_KINDS = {"b": "bool", "i": "integer", "u": "integer", "f": "floating", "c": "complex"}


def resolve_dtype(dtype: Any, *, name: str = "dtype") -> np.dtype:
    """A numeric numpy dtype from a name or dtype-like; ml_dtypes names (``bfloat16``) work too.

    Args:
      dtype: ``"bfloat16"``, ``"float32"``, ``np.float16``, ``jnp.bfloat16``, a ``np.dtype``...
      name: the rule field to name in the error.

    Raises:
      ValueError: not a bool, integer, floating or complex dtype.

    >>> resolve_dtype("bfloat16").name, resolve_dtype(np.float16).name
    ('bfloat16', 'float16')
    """
    import ml_dtypes  # noqa: F401  (registers bfloat16, float8_* ... as numpy dtype names; here, not at import: 4 ms)

    try:
        out = np.dtype(dtype)
    except TypeError:
        out = None
    if out is None or kind(out) is None:
        raise ValueError(
            f"`{name}` {dtype!r} is not a numeric dtype; use a numpy or ml_dtypes name "
            "such as float32, bfloat16, float16, float8_e4m3fn, int32."
        )
    return out


def kind(dtype: np.dtype) -> str | None:
    """``bool``, ``integer``, ``floating``, ``complex``, or None (strings, objects, records).

    >>> kind(resolve_dtype("bfloat16")), kind(np.dtype("int8")), kind(np.dtype("U3"))
    ('floating', 'integer', None)
    """
    if dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes"):
        return "integer" if dtype.name.startswith(("int", "uint")) else "floating"
    return _KINDS.get(dtype.kind)


def source_dtype(dtype: Any) -> np.dtype | Any:
    """A source leaf's dtype as numpy's, or as given when numpy has no such dtype (a PRNG key type).

    >>> source_dtype("float32"), source_dtype("key<fry>"), source_dtype(None)
    (dtype('float32'), 'key<fry>', None)
    """
    if dtype is None:
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


def dtype_text(dtype: Any) -> str | None:
    """A dtype as printed in rows and errors (None for none).

    >>> dtype_text(np.dtype("float32")), dtype_text("key<fry>"), dtype_text(None)
    ('float32', 'key<fry>', None)
    """
    return None if dtype is None else getattr(dtype, "name", str(dtype))
