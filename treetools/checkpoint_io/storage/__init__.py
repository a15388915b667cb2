"""Where checkpoint files live, behind one interface: the local disk, or ``gs://`` and ``s3://`` buckets.

``backend(path)`` is the ``Storage`` of a path's scheme (one instance per
scheme, made at its first path); ``backend(path).confine(path)`` the storage
a checkpoint opened at ``path`` reads through (``open_source`` makes it: every
read stays inside the checkpoint). Callers ask a ``Storage``; none branches on
the scheme. A new scheme is one ``Storage`` subclass, registered with
``register_scheme``.

Modules: ``base`` (the interface, names), ``local`` (the disk, and
confinement), ``bucket`` (fsspec and TensorStore in buckets), ``reach``
(offline probes, credentials, errors as one line). Standard library only at
import time.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any, Callable

from treetools.checkpoint_io.storage.base import (OutsideCheckpointError, Pinned, SpecialFileError, Storage, Upload, is_url,
                                         kind_of_mode, normalize, split_url)
from treetools.checkpoint_io.storage.bucket import GcsStorage, RemoteNotFoundError, S3Storage, make
from treetools.checkpoint_io.storage.local import LocalStorage, Root
from treetools.checkpoint_io.storage.reach import RemoteStorageError
from treetools.shared.errors import CheckpointError

LOCAL = LocalStorage()
"""The local disk, unconfined."""

_SCHEMES: dict[str, Callable[[str], Storage]] = {
    "gs": lambda url: make(GcsStorage, url),
    "s3": lambda url: make(S3Storage, url),
}
_BACKENDS: dict[str, Storage] = {}
_BACKENDS_LOCK = threading.Lock()


def register_scheme(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Read ``scheme://`` URLs through the ``Storage`` that ``factory(first_url)`` makes (once per process)."""
    with _BACKENDS_LOCK:
        _SCHEMES[scheme.lower()] = factory
        _BACKENDS.pop(scheme.lower(), None)


def backend(path: str) -> Storage:
    """The (unconfined) storage of ``path``'s scheme: the local disk for a path, a bucket client for a URL.

    Raises:
      CheckpointError: a URL of a scheme no backend reads (the message lists those that are read).
      RemoteStorageError: the scheme's extra is missing, or its endpoint cannot be reached.

    >>> backend("/data/ckpt") is LOCAL
    True
    """
    if not is_url(path):
        return LOCAL
    scheme = split_url(path)[0]
    with _BACKENDS_LOCK:
        found = _BACKENDS.get(scheme)
        if found is None:
            factory = _SCHEMES.get(scheme)
            if factory is None:
                raise CheckpointError(f"{path}: no storage reads {scheme}:// URLs; readable: local paths, "
                                      f"{', '.join(f'{s}://' for s in sorted(_SCHEMES))}.")
            found = _BACKENDS[scheme] = factory(path)
        return found


def forget_clients() -> None:
    """Drop every bucket client made so far (the next URL of a scheme makes a new one from the environment)."""
    with _BACKENDS_LOCK:
        _BACKENDS.clear()


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
