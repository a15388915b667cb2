"""big_vision's TensorStore checkpoints, written as big_vision writes them (big_vision is not on the package index).

Follows google-research/big_vision at commit 11eea5740d595c2104da948849e087a27e92926f, ``big_vision/utils.py``:

- ``tssave(mngr, pytree, path)``: every leaf's name from ``tree_flatten_with_names`` (key paths joined with
  ``/``), ``/`` replaced by ``~``, each array written by jax's ``GlobalAsyncCheckpointManager.serialize_with_paths``
  to ``<path>/<name>`` (one zarr array per leaf, no other file);
- ``save_checkpoint_ts(mngr, checkpoint, path, step, keep)``: writes ``<path>-<step:09d>`` (``-tmp`` appended when
  the step is not kept), then in the commit callback writes the step part to ``<path>-CUR`` and renames it to
  ``<path>-LAST``, and deletes the previous ``-tmp`` step;
- ``load_checkpoint_ts(path)`` reads ``<path>-LAST`` to find the latest.

The array writes are jax's own; the callback's file operations are plain ``os`` calls for ``gfile``'s.
"""

from __future__ import annotations

import os
import shutil
from typing import Any


import jax.numpy as jnp
from jax.experimental.array_serialization.serialization import GlobalAsyncCheckpointManager

from tests._writers._tree import flat_with_names


def tssave(path: str, pytree: Any, on_commit=lambda **_: None) -> None:
    names, vals = zip(*flat_with_names(pytree, sep="/").items())
    os.makedirs(path, exist_ok=True)
    names = [name.replace("/", "~") for name in names]
    mngr = GlobalAsyncCheckpointManager()
    mngr.serialize_with_paths([jnp.asarray(v) for v in vals], [os.path.join(path, n) for n in names],
                              on_commit_callback=lambda: on_commit(array_names=names))
    mngr.wait_until_finished()


def save_checkpoint_ts(path: Any, checkpoint: Any, step: int, keep: bool = True) -> str:
    """big_vision's preemption-safe save; returns the step folder."""
    path = os.fspath(path)
    curr = f"{step:09d}{'-tmp' if not keep else ''}"

    def on_commit(array_names):
        with open(f"{path}-CUR", "w") as f:
            f.write(curr)
        last = ""
        if os.path.exists(f"{path}-LAST"):
            with open(f"{path}-LAST") as f:
                last = f.read().strip()
        os.replace(f"{path}-CUR", f"{path}-LAST")
        if last.endswith("-tmp"):
            shutil.rmtree(f"{path}-{last}")

    tssave(f"{path}-{curr}", checkpoint, on_commit)
    return f"{path}-{curr}"



