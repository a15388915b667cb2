"""``--show``: the values of one leaf, or of a slice of it, reading only the chunks the slice needs."""

from __future__ import annotations

import difflib
import math
from typing import Any

import numpy as np

from treetools.ckpt.readers import MemoryBudgetError, block_extent, resolve_budget
from treetools.ckpt.source import open_source
from treetools.errors import CheckpointNotFoundError
from treetools.rows import human


def parse_leaf_spec(spec: str) -> tuple[str, tuple[Any, ...] | None]:
    """``"params/w[0:2, 3]"`` -> ``("params/w", (slice(0, 2), 3))``; no brackets -> ``(spec, None)``.

    >>> parse_leaf_spec("opt/0/mu/w[::2, -1]")
    ('opt/0/mu/w', (slice(None, None, 2), -1))
    >>> parse_leaf_spec("layers.0.weight")
    ('layers.0.weight', None)
    """
    text = spec.strip()
    if not text.endswith("]") or "[" not in text:
        return text, None
    name, _, inside = text[:-1].rpartition("[")
    index: list[Any] = []
    for part in inside.split(","):
        part = part.strip()
        try:
            if ":" in part:
                bits = [int(b) if b.strip() else None for b in part.split(":")]
                if len(bits) > 3:
                    raise ValueError
                index.append(slice(*bits))
            else:
                index.append(int(part))
        except ValueError:
            raise ValueError(f"`show` index {part!r} in {spec!r} is not an integer or a start:stop:step slice.") from None
    return name, tuple(index)


def show_leaf(path: str, spec: str, *, step: int | str | None = None, item: str | None = None,
              memory_budget: float | None = None, prefix: str | None = None) -> tuple[str, Any]:
    """The values of one leaf, or of a slice of it, reading only that leaf (only the chunks a slice needs).

    Args:
      path: any checkpoint ``inspect_path`` reads.
      spec: the leaf's path (``params/Dense_0/kernel``, or without the item
        name when ``item`` is given or the path is unique), optionally with a
        numpy-style index of integers and slices: ``params/w[0:4, -1]``.
      step: the step of a checkpoint root (default: latest).
      item: the item holding the leaf.
      memory_budget: the most the read may hold, in bytes (None: ``TREETOOLS_MEMORY_BUDGET_MB``, else 2 GiB).
      prefix: the series of steps in a folder holding several (default ``checkpoint_``).

    Returns:
      ``(item/path, numpy array or value)``.

    Raises:
      CheckpointNotFoundError: no such leaf (the message names close paths).

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz"); np.savez(f, w=np.arange(12).reshape(3, 4))
    >>> show_leaf(f, "w[1, ::2]")
    ('default/w', array([4, 6]))
    """
    name, index = parse_leaf_spec(spec)
    source = open_source(path, memory_budget=memory_budget, prefix=prefix)
    resolved = source.resolve(step)
    with source.reading(resolved):  # a step pruned while it is read: StepDeletedError naming it
        return _show_leaf(source, resolved, spec, name, index, item)


def _show_leaf(source: Any, resolved: int | None, spec: str, name: str, index: tuple[Any, ...] | None,
               item: str | None) -> tuple[str, Any]:
    names = [item] if item is not None else source.item_names(resolved)
    head, _, rest = name.partition("/")
    if item is None and head in names and rest:
        names, name = [head], rest
    found = []
    for item_name in names:
        snap = source.snapshot(resolved, [item_name])
        found += [(item_name, leaf) for leaf in snap.items[item_name].leaves if leaf.name == name]
        if found:
            break
    if not found:
        every = [f"{n}/{leaf.name}" for n in names for leaf in source.snapshot(resolved, [n]).items[n].leaves]
        close = difflib.get_close_matches(name, every, n=5, cutoff=0.3) or every[:5]
        raise CheckpointNotFoundError(f"{source.path}: no leaf `{name}`; close paths: {', '.join(close) or 'none'}.")
    item_name, leaf = found[0]
    if leaf.reader is None:
        if index is not None:
            raise ValueError(f"`{item_name}/{leaf.name}` is a value, not an array; drop the index.")
        return f"{item_name}/{leaf.name}", leaf.value
    shape = tuple(leaf.reader.shape)
    index = index if index is not None else ()
    if len(index) > len(shape):
        raise ValueError(f"`show` index {spec!r} has {len(index)} entries for an array of shape {shape}.")
    full: list[Any] = []
    for k, (ix, n) in enumerate(zip(index + (slice(None),) * (len(shape) - len(index)), shape)):
        if isinstance(ix, int):
            if not -n <= ix < n:
                raise ValueError(f"`show` index {ix} is out of range for dimension {k} of size {n} in {spec!r}.")
            full.append(slice(ix % n, ix % n + 1))
        else:
            full.append(slice(*ix.indices(n)) if ix.step in (None, 1) else slice(None))
    # What is read: the region the slice spans (a strided slice reads its whole span), or the whole
    # leaf where the storage streams front to back (a compressed npz member). Held to the memory budget.
    region = shape if leaf.reader.sequential else block_extent(tuple(full), shape)[1]
    nbytes = math.prod(region) * leaf.reader.dtype.itemsize
    budget = resolve_budget(source.memory_budget)
    if nbytes > budget:
        reads = "the whole leaf" if tuple(region) == shape else f"a {list(region)} region"
        raise MemoryBudgetError(
            f"{source.path}: `{item_name}/{leaf.name}`: showing {spec!r} reads {reads}, {human(nbytes, 'B')}, over "
            f"the memory budget of {human(budget, 'B')}; show a smaller slice (e.g. `{leaf.name}"
            f"[{', '.join(['0'] * max(0, len(shape) - 1) + [':4'])}]`), or raise the budget with --memory-budget-mb."
        )
    if leaf.reader.sequential:
        block = np.asarray(leaf.reader.read_all())[tuple(full)]
    else:
        block = np.asarray(leaf.reader.read(tuple(full)))
    # Apply integer indices (drop their axes) and strided slices on the block that was read.
    post = tuple(0 if isinstance(ix, int) else (slice(None) if ix.step in (None, 1) else ix)
                 for ix in index + (slice(None),) * (len(shape) - len(index)))
    return f"{item_name}/{leaf.name}", block[post]
