"""Orbax output, through Orbax's own writer: a ``StandardCheckpointer`` save, or one step of a manager root.

Orbax saves a tree it holds in host memory, so the tree is assembled whole
(block by block, each leaf into its own array) and handed to Orbax; the
command refuses an item over the memory budget before reading anything.

Two layouts:

* ``step=None``: ``dst`` is what ``ocp.StandardCheckpointer().save(dst, tree)``
  writes, which ``StandardCheckpointer().restore(dst)`` and ``treetools
  inspect dst`` read (the item ``default``). Written under a hidden
  temporary name beside ``dst`` and renamed onto it at the end.
* ``step=N``: ``dst`` is a ``CheckpointManager`` root and step ``N`` holds the
  tree as the item ``item`` (``params``): ``CheckpointManager(dst).restore(N)``,
  ``tt.restore_checkpoint(dst, N, ...)`` and ``treetools inspect dst`` read it.
  The manager's own atomic save (a ``.orbax-checkpoint-tmp`` folder renamed
  and committed) makes the step appear whole.

Importing this module imports neither jax nor Orbax: ``write_orbax`` does.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np

from treetools.ckpt.storage import backend
from treetools.ckpt.storage.local import LocalStorage, swap_in, tmp_name
from treetools.shared.errors import CheckpointError


def nest(leaves: Sequence[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """A nested dict from ``(path parts, value)`` pairs; a path that is both a leaf and a folder is an error.

    >>> nest([(("a", "w"), 1), (("b",), 2)])
    {'a': {'w': 1}, 'b': 2}
    """
    tree: dict[str, Any] = {}
    for parts, value in leaves:
        node = tree
        for i, key in enumerate(parts[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise CheckpointError(f"`{'/'.join(parts[:i + 1])}` is a leaf and also holds `{'/'.join(parts)}`; "
                                      "rename one of them.")
            node = child
        if parts[-1] in node:
            raise CheckpointError(f"`{'/'.join(parts)}` is given twice, or is also a folder of other leaves; "
                                  "rename one of them.")
        node[parts[-1]] = value
    return tree


def check_orbax(leaves: Sequence[tuple[tuple[str, ...], Any]]) -> None:
    """What Orbax refuses to save, found before anything is read: zero-size arrays, empty path parts.

    Raises:
      CheckpointError: one line naming the leaf and the fix.
    """
    for parts, reader in leaves:
        name = "/".join(parts)
        if not all(parts):
            raise CheckpointError(f"`{name}` has an empty path component, which Orbax cannot save; rename it.")
        if 0 in tuple(reader.shape):
            raise CheckpointError(f"`{name}` has shape {tuple(reader.shape)}: Orbax cannot save zero-size arrays; "
                                  f"drop it (--drop '^{name}$') or write safetensors.")


def write_orbax(
    dst: str,
    leaves: Sequence[tuple[tuple[str, ...], Any]],
    *,
    step: int | None = None,
    item: str = "params",
    overwrite: bool = False,
    read_leaf: Callable[[Any], np.ndarray],
) -> None:
    """Save ``leaves`` with Orbax's own writer (see the module docstring); atomic.

    Args:
      dst: a local folder: the checkpoint (``step`` None), or a manager root.
      leaves: ``(path parts, reader)`` per leaf; the tree nests on the parts.
      step: write step ``step`` of a manager root ``dst`` instead.
      item: the manager item's name (with ``step``).
      overwrite: replace an existing ``dst`` (or step).
      read_leaf: ``reader -> numpy array``, the whole leaf (the caller reads it block by block).

    Raises:
      CheckpointError: ``dst`` (or the step) exists without ``overwrite``; a bucket ``dst``.
    """
    if backend(dst).remote:
        raise CheckpointError(f"{dst}: --to orbax writes local folders; write it locally and upload the folder, "
                              "or convert to safetensors, which streams to buckets.")
    check_orbax(leaves)
    dst = os.path.abspath(dst)
    if step is None:
        if os.path.lexists(dst) and not overwrite:
            raise CheckpointError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it.")
    elif os.path.lexists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"{dst} is not a folder; a manager root (--dst-step) is a folder of step folders.")
    tree = nest([(parts, read_leaf(reader)) for parts, reader in leaves])
    # Orbax (and jax under it) only here: everything else treetools converts stays jax-free.
    import orbax.checkpoint as ocp

    if step is None:
        tmp = tmp_name(dst, "tmp")
        local = LocalStorage()
        try:
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(tmp, tree)
            checkpointer.wait_until_finished()
            checkpointer.close()
            swap_in(tmp, dst)
        except BaseException:
            local.remove(tmp)
            for name in os.listdir(os.path.dirname(tmp)):  # Orbax's own tmp folder beside ours
                if name.startswith(os.path.basename(tmp)):
                    local.remove(os.path.join(os.path.dirname(tmp), name))
            raise
        return
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(dst, options=options) as manager:
        if step in manager.all_steps():
            if not overwrite:
                raise CheckpointError(f"{dst} already has step {step}; pass --overwrite (overwrite=True) to "
                                      "replace it, or choose another step.")
            manager.delete(step)
        manager.save(step, args=ocp.args.Composite(**{item: ocp.args.StandardSave(tree)}))
        manager.wait_until_finished()
