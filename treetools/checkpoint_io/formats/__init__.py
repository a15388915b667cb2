"""One module per on-disk checkpoint format; each exposes ``FORMAT = Format(...)``.

``treetools.checkpoint_io.source.registered_formats()`` imports every module here (names not
starting with ``_``) and registers its ``FORMAT``: adding a format is adding a
module (and its test file). Modules import nothing heavy at import time.

``catalog()`` lists the same formats without importing them (nor numpy): it
reads each module's ``FORMAT = Format(name=..., priority=..., description=...)``
(or ``indexed_format(NAME, priority=..., description=...)``) from its source,
literals only. ``treetools inspect --help`` lists the formats from it; a test
checks that it agrees with ``registered_formats()``.
"""

from __future__ import annotations

import ast
import os
import pkgutil


def catalog() -> list[tuple[str, str]]:
    """``(name, description)`` of every built-in format, in the order they are asked (descending priority, then
    name), as ``registered_formats()`` has them, read from the modules' source without importing them.

    >>> [name for name, _ in catalog()][:3]
    ['jax-pytree', 't5x', 'flax-legacy']
    """
    found = []
    folder = os.path.dirname(__file__)
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        declared = _declared(os.path.join(folder, f"{info.name}.py"))
        if declared is None:  # no source to read (a bytecode-only install): ask the modules themselves
            from treetools.checkpoint_io.registry import registered_formats  # imports numpy: only where there is no source

            return [(f.name, f.description) for f in registered_formats()]
        found.append(declared)
    return [(name, description) for _, name, description in sorted(found, key=lambda f: (-f[0], f[1]))]


def _declared(file: str) -> tuple[int, str, str] | None:
    """``(priority, name, description)`` of the ``FORMAT = ...(...)`` call of one module's source."""
    try:
        with open(file, encoding="utf-8") as f:
            source = f.read()
        start = source.index("\nFORMAT = ") + 1  # parsed from that statement on: the whole module costs 5x more
        tree = ast.parse(source[start:])
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and any(isinstance(t, ast.Name) and t.id == "FORMAT" for t in node.targets)):
            continue
        call = node.value
        given = {k.arg: k.value for k in call.keywords if k.arg is not None}
        name = given.get("name", call.args[0] if call.args else None)
        if name is None:
            return None
        try:
            return (ast.literal_eval(given["priority"]), ast.literal_eval(name),
                    ast.literal_eval(given["description"]) if "description" in given else "")
        except (KeyError, ValueError, TypeError):
            return None
    return None
