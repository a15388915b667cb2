"""EasyLM's streaming checkpoints, written as EasyLM's ``StreamingCheckpointer`` writes them (EasyLM is not on
the package index).

Follows young-geng/EasyLM at commit 07f10e5cee55ce6cfae765fddf3ea4e4573c766f, ``EasyLM/checkpoint.py``:

- ``StreamingCheckpointer.save_checkpoint(train_state, filename)``: ``flatten_dict(to_state_dict(train_state))``
  (flax's, tuple keys), then one record per leaf, ``msgpack.Packer().pack((key, flax.serialization.to_bytes(
  value)))``, written one after the other into the file (no extension);
- ``save_all``: the whole train state as ``streaming_train_state[_<step>]`` with ``save_optimizer_state``, else
  ``train_state.params`` as ``streaming_params[_<step>]`` (``_<step>`` for milestones).

The msgpack and flax calls are the real ones; only the file handling (``mlxu.open_file``) is plain ``open``.
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
from flax.serialization import to_bytes, to_state_dict
from flax.traverse_util import flatten_dict


def save_checkpoint(path: Any, train_state: Any) -> str:
    """``StreamingCheckpointer.save_checkpoint``: the flattened state dict, one msgpack record per leaf."""
    path = os.fspath(path)
    packer = msgpack.Packer()
    with open(path, "wb") as fout:
        for key, value in flatten_dict(to_state_dict(train_state)).items():
            fout.write(packer.pack((key, to_bytes(value))))
    return path


def save_all(checkpoint_dir: Any, train_state: Any, *, save_optimizer_state: bool, step: int | None = None) -> str:
    """``StreamingCheckpointer.save_all`` (``milestone`` when ``step`` is given); returns the file written."""
    name = "streaming_train_state" if save_optimizer_state else "streaming_params"
    state = train_state if save_optimizer_state else train_state["params"]
    filename = f"{name}_{step}" if step is not None else name
    return save_checkpoint(os.path.join(os.fspath(checkpoint_dir), filename), state)
