"""The formats treetools reads: the built-in ones (every module of ``treetools.checkpoint_io.formats``) and those
added with ``register_format``, asked in priority order.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Sequence

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.source import Format, Source  # noqa: F401  (Source: the example below)
from treetools.checkpoint_io.storage import backend

_REGISTERED: dict[str, Format] = {}
_BUILTINS_LOADED = False


def register_format(fmt: Format) -> Format:
    """Add (or replace, by name) a format; ``inspect``, ``diff``, ``verify`` and ``load_parameters`` then read it.

    >>> f = register_format(Format("demo", -100, lambda p, ctx: False, lambda p, d, ctx: Source(d, ctx)))
    >>> "demo" in [x.name for x in registered_formats()]
    True
    >>> unregister_format("demo")
    """
    if not isinstance(fmt, Format):
        raise TypeError(f"`fmt` must be a treetools Format, got {type(fmt).__name__}.")
    _REGISTERED[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format registered by ``register_format`` (tests use it to clean up)."""
    _REGISTERED.pop(name, None)


def _load_builtins() -> None:
    """Import every module of ``treetools.checkpoint_io.formats`` once and register its ``FORMAT``."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    package = importlib.import_module("treetools.checkpoint_io.formats")

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        fmt = getattr(module, "FORMAT", None)
        if isinstance(fmt, Format):
            _REGISTERED.setdefault(fmt.name, fmt)
    _BUILTINS_LOADED = True


def registered_formats() -> list[Format]:
    """Every registered format, in the order they are asked (descending priority, then name)."""
    _load_builtins()
    return sorted(_REGISTERED.values(), key=lambda f: (-f.priority, f.name))


def claims(fmt: Format, location: str, context: ReadContext) -> bool:
    """Whether ``fmt`` claims ``location`` (read through ``context``'s storage); an OS error is no claim."""
    try:
        return bool(fmt.claims(location, context))
    except OSError:
        return False


def claiming_format(location: str, formats: Sequence[Format] | None = None, *,
                    context: ReadContext | None = None) -> Format | None:
    """The format that would open ``location`` (the first, in priority order, that claims it), or None.

    ``context``: what the claims read through (None: the storage of ``location``'s scheme).
    """
    context = context if context is not None else ReadContext().within(backend(location))
    return next((f for f in (formats if formats is not None else registered_formats())
                 if claims(f, location, context)), None)
