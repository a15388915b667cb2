"""Which ``Storage`` reads which scheme: ``register_scheme`` (called by the module that defines a scheme's
``Storage``, at import) and ``backend(path)``, the storage of a path's scheme (one instance per scheme, made at
its first path). Standard library only.
"""

from __future__ import annotations

import threading
from typing import Callable

from treetools.checkpoint_io.storage.base import Storage, is_url, split_url
from treetools.checkpoint_io.storage.local import LocalStorage
from treetools.shared.errors import CheckpointError

LOCAL = LocalStorage()
"""The local disk, unconfined."""

_SCHEMES: dict[str, Callable[[str], Storage]] = {}
_BACKENDS: dict[str, Storage] = {}
_BACKENDS_LOCK = threading.Lock()


def register_scheme(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Read ``scheme://`` URLs through the ``Storage`` that ``factory(first_url)`` makes (once per process).

    The one call a new scheme needs, made by the module that defines its
    ``Storage`` (``bucket.py`` registers ``gs`` and ``s3`` so). For TensorStore
    to read arrays in it too, the same module registers the scheme's key-value
    store with ``treetools.checkpoint_io.register_kvstore``; without
    one, a format whose arrays TensorStore reads refuses the scheme with one line.
    """
    with _BACKENDS_LOCK:
        _SCHEMES[scheme.lower()] = factory
        _BACKENDS.pop(scheme.lower(), None)


def registered_schemes() -> list[str]:
    """The URL schemes read, sorted (the local disk, ``file``, is read from plain paths)."""
    with _BACKENDS_LOCK:
        return sorted(_SCHEMES)


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
