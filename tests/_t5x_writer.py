"""Test writers of T5X checkpoints and of Orbax (< 0.5) item folders, following what those libraries write.

``save_t5x`` follows ``t5x.checkpoints.Checkpointer.save`` (see
/work/shared/reference/t5x_checkpoints.py.txt), step by step:

1. each leaf's name is its state-dict key path joined with ``/``; a
   partitioned leaf gets the TensorStore spec ``{"driver": "zarr", "dtype":
   <dtype name>, "kvstore": {"driver": "file", "path": name.replace("/", ".")},
   "metadata": {"compressor": {"id": "gzip"}, "shape": ..., "chunks": ...}}``
   with T5X's chunk rule (divisors of the largest dimension first, down to a
   target element count);
2. the save goes to ``checkpoint_<step>.tmp-<timestamp>``: each partitioned
   array is written through TensorStore at that folder + the relative path
   (``target`` cast to ``save_dtype`` through a ``cast`` spec), unpartitioned
   leaves stay in the state dict (``target`` ones cast to ``save_dtype``);
3. ``checkpoint`` = ``flax.serialization.to_bytes({"version": 3, "optimizer":
   written})``, each written leaf replaced by its spec's JSON (relative path);
4. the tmp folder is renamed ``checkpoint_<step>``.

``save_orbax_legacy_item`` writes what Orbax's ``PyTreeCheckpointHandler``
wrote before ``_METADATA`` existed: one zarr folder per array, named by the
key path joined with ``.``, and an item-level ``checkpoint`` msgpack whose
leaves are ``"PLACEHOLDER://<name>"`` or, for aggregated leaves, the value.

Nothing here imports T5X or an old Orbax: the files are written with
TensorStore and flax, as those libraries do.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import numpy as np
import tensorstore as ts
from flax import serialization, traverse_util

VERSION = 3
CHUNK_BYTES = 64 * 2**20  # T5X's _DESIRED_CHUNK_SIZE_BYTES

# T5X (through orbax.checkpoint.utils.register_ts_spec_for_serialization) stores a ts.Spec as its
# to_json() dict, as is: lists stay msgpack arrays (a plain dict in the tree would have them turned
# into {"0": ..} maps by flax's to_state_dict).
serialization.register_serialization_state(
    ts.Spec, ty_to_state_dict=lambda spec: spec.to_json(),
    ty_from_state_dict=lambda spec, state: ts.Spec(state) if isinstance(state, dict) else state, override=True)


def chunk_shape(shape: tuple[int, ...], target_elements: int) -> list[int]:
    """T5X's chunk rule: keep dividing the largest dimension by its next smaller divisor until the chunk fits."""
    divisors = [[d for d in range(1, n + 1) if n % d == 0] for n in shape]
    while int(np.prod([f[-1] for f in divisors])) > target_elements:
        largest = max(range(len(shape)), key=lambda i: divisors[i][-1])
        divisors[largest].pop()
    return [f[-1] for f in divisors]


