"""The values of treetools' documented environment variables, parsed (stdlib only: no variable is read here).

``ReadContext.from_env`` (``treetools/checkpoint_io/context.py``) reads the variables and
parses them with these functions; the ``treetools`` program's own process
settings (``treetools/cli/_process.py``) size malloc's free memory from the same
block size before anything heavy is imported. Each parser takes the raw text
(None or empty: the default) and raises ``CheckpointError`` naming the variable
and echoing the value as given.
"""

from __future__ import annotations

import dataclasses
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


# ---------------------------------------------------------------------------- the read options' table


@dataclasses.dataclass(frozen=True)
class ReadSetting:
    """One row of the read options' table: a ``tt.ReadOptions`` field and the command-line flag that sets it.

    Attributes:
      flag: the flag every command that reads a checkpoint has (``treetools.cli.options.add_reading``).
      kind: how its value is read: ``size`` (``shared.rows.parse_size``: ``64MiB``, ``500MB``, ``16G``, a bare
        number of bytes), ``count`` (a positive integer), ``switch`` (on when given), ``toggle`` (``--x`` /
        ``--no-x``, unset: automatic), ``processes`` (``--processes N`` and ``--distributed``: this process's
        share of a run of several, ``cli/_distributed.py``).
      metavar: the value's name in the help.
      help: the flag's help, the one place it is written.
      data: the setting is about reading array data: a command that reads metadata only (``plan``) says it
        changes nothing there.
      minimum: the smallest size taken (bytes).
      unbounded: ``inf`` is taken (no limit).
      alias: a hidden older spelling, and the unit of a bare number under it (``--memory-budget-mb``: MiB).
    """

    flag: str
    kind: str
    metavar: str | None
    help: str
    data: bool = True
    minimum: int = 1
    unbounded: bool = False
    alias: tuple[str, int] | None = None


READ_SETTINGS: dict[str, ReadSetting] = {
    "follow_links": ReadSetting(
        "--follow-links", "switch", None, data=False,
        help="follow symlinks that lead out of the checkpoint (step folders on another volume); off by default: "
             "only for checkpoints you trust (docs/untrusted.md)"),
    "memory_budget": ReadSetting(
        "--memory-budget", "size", "SIZE", data=False, unbounded=True, alias=("--memory-budget-mb", 2**20),
        help="most stored data decoded at once: one storage chunk, one --show read, a metadata file parsed whole; "
             "a size (4GiB, 500MB, bytes) or inf (default 2GiB; TREETOOLS_MEMORY_BUDGET_MB)"),
    "block_bytes": ReadSetting(
        "--block-size", "size", "SIZE", minimum=1024, alias=("--chunk-mb", 2**20),
        help="stored data per block of a streamed read (--stats, --values, verify, convert): a size (64MiB, 8M, "
             "bytes), at least 1KiB (default 8MiB; TREETOOLS_CHUNK_BYTES)"),
    "workers": ReadSetting(
        "--workers", "count", "N",
        help="threads reading blocks (default: the cores this process may run on; TREETOOLS_WORKERS)"),
    "progress": ReadSetting(
        "--progress", "toggle", None,
        help="draw a progress bar on stderr while array data is read (default: when stderr is a terminal)"),
    "share": ReadSetting(
        "--processes", "processes", "N",
        help="read with N processes on this machine (jax.distributed on 127.0.0.1), each a share of the leaves "
             "by bytes; one report, the same as one process's"),
}
"""The read options (``tt.ReadOptions``' fields, ``treetools/checkpoint_io/context.py``) and their flags: every
command that reads a checkpoint has every one of them, generated from this table (``cli.options.add_reading``);
a test checks the table names exactly ``ReadOptions``' fields. docs/cli.md lists them."""
