"""``open_source``: any checkpoint opened read-only, through the format that claims it, confined to itself."""

from __future__ import annotations

import os

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.diagnose import did_you_mean, not_a_checkpoint
from treetools.checkpoint_io.registry import claims, registered_formats
from treetools.checkpoint_io.source import Source
from treetools.checkpoint_io.steps import file_kind
from treetools.checkpoint_io.storage import as_typed, backend, normalize
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError


def open_source(path: str | os.PathLike, context: ReadContext | None = None, *, memory_budget: float | None = None,
                prefix: str | None = None, follow_links: bool | None = None) -> Source:
    """Open any checkpoint read-only through the format that claims it.

    Relative and ``~`` paths work; the path is shown as given. The path is the
    checkpoint's root: the storage it is read through is confined to it
    (``Storage.confine``: an open descriptor of its folder), so every local
    file read under it, by treetools or by TensorStore, must resolve inside it
    (docs/untrusted.md). The source, and every reader it hands out, holds that
    storage in its ``context``.

    Args:
      path: a checkpoint file or folder, local or ``gs://``/``s3://``.
      context: how to read it (``ReadContext``); None: ``ReadContext.from_env()`` (the documented
        environment variables, else the defaults).
      memory_budget: bytes one read may decode at once (a storage chunk, a
        metadata file parsed whole), over the context's; ``math.inf``: no budget.
      prefix: in a folder holding several series of steps (flax's
        ``save_checkpoint(prefix=...)``: ``checkpoint_6`` and ``eval_6``), read
        this one (None: the context's, else ``checkpoint_``, else the steps named by number alone).
      follow_links: follow symlinks that lead out of the checkpoint (None: the context's, off by default); see
        ``ReadContext.follow_links`` and docs/untrusted.md for what it gives up.

    Raises:
      CheckpointNotFoundError: nothing at ``path``.
      CheckpointError: no format claims it (the message names the checkpoint
        the path lies inside, or those a folder holds, else the readable
        formats), or the format finds it corrupt or unreadable.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, w=np.ones(3, np.float32))
    >>> src = open_source(f)
    >>> src.format, src.steps, [l.row.params for l in src.snapshot().items["default"].leaves]
    ('npz', None, [3])
    """
    display = os.fspath(path)
    if not display:
        raise CheckpointNotFoundError("empty path: pass a checkpoint folder or file.")
    context = context if context is not None else ReadContext.from_env()
    context = context.replace(**{k: v for k, v in (("memory_budget", memory_budget), ("prefix", prefix),
                                                   ("follow_links", follow_links)) if v is not None})
    location = normalize(display)
    try:
        return _open(location, display, context)
    except (CheckpointError, CheckpointNotFoundError) as e:  # named as typed (`file:///x`, not `file://x`)
        raise as_typed(e, location, display) from None


def _open(location: str, display: str, context: ReadContext) -> Source:
    storage = backend(location)
    storage.forget(location)  # a bucket is listed afresh each time a checkpoint is opened
    if not storage.exists(location):
        if storage.link_target(location) is not None:
            raise CheckpointError(f"{display}: {file_kind(storage, location)}; point at the checkpoint itself.")
        error = storage.missing(location)
        hint = did_you_mean(location, display, storage) if isinstance(error, CheckpointNotFoundError) else None
        if hint is not None:  # "model.safetensor: no such file or folder; did you mean model.safetensors?"
            error = type(error)(f"{str(error).rstrip('.')}{hint}")
        raise error
    if not (storage.isdir(location) or storage.isfile(location)):
        raise CheckpointError(f"{display}: not a regular file ({file_kind(storage, location)}); point at a "
                              "checkpoint file or folder.")
    confined = context.confined_to(location)  # from here on, every read must resolve inside PATH
    if storage.isdir(location):
        storage.prefetch(location, tree=True)  # in a bucket, one LIST answers the probes of every step and item below
    registered = registered_formats()
    for fmt in registered:
        if claims(fmt, location, confined):
            return fmt.open(location, display, confined)
    raise NotACheckpointError(not_a_checkpoint(location, display, registered, context))
