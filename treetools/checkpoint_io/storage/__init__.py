"""Where checkpoint files live, behind one interface: the local disk, or ``gs://`` and ``s3://`` buckets.

``backend(path)`` is the ``Storage`` of a path's scheme (one instance per
scheme, made at its first path); ``backend(path).confine(path)`` the storage
a checkpoint opened at ``path`` reads through (``open_source`` makes it: every
read stays inside the checkpoint). Callers ask a ``Storage``; none branches on
the scheme. A new scheme is one module: a ``Storage`` subclass (an ``abc.ABC``:
it implements the abstract methods, ``confine`` among them) and the
``register_scheme`` call that names its scheme (see docs/formats.md, "Adding a
storage scheme").

Modules: ``base`` (the interface, names), ``local`` (the disk, and
confinement), ``schemes`` (``register_scheme``, ``backend``), ``bucket``
(``gs://`` and ``s3://`` through fsspec, registered there), ``reach``
(offline probes, credentials, errors as one line). Standard library only at
import time.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from treetools.checkpoint_io.storage import bucket
from treetools.checkpoint_io.storage.base import (
    Entry,
    OutsideCheckpointError,
    Stat,
    SpecialFileError,
    Storage,
    Upload,
    is_url,
    join,
    entries,
    kind_of_mode,
    map_io,
    normalize,
    parent,
    realpath,
    split_url,
)
from treetools.checkpoint_io.storage.bucket import (
    GcsStorage,
    RemoteNotFoundError,
    S3Storage,
)
from treetools.checkpoint_io.storage.local import LocalStorage, Root
from treetools.checkpoint_io.storage.reach import RemoteStorageError
from treetools.checkpoint_io.storage.schemes import (
    LOCAL,
    backend,
    forget_clients,
    register_scheme,
    registered_schemes,
)
from treetools.shared.errors import CheckpointError

__all__ = ["LOCAL", "Entry", "GcsStorage", "LocalStorage", "OutsideCheckpointError", "RemoteNotFoundError",
           "RemoteStorageError", "Root", "S3Storage", "SpecialFileError", "Stat", "Storage", "Upload", "as_typed",
           "backend", "entries", "forget_clients", "is_url", "join", "kind_of_mode", "location", "map_io",
           "normalize", "parent", "realpath", "register_scheme", "registered_schemes", "split_url"]


def location(path: Any, *, name: str = "path") -> str:
    """Where a path given by a user points: an absolute local path (``~`` expanded; Orbax needs absolute
    ones) from a str, PathLike or ``etils.epath.Path``, or a ``gs://`` / ``s3://`` URL as it is.

    Raises:
      TypeError: ``path`` is not a path (the message names the argument ``name``).

    >>> location("gs://b//run/"), location("/tmp/../tmp/x")
    ('gs://b/run', '/tmp/x')
    """
    if isinstance(path, (str, os.PathLike)):
        return normalize(os.fspath(path))
    if hasattr(path, "as_posix"):  # etils.epath.Path
        return normalize(str(path) if is_url(str(path)) else path.as_posix())
    raise TypeError(f"`{name}` must be a path, got {type(path).__name__}.")



def as_typed(error: Exception, location: str, typed: str) -> Exception:
    """``error``, whose message starts with ``location`` (a path as ``location`` made it), naming the path as the
    user ``typed`` it instead: the same error, its attributes kept.

    >>> str(as_typed(CheckpointError("file://tmp/x: no storage reads file:// URLs."), "file://tmp/x", "file:///tmp/x"))
    'file:///tmp/x: no storage reads file:// URLs.'
    """
    text = str(error)
    if location == typed or not text.startswith(location):
        return error
    named = copy.copy(error)
    named.args = (typed + text[len(location):],)
    return named
