"""The read context: how one command reads checkpoints, built once at the edge and passed down explicitly.

A ``ReadContext`` is a small immutable object: the memory budget, the block
size, the number of reading threads, the series of steps to read, and the
storage a checkpoint's reads go through (confined to the checkpoint it was
opened at). The CLI builds it from its options, the library's entry points
(``open_source``, ``load_parameters``, ``inspect_path``, ...) from their
arguments; ``ReadContext.from_env`` is the one place where the documented
environment variables are read. ``open_source`` binds it to the checkpoint's
confined storage (``within``) and hands it to the format, which hands it to
every reader it makes: a worker thread reads the settings of the reader it
holds, and nothing depends on which thread asks.

| variable | field | default |
|---|---|---|
| ``TREETOOLS_MEMORY_BUDGET_MB`` | ``memory_budget`` (MB; ``inf``: none) | 2048 MB |
| ``TREETOOLS_CHUNK_BYTES`` | ``block_bytes`` (at least 1024) | 8 MiB |
| ``TREETOOLS_WORKERS`` | ``workers`` (threads) | the cores the process may run on |
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from treetools.checkpoint_io.share import Share
from treetools.checkpoint_io.storage import Storage, backend
from treetools.shared.rows import parse_size
from treetools.shared.settings import (DEFAULT_BLOCK_BYTES, DEFAULT_MEMORY_BUDGET, block_bytes_from, memory_budget_from,
                                       workers_from)

UNBOUNDED = math.inf
"""No budget: whole arrays are what ``load_parameters`` returns, held to the machine's memory instead."""


