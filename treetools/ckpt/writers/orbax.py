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
  A manager of its own saves the step (committed, as Orbax commits it) in a
  hidden folder of the root, and the finished step is renamed into place: an
  old step ``N`` is replaced only then, never deleted first.

Importing this module imports neither jax nor Orbax: ``write_orbax`` does.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np

from treetools.ckpt.storage import backend
from treetools.shared.files import remove, swap_in, tmp_name
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


MAX_DEPTH = 256
"""The deepest tree ``--to orbax`` writes (Orbax recurses once a level and failed with a ``SystemError`` near 1,000)."""


def check_orbax(leaves: Sequence[tuple[tuple[str, ...], Any]]) -> None:
    """What Orbax refuses to save, found before anything is read: zero-size arrays, empty path parts, trees nested
    deeper than ``MAX_DEPTH``.

    Raises:
      CheckpointError: one line naming the leaf and the fix.
    """
    for parts, reader in leaves:
        name = "/".join(parts)
        if len(parts) > MAX_DEPTH:
            raise CheckpointError(f"`{name[:80]}...` is nested {len(parts):,} levels deep: Orbax (and jax's tree "
                                  f"functions under it) recurse once a level, and at most {MAX_DEPTH} are written; "
                                  "rename it (--rename) or write safetensors, whose names are flat.")
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

    Either way the checkpoint (or step) is written whole under a hidden
    temporary name first and only then put at its place: ``overwrite``
    replaces what is there once the new one is complete (``swap_in``), and
    without it the final rename refuses anything that appeared there meanwhile.
    A failure or an interrupt leaves the old checkpoint (or step) whole, and
    no temporary behind.

    Args:
      dst: a local folder: the checkpoint (``step`` None), or a manager root.
      leaves: ``(path parts, reader)`` per leaf; the tree nests on the parts.
      step: write step ``step`` of a manager root ``dst`` instead.
      item: the manager item's name (with ``step``).
      overwrite: replace an existing ``dst`` (or step).
      read_leaf: ``reader -> numpy array``, the whole leaf (the caller reads it block by block).

    Raises:
      CheckpointError: ``dst`` (or the step) exists without ``overwrite``, or appeared while it was written; no
        array to write; a bucket ``dst``.
    """
    if backend(dst).remote:
        raise CheckpointError(f"{dst}: --to orbax writes local folders; write it locally and upload the folder, "
                              "or convert to safetensors, which streams to buckets.")
    check_orbax(leaves)
    dst = os.path.abspath(dst)
    final = dst if step is None else os.path.join(dst, str(step))
    if step is not None and os.path.lexists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"{dst} is not a folder; a manager root (--dst-step) is a folder of step folders.")
    if os.path.lexists(final) and not overwrite:  # a dangling symlink is something there too
        if step is None:
            raise CheckpointError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it.")
        raise CheckpointError(f"{dst} already has step {step}; pass --overwrite (overwrite=True) to replace it, or "
                              "choose another step.")
    if not leaves:  # Orbax refuses an empty item ("Found empty item") after making its folders
        raise CheckpointError(f"{dst}: no array to write (the item holds none, or the rules dropped them all); "
                              "nothing was written.")
    tree = nest([(parts, read_leaf(reader)) for parts, reader in leaves])
    # Orbax (and jax under it) only here: everything else treetools converts stays jax-free.
    import orbax.checkpoint as ocp

    made_root = step is not None and not os.path.lexists(dst)
    if made_root:
        os.makedirs(dst)
    tmp = tmp_name(final, "tmp")
    try:
        if step is None:
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(tmp, tree)
            checkpointer.wait_until_finished()
            checkpointer.close()
            written = tmp
        else:  # a manager of its own in a hidden folder of the root: the step is moved out once committed
            options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
            with ocp.CheckpointManager(tmp, options=options) as manager:
                manager.save(step, args=ocp.args.Composite(**{item: ocp.args.StandardSave(tree)}))
                manager.wait_until_finished()
            written = os.path.join(tmp, str(step))
        try:
            swap_in(written, final, overwrite=overwrite)
        except FileExistsError:
            raise CheckpointError(f"{final} appeared while it was being written and was left as it is; pass "
                                  "--overwrite (overwrite=True) to replace it.") from None
    except BaseException:
        if made_root:
            remove(dst)
        raise
    finally:
        remove(tmp)
        folder = os.path.dirname(tmp)
        if os.path.isdir(folder):
            for name in os.listdir(folder):  # Orbax's own tmp folder beside ours (StandardCheckpointer)
                if name.startswith(os.path.basename(tmp)):
                    remove(os.path.join(folder, name))
