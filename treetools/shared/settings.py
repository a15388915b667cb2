"""The values of treetools' documented environment variables, parsed (stdlib only: no variable is read here).

``ReadContext.from_env`` (``treetools/checkpoint_io/context.py``) reads the variables and
parses them with these functions; the ``treetools`` program's own process
settings (``treetools/cli/_process.py``) size malloc's free memory from the same
block size before anything heavy is imported. Each parser takes the raw text
(None or empty: the default) and raises ``CheckpointError`` naming the variable
and echoing the value as given.
"""

from __future__ import annotations

import math

from treetools.shared.errors import CheckpointError
from treetools.shared.rows import parse_size

DEFAULT_MEMORY_BUDGET = 2 * 2**30
"""The memory budget when neither the caller nor ``TREETOOLS_MEMORY_BUDGET_MB`` gives one."""

DEFAULT_BLOCK_BYTES = 8 * 2**20
"""Bytes of stored data per block for ``--stats``, ``diff --values``, ``verify`` and ``convert``."""


def memory_budget_from(raw: str | None) -> float:
    """``TREETOOLS_MEMORY_BUDGET_MB``'s text -> bytes: MiB (fractions allowed), or a size with its unit as every
    size flag takes it (``4G``, ``500MB``: ``shared.rows.parse_size``); ``inf``: none.

    >>> memory_budget_from("0.5"), memory_budget_from("1G"), memory_budget_from(None) == DEFAULT_MEMORY_BUDGET
    (524288, 1073741824, True)
    """
    if not raw:
        return DEFAULT_MEMORY_BUDGET
    try:
        return parse_size(raw, what="TREETOOLS_MEMORY_BUDGET_MB", bare=2**20, unbounded=True)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def block_bytes_from(raw: str | None) -> int:
    """``TREETOOLS_CHUNK_BYTES``'s text -> bytes per block (a whole number, at least 1024).

    >>> block_bytes_from("1e6")
    1000000
    >>> block_bytes_from("1.5")
    Traceback (most recent call last):
    treetools.shared.errors.CheckpointError: `TREETOOLS_CHUNK_BYTES` must be a whole number of bytes, got '1.5'.
    """
    if not raw:
        return DEFAULT_BLOCK_BYTES
    try:
        number = float(raw)  # `1e6` is a whole number of bytes too
    except ValueError:
        number = math.nan
    if not number.is_integer():  # `1.5`, `x`, `inf` (never truncated to another size)
        raise CheckpointError(f"`TREETOOLS_CHUNK_BYTES` must be a whole number of bytes, got {raw!r}.")
    if number < 1024:
        raise CheckpointError(f"`TREETOOLS_CHUNK_BYTES` must be at least 1024, got {raw!r}.")
    return int(number)


def workers_from(raw: str | None) -> int | None:
    """``TREETOOLS_WORKERS``'s text -> reading threads (None: as many as the process's cores).

    >>> workers_from("4"), workers_from("")
    (4, None)
    """
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise CheckpointError(f"`TREETOOLS_WORKERS` must be a positive number of threads, got {raw!r}.")
    return value
