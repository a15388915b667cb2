"""Levanter checkpoints, written as Levanter's ``Checkpointer`` writes them (Levanter does not install here).

Follows stanford-crfm/levanter at commit 9263f81e8b453241332c2c0b2d2001bfb2d2241c:

- ``src/levanter/checkpoint.py``: ``Checkpointer.on_step`` saves step N to ``<base_path>/step-N``
  (``base_path`` is ``checkpoints/<run_id>`` with ``append_run_id_to_base_path``);
  ``save_checkpoint(tree, step, path)`` filters the trainer state to its arrays
  (``TrainerState.saveable_state``: ``step``, ``model``, ``opt_state``, ``training_key``, ``model_averaging``),
  writes every array through ``tree_serialize_leaves_tensorstore`` and, in the commit callback (after every
  array is written), ``metadata.json`` = ``{"step", "timestamp", "is_temporary"}``. A step folder without
  ``metadata.json`` is a save that did not finish (Levanter's ``discover_latest_checkpoint`` skips it).
- ``src/levanter/tensorstore_serialization.py``: each leaf's path is its ``leaf_key_paths`` name
  (``src/levanter/utils/jax_utils.py``: dict keys, sequence indices, namedtuple and equinox field names,
  joined with ``.``) split on ``.`` into folders under the step folder; a haliax ``NamedArray`` is saved as
  its ``.array`` at the NamedArray's own path; the arrays go through jax's
  ``GlobalAsyncCheckpointManager.serialize_with_paths`` (zarr v2, zstd, one folder per array), which this
  writer calls too.

The trainer state here is a dict with the TrainerState's saved fields in their order; its leaf names are what
``leaf_key_paths`` gives the equinox module (plain arrays stand in for NamedArrays: same path, same array).
``step`` is an int32 scalar (``_ensure_int_is_array``), ``training_key`` a raw ``jax.random.PRNGKey``
(uint32[2]).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.array_serialization.serialization import GlobalAsyncCheckpointManager

from tests._writers._tree import flat_with_names


def save_levanter(base_path: Any, step: int, state: dict[str, Any], *, is_temporary: bool = False,
                  finish: bool = True, timestamp: datetime.datetime | None = None) -> str:
    """Save ``state`` as Levanter's Checkpointer saves step ``step``; returns the step folder.

    Args:
      base_path: the run's checkpoint folder (``checkpoints/<run_id>``).
      state: ``{"step": ..., "model": ..., "opt_state": ..., "training_key": ...}``.
      is_temporary: Levanter's time-based (temporary) save.
      finish: False leaves the save as a preempted one leaves it: arrays written, no ``metadata.json``.
      timestamp: the ``metadata.json`` timestamp (default: now).
    """
    path = os.path.join(os.fspath(base_path), f"step-{step}")
    os.makedirs(path, exist_ok=True)
    leaves = flat_with_names(state, sep=".")
    paths = [os.path.join(path, *name.split(".")) for name in leaves]
    arrays = [jnp.asarray(x) for x in leaves.values()]

    def commit():  # Levanter's my_callback -> _save_metadata
        if not finish:
            return
        when = timestamp or datetime.datetime.now()
        with open(os.path.join(path, "metadata.json"), "w") as out:
            json.dump({"step": int(step), "timestamp": when.isoformat(), "is_temporary": is_temporary}, out)

    manager = GlobalAsyncCheckpointManager()
    manager.serialize_with_paths(arrays, paths, on_commit_callback=commit)
    manager.wait_until_finished()
    return path


def trainer_state(step: int, model: dict[str, Any], opt_state: Any, seed: int = 0) -> dict[str, Any]:
    """The saved fields of a Levanter ``TrainerState`` (``model_averaging`` None: not saved)."""
    return {"step": jnp.asarray(step, jnp.int32), "model": model, "opt_state": opt_state,
            "training_key": jax.random.PRNGKey(seed)}


def save_export(path: Any, tree: dict[str, Any]) -> str:
    """``tree_serialize_leaves_tensorstore(path, tree)`` alone (Levanter's export of a model or state outside the
    Checkpointer): the arrays at their ``leaf_key_paths`` names split into folders, no ``metadata.json``."""
    path = os.fspath(path)
    leaves = flat_with_names(tree, sep=".")
    manager = GlobalAsyncCheckpointManager()
    manager.serialize_with_paths([jnp.asarray(x) for x in leaves.values()],
                                 [os.path.join(path, *name.split(".")) for name in leaves])
    manager.wait_until_finished()
    return path