@dataclasses.dataclass(frozen=True)
class ReadContext:
    """How checkpoints are read: one immutable object, passed as an argument to every reading layer.

    Attributes:
      memory_budget: the most stored data one read may decode at once, in bytes (one storage chunk, one
        ``--show`` slice, a metadata file parsed whole); ``math.inf``: no budget.
      block_bytes: bytes of stored data per block of a streamed read.
      workers: threads of the block engine; None: the cores this process may run on (a bucket: at least 16).
        Given, it replaces the cores in every rule that counts them (so setting it to the cores changes nothing).
      prefix: in a folder holding several series of steps (``checkpoint_6`` and ``eval_6``), the one to read
        (None: ``checkpoint_``, else the steps named by number alone).
      bound: the storage reads go through; ``open_source`` binds it to the checkpoint opened (``within``,
        ``confined_to``), confined to it. None before that. ``storage`` is the same, as a ``Storage``: reading it
        on a context not bound yet raises (a format and a reader are only ever handed a bound one).
      share: this process's share of a run of several (``treetools.checkpoint_io.share``): the block engine reads its
        jobs only and pools every process's results. None: one process reads everything.
      follow_links: follow symlinks that lead out of the checkpoint (a step folder kept on another volume):
        the storage is then not confined to the checkpoint, and a link inside it may make treetools read any
        file the user can (docs/untrusted.md says what that gives up). Off by default; for checkpoints you trust.

    >>> ctx = ReadContext(memory_budget=64 * 2**20)
    >>> ctx.memory_budget // 2**20, ctx.block_bytes // 2**20, ctx.workers
    (64, 8, None)
    >>> ReadContext(memory_budget="64MiB", block_bytes="1M") == ReadContext(memory_budget=2**26, block_bytes=2**20)
    True
    """

    memory_budget: float = DEFAULT_MEMORY_BUDGET
    block_bytes: int = DEFAULT_BLOCK_BYTES
    workers: int | None = None
    prefix: str | None = None
    bound: Storage | None = dataclasses.field(default=None, compare=False, repr=False)
    follow_links: bool = False
    share: Share | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _sizes(self)
        if not (isinstance(self.memory_budget, (int, float)) and self.memory_budget > 0):
            raise ValueError(f"`memory_budget` must be a positive number of bytes (math.inf: none), got "
                             f"{self.memory_budget!r}.")
        if not (isinstance(self.block_bytes, int) and self.block_bytes >= 1):
            raise ValueError(f"`block_bytes` must be a positive number of bytes, got {self.block_bytes!r}.")
        if self.workers is not None and not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"`workers` must be a positive number of threads, got {self.workers!r}.")
        if not isinstance(self.follow_links, bool):
            raise TypeError(f"`follow_links` must be True or False, got {self.follow_links!r}.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> "ReadContext":
        """A context from the fields ``given`` (None values ignored), the rest from the environment variables.

        Raises:
          CheckpointError: a variable is set to something that is not a valid value (naming it).

        >>> ReadContext.from_env({"TREETOOLS_MEMORY_BUDGET_MB": "64"}, block_bytes=4096).memory_budget / 2**20
        64.0
        >>> ReadContext.from_env({"TREETOOLS_WORKERS": "x"})
        Traceback (most recent call last):
        treetools.shared.errors.CheckpointError: `TREETOOLS_WORKERS` must be a positive number of threads, got 'x'.
        """
        env = os.environ if environ is None else environ
        fields = {k: v for k, v in given.items() if v is not None}
        if "memory_budget" not in fields:
            fields["memory_budget"] = memory_budget_from(env.get("TREETOOLS_MEMORY_BUDGET_MB"))
        if "block_bytes" not in fields:
            fields["block_bytes"] = block_bytes_from(env.get("TREETOOLS_CHUNK_BYTES"))
        if "workers" not in fields:
            fields["workers"] = workers_from(env.get("TREETOOLS_WORKERS"))
        return cls(**fields)

    @property
    def storage(self) -> Storage:
        """The storage this context reads through (``within``).

        Raises:
          RuntimeError: the context is not bound to a checkpoint yet (a bug of the caller, not of the checkpoint).

        >>> ReadContext().storage
        Traceback (most recent call last):
        RuntimeError: this ReadContext is not bound to a checkpoint's storage yet; bind it with within(storage) or
        confined_to(path) (open_source does).
        """
        if self.bound is None:
            raise RuntimeError("this ReadContext is not bound to a checkpoint's storage yet; bind it with "
                               "within(storage) or confined_to(path) (open_source does).")
        return self.bound

    def within(self, storage: Storage) -> "ReadContext":
        """This context reading through ``storage`` (the confined storage of one opened checkpoint)."""
        return dataclasses.replace(self, bound=storage)

    def confined_to(self, location: str) -> "ReadContext":
        """This context reading through ``location``'s storage confined to it (as ``open_source`` reads it).

        >>> import tempfile
        >>> ctx = ReadContext().confined_to(tempfile.mkdtemp())
        >>> ctx.storage.isdir("/")
        True
        """
        return self.within(backend(location).confine(location, follow_links=self.follow_links))

    def replace(self, **changes: Any) -> "ReadContext":
        """A copy with ``changes`` (``load_parameters`` reads whole arrays: ``memory_budget=math.inf``)."""
        return dataclasses.replace(self, **changes)


def _sizes(options: Any) -> None:
    """``options``' sizes given as text (``"64MiB"``, ``"2GB"``, ``"inf"`` for no budget) as bytes, in place (a
    frozen dataclass being built): the one parser of every size (``shared.rows.parse_size``; a bare number is
    bytes). ``ValueError`` naming the field and the forms taken."""
    for name, unbounded in (("memory_budget", True), ("block_bytes", False)):
        value = getattr(options, name)
        if isinstance(value, str):
            object.__setattr__(options, name, parse_size(value, what=name, unbounded=unbounded))


def resolve(context: "ReadContext | None") -> "ReadContext":
    """``context``, or one from the environment (a library call given none)."""
    return context if context is not None else ReadContext.from_env()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How a command reads a checkpoint: block size, threads, memory budget, progress bar, links, processes.

    The one read-options object: every function that reads a checkpoint takes it, as its options class's base
    (``InspectOptions``, ``DiffOptions``, ``VerifyOptions``, ``ConvertOptions``) or as the keyword ``read=``
    (``show_report``, ``plan_checkpoint``, ``plot_stats``, ``stats_report``), which also takes the
    ``ReadContext`` it builds. Every command that reads has one flag per field, generated from one table
    (``treetools.shared.settings.READ_SETTINGS``; docs/cli.md). A size may be given with its unit (``"64MiB"``,
    ``"2GB"``, a bare number is bytes).

    Attributes:
      block_bytes: bytes of stored data per block (None: ``TREETOOLS_CHUNK_BYTES``, else 8 MiB).
      workers: threads of the block engine (None: ``TREETOOLS_WORKERS``, else the cores this process may run on).
      memory_budget: the most stored data decoded at once, in bytes (None:
        ``TREETOOLS_MEMORY_BUDGET_MB``, else 2 GiB; ``math.inf``: none).
      progress: draw a progress bar on stderr (None: when stderr is a terminal).
      follow_links: follow symlinks that lead out of the checkpoint (``ReadContext.follow_links``; off by
        default: a link out is refused).
      share: this process's share of a run of several (``tt.connect_processes()``; ``ReadContext.share``): it
        reads its share of the leaves, and every process gets the whole report.
    """

    block_bytes: int | None = None
    workers: int | None = None
    memory_budget: float | None = None
    progress: bool | None = None
    follow_links: bool = False
    share: Share | None = None

    def __post_init__(self) -> None:
        _sizes(self)

    def read_context(self) -> ReadContext:
        """The ``ReadContext`` a command reads with: these fields, the environment variables for those not given
        (``ReadContext.from_env``), and the options' ``prefix`` where it has one. Built once per command.

        >>> ReadOptions(memory_budget=2**20, workers=2).read_context().workers
        2
        """
        return ReadContext.from_env(memory_budget=self.memory_budget, block_bytes=self.block_bytes,
                                    workers=self.workers,
                                    prefix=getattr(self, "prefix", None), follow_links=self.follow_links,
                                    share=self.share)


READ_FIELDS = ("block_bytes", "workers", "memory_budget", "progress", "follow_links", "share")
"""``ReadOptions``' own fields (its subclasses add the command's): what ``read=`` carries."""


def read_fields(read: "ReadOptions | ReadContext | None") -> dict[str, Any]:
    """The read options ``read`` gives, as ``ReadOptions`` fields: what an options class built from it takes
    (``InspectOptions(**read_fields(read), ...)``). A ``ReadContext`` gives its own (and no progress bar
    setting: automatic); None gives none (the environment's, then the defaults).

    >>> read_fields(ReadContext(block_bytes=4096, follow_links=True))["block_bytes"]
    4096
    >>> read_fields(None)
    {}
    """
    if read is None:
        return {}
    if isinstance(read, ReadOptions):
        return {name: getattr(read, name) for name in READ_FIELDS}
    if isinstance(read, ReadContext):
        return {name: getattr(read, name) for name in READ_FIELDS if name != "progress"}
    raise TypeError(f"`read` must be a tt.ReadOptions, a ReadContext or None, got {type(read).__name__}.")


def context_of(read: "ReadOptions | ReadContext | None", **given: Any) -> ReadContext:
    """The ``ReadContext`` a function given ``read=`` reads with: ``read``'s (a ``ReadOptions`` builds it; None:
    the environment's), with the loose keywords ``given`` that are not None on top (``memory_budget=``,
    ``prefix=``: the older keywords of the same functions).

    >>> context_of(ReadOptions(workers=2), memory_budget="1GiB").memory_budget == 2**30
    True
    """
    if isinstance(read, ReadContext):
        context = read
    elif read is None or isinstance(read, ReadOptions):
        context = (read or ReadOptions()).read_context()
    else:
        raise TypeError(f"`read` must be a tt.ReadOptions, a ReadContext or None, got {type(read).__name__}.")
    changes = {k: v for k, v in given.items() if v is not None}
    return context.replace(**changes) if changes else context
