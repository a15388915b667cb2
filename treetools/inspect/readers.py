"""``open_checkpoint``: one entry point for every checkpoint format.

Every format yields the same thing: per step, item name -> ``Leaf``s, each a
``treetools.table.Row`` (path, shape, dtype, params, bytes, sharding) built
from metadata, plus a block reader for the array data.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from treetools.inspect._base import CheckpointError, Leaf, Snapshot, file_kind

__all__ = ["Source", "open_checkpoint", "select_item"]

DEFAULT_ITEM = "default"
"""Item name of single-tree files (Orbax's name for an unnamed item)."""


@dataclasses.dataclass
class Source:
    """An opened checkpoint: what it is and which steps it has; data is read on demand.

    Attributes:
      path: the path as given.
      format: ``orbax``, ``msgpack``, ``safetensors`` or ``npz``.
      steps: committed steps of a CheckpointManager root, ascending; None for
        a single checkpoint.
      incomplete: folder names of unfinished saves (never read).
    """

    path: str
    format: str
    steps: list[int] | None
    incomplete: list[str]
    _load: Callable[[int | None], Snapshot] = dataclasses.field(repr=False)

    def resolve_step(self, step: int | str | None) -> int | None:
        """``None``/``"latest"`` -> the latest committed step; an int must be a committed step.

        Raises:
          CheckpointError: the step is unknown or incomplete (the message lists the steps).
        """
        if step in (None, "latest"):
            if self.steps is None:
                return None
            if not self.steps:
                raise CheckpointError(
                    f"{self.path}: no committed step (incomplete: {', '.join(self.incomplete) or 'none'})."
                )
            return self.steps[-1]
        if isinstance(step, str):
            try:
                step = int(step)
            except ValueError:
                raise CheckpointError(f"`--step` must be a step number, `latest` or `all`; got {step!r}.") from None
        if self.steps is None:
            raise CheckpointError(
                f"--step {step}: {self.path} is a single checkpoint, not a CheckpointManager root; "
                "drop --step or point at the folder holding the step folders."
            )
        if step not in self.steps:
            from treetools.inspect._scan import step_of

            if any(step_of(n) == step for n in self.incomplete):
                raise CheckpointError(f"{self.path}: step {step} is an incomplete save; it is never read.")
            raise CheckpointError(
                f"{self.path}: no step {step}; available steps: {', '.join(map(str, self.steps)) or 'none'}."
            )
        return step

    def snapshot(self, step: int | str | None = None) -> Snapshot:
        """Metadata of one step (default: the latest); reads no array data."""
        resolved = self.resolve_step(step)
        snap = self._load(resolved)
        if self.steps is not None:
            snap.step = resolved
        return snap


def open_checkpoint(path: str | os.PathLike) -> Source:
    """Open any supported checkpoint read-only, from metadata alone.

    ``path`` may be an Orbax CheckpointManager root (step folders ``N`` or
    ``prefix_N``, any zero padding), one step folder, one item folder, a Flax
    msgpack file, a ``.safetensors`` file or an ``.npz``.

    Raises:
      CheckpointError: the path is missing, not a checkpoint, corrupt or unreadable.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, w=np.ones(3, np.float32))
    >>> src = open_checkpoint(f)
    >>> src.format, src.steps, [l.row.params for l in src.snapshot().items["default"]]
    ('npz', None, [3])
    """
    display = os.fspath(path)
    local = os.path.expanduser(display)
    if not os.path.exists(local):
        if os.path.islink(local):
            raise CheckpointError(f"{display}: {file_kind(local)}; point at the checkpoint itself.")
        raise CheckpointError(f"{display}: no such file or folder.")
    if os.path.isdir(local):
        from treetools.inspect._orbax import open_orbax

        steps, incomplete, load = open_orbax(local)
        return Source(display, "orbax", steps, incomplete, load)
    if not os.path.isfile(local):
        raise CheckpointError(f"{display}: not a regular file ({file_kind(local)}); point at a checkpoint file or folder.")
    from treetools.inspect import _files

    kind = _files.sniff_file(local)
    if kind is None:
        raise CheckpointError(
            f"{display}: not a checkpoint (not an Orbax folder, Flax msgpack, .safetensors or .npz file)."
        )
    read = {"npz": _files.read_npz, "safetensors": _files.read_safetensors, "msgpack": _files.read_msgpack}[kind]
    # Parse the header now, so that a broken file fails at open time.
    leaves = read(local)
    return Source(display, kind, None, [], lambda _step: Snapshot(None, {DEFAULT_ITEM: leaves}))


def select_item(items: dict[str, list[Leaf]], item: str, *, where: str) -> dict[str, list[Leaf]]:
    """``{item: leaves}``: the item of that name, or a top-level key of a single-tree file.

    A single-tree file (a Flax msgpack of a whole train state, an npz) has one
    item; ``item`` then names a top-level key, and its leaves keep the paths
    below that key, as an Orbax item of that name would.

    Raises:
      CheckpointError: no such item or top-level key (the message lists the items).

    >>> from treetools.table import Row
    >>> leaf = Leaf(Row(path="params/w", shape=(2,), dtype="float32", params=2, bytes=8))
    >>> [l.row.path for l in select_item({"default": [leaf]}, "params", where="f")["params"]]
    ['w']
    """
    if item in items:
        return {item: items[item]}
    if len(items) == 1:
        prefix = f"{item}/"
        (leaves,) = items.values()
        below = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.row.path[len(prefix):]))
                 for leaf in leaves if leaf.row.path.startswith(prefix)]
        if below:
            return {item: below}
    keys = sorted({leaf.row.path.split("/", 1)[0] for leaves in items.values() for leaf in leaves})
    tops = f" (top-level keys: {', '.join(keys[:10])}{', ...' if len(keys) > 10 else ''})" if len(items) == 1 else ""
    raise CheckpointError(f"{where}: no item `{item}`; items: {', '.join(items) or 'none'}{tops}.")
