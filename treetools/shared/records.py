"""Metric records as strict JSON: non-finite numbers written as ``null`` with their kind beside them.

JSON has no NaN or Infinity. Python's ``json`` writes the bare tokens ``NaN``
and ``Infinity``, which strict readers (``jq``, JavaScript's ``JSON.parse``,
Go, pandas' ``read_json`` with ``lines=True`` on some engines) reject. A
metrics record keeps a non-finite value as ``null`` and names its kind under
the reserved key ``nonfinite``::

    {"step": 7, "loss": null, "grad_norm": 2.5, "nonfinite": {"loss": "nan"}}

``decode_record`` turns that back into ``float("nan")`` (``"inf"``, ``"-inf"``
likewise); records written by older treetools with bare ``NaN`` decode as
they are. Standard library only: the metrics writer (jax layer) and the
health-dump reader (no jax) share it.

>>> encoded = encode_record({"step": 7, "loss": float("nan"), "g": 2.5})
>>> encoded
{'step': 7, 'loss': None, 'g': 2.5, 'nonfinite': {'loss': 'nan'}}
>>> decode_record(encoded)
{'step': 7, 'loss': nan, 'g': 2.5}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

NONFINITE = "nonfinite"
"""The reserved record key naming each non-finite value's kind; no metric may use it."""

_KINDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def nonfinite_kind(value: float) -> str:
    """``"nan"``, ``"inf"`` or ``"-inf"`` for a non-finite float."""
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def encode_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with every non-finite float replaced by None and its kind listed under ``nonfinite``.

    Raises:
      ValueError: the record already has a ``nonfinite`` key (it is reserved).
    """
    if NONFINITE in record:
        raise ValueError(f"metric name `{NONFINITE}` is reserved (it records which values are NaN/Inf); "
                         "rename that metric.")
    out: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            kinds[key] = nonfinite_kind(value)
            value = None
        out[key] = value
    if kinds:
        out[NONFINITE] = kinds
    return out


def decode_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record as written, with its ``null`` non-finite values back as floats (the ``nonfinite`` key dropped)."""
    kinds = record.get(NONFINITE)
    if not isinstance(kinds, Mapping):
        return dict(record)
    out = {k: v for k, v in record.items() if k != NONFINITE}
    for key, kind in kinds.items():
        if key in out and out[key] is None and kind in _KINDS:
            out[key] = _KINDS[kind]
    return out