def _spec(name: str, arr: np.ndarray, target_elements: int | None) -> dict[str, Any]:
    target = target_elements or max(1, CHUNK_BYTES // arr.dtype.itemsize)
    return {
        "driver": "zarr",
        "dtype": arr.dtype.name,
        "kvstore": {"driver": "file", "path": name.replace("/", ".")},
        "metadata": {"compressor": {"id": "gzip"}, "shape": arr.shape, "chunks": np.array(chunk_shape(arr.shape, target))},
    }


def save_t5x(model_dir: Any, step: int, state: dict[str, Any], *, inline: Iterable[str] = ("state/step",),
             save_dtype: Any = None, target_elements: int | None = None, timestamp: int = 1700000000,
             finish: bool = True) -> str:
    """Save ``state`` (``{"target": params, "state": {"step": ..., "param_states": ...}}``) as T5X does.

    Args:
      inline: ``/``-joined key paths of the unpartitioned leaves (kept in the msgpack).
      save_dtype: T5X's ``save_dtype``: ``target`` arrays are stored in it.
      target_elements: the chunk target (T5X: 64 MiB of elements); small values give many chunks.
      finish: False leaves the save as T5X leaves an interrupted one (tmp folder, no rename).

    Returns:
      The step folder (or the tmp folder when ``finish`` is False).
    """
    inline = set(inline)
    final_dir = os.path.join(os.fspath(model_dir), f"checkpoint_{step}")
    tmp_dir = f"{final_dir}.tmp-{timestamp}"
    os.makedirs(tmp_dir)
    written = {}
    for keys, arr in traverse_util.flatten_dict(state).items():
        name = "/".join(keys)
        cast = keys[0] == "target" and save_dtype is not None
        if name in inline or arr is None:
            written[keys] = np.asarray(arr).astype(save_dtype) if cast else arr
            continue
        arr = np.asarray(arr)
        spec = _spec(name, arr, target_elements)
        if cast:
            spec["dtype"] = np.dtype(save_dtype).name
        spec_json = ts.Spec(spec).to_json()  # what T5X keeps (and puts in the msgpack): the path stays relative
        absolute = json.loads(json.dumps(spec_json))
        absolute["kvstore"]["path"] = os.path.join(tmp_dir, absolute["kvstore"]["path"])
        if cast:
            absolute = {"base": absolute, "driver": "cast", "dtype": arr.dtype.name}
        store = ts.open(absolute, create=True, open=True).result()
        store[...].write(arr).result()
        written[keys] = ts.Spec(spec_json)
    with open(os.path.join(tmp_dir, "checkpoint"), "wb") as f:
        f.write(serialization.to_bytes({"version": VERSION, "optimizer": traverse_util.unflatten_dict(written)}))
    if not finish:
        return tmp_dir
    os.rename(tmp_dir, final_dir)
    return final_dir


def save_orbax_legacy_item(item_dir: Any, tree: dict[str, Any], *, aggregate: Iterable[str] = (),
                           sharding_file: bool = False) -> str:
    """One item as Orbax's PyTreeCheckpointHandler wrote it before 0.5 (no ``_METADATA``).

    Args:
      aggregate: ``.``-joined names of leaves stored in the msgpack itself.
      sharding_file: also write the ``_sharding`` file later pre-0.5 versions wrote.
    """
    item_dir = os.fspath(item_dir)
    os.makedirs(item_dir)
    aggregate = set(aggregate)
    stored = {}
    for keys, value in traverse_util.flatten_dict(tree).items():
        name = ".".join(keys)
        if name in aggregate:
            stored[keys] = value
            continue
        arr = np.asarray(value)
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(item_dir, name)},
                "metadata": {"shape": arr.shape, "chunks": arr.shape or (), "compressor": {"id": "zstd"},
                             "dtype": arr.dtype.str if arr.dtype.kind != "V" else arr.dtype.name}}
        ts.open(spec, create=True, open=True).result()[...].write(arr).result()
        stored[keys] = "PLACEHOLDER://" + name
    with open(os.path.join(item_dir, "checkpoint"), "wb") as f:
        f.write(serialization.msgpack_serialize(traverse_util.unflatten_dict(stored)))
    if sharding_file:
        with open(os.path.join(item_dir, "_sharding"), "w") as f:
            f.write("{}")
    return item_dir


def save_orbax_legacy_step(root: Any, step: int, items: dict[str, dict[str, Any]], *, prefix: str | None = None,
                           timestamp: int = 1700000000, **kwargs: Any) -> str:
    """A CheckpointManager step of pre-0.5 Orbax: items saved into ``<step>.orbax-checkpoint-tmp-<ts>``, then renamed."""
    name = f"{prefix}_{step}" if prefix else str(step)
    final_dir = os.path.join(os.fspath(root), name)
    tmp_dir = f"{final_dir}.orbax-checkpoint-tmp-{timestamp}"
    for item, tree in items.items():
        save_orbax_legacy_item(os.path.join(tmp_dir, item), tree, **kwargs)
    os.rename(tmp_dir, final_dir)
    return final_dir
