"""``treetools.ckpt``: the public names of the checkpoint I/O layer for format authors, under their first name.

The layer itself lives in ``treetools.checkpoint_io`` (renamed so that its folder says what it is, beside
``treetools.checkpoint_jax``); this module keeps ``from treetools.ckpt import Source, register_format, ...``
working. It re-exports exactly ``treetools.checkpoint_io.__all__``, lazily (importing it imports no numpy).
"""

import importlib as _importlib
import typing as _typing

from treetools.checkpoint_io import __all__  # the same public names, one list


def __getattr__(name: str) -> _typing.Any:
    if name not in __all__:
        raise AttributeError(f"module 'treetools.ckpt' has no attribute {name!r}")
    value = getattr(_importlib.import_module("treetools.checkpoint_io"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
