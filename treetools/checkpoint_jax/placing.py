"""Stored arrays placed straight into their targets' shardings: each device's block read once, by the block engine.

``place_arrays`` is how ``restore_checkpoint`` (and ``load_parameters`` with
a target) reads array data, for every format and whether or not rules apply:
every distinct block the addressable devices hold (a replicated block once)
is one region of ``treetools.checkpoint_io.stream.read_regions``, read on the
engine's worker threads with read-ahead, in blocks of the read context's
``block_bytes``, and put on its device(s) as it comes. The
host holds the regions in flight only, at most the context's memory budget;
a process reads only what its own devices hold.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.readers import ArrayReader, Index
from treetools.checkpoint_io.stream import read_regions


def is_key(x: Any) -> bool:
    """A typed PRNG key target (stored as its key data)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and "key<" in str(dtype)


def key_impl(target: Any) -> Any:
    """The PRNG implementation of a typed key target (live or abstract)."""
    import jax  # a typed key target: jax is loaded already

    return jax.random.key_impl(target) if isinstance(target, jax.Array) else target.dtype._impl


def _index_key(index: Index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def place_arrays(readers: Mapping[str, ArrayReader], targets: Mapping[str, Any], context: ReadContext, *,
                 label: str = "") -> dict[str, Any]:
    """``{path: jax.Array}``: each reader's array on its target's sharding and dtype, read by the block engine.

    Args:
      readers: the stored (or ruled) reader of each target path.
      targets: path -> a ``jax.ShapeDtypeStruct`` (or array) with a sharding; a typed PRNG key target gets the
        key wrapped from its stored key data.
      context: how to read (``block_bytes``, ``workers``, ``memory_budget``).
      label: put before a path in errors (the item, ``params/``).

    Raises:
      MemoryBudgetError: before any read, one device's block over the memory budget.
    """
    import jax  # placing arrays is the jax side

    regions: list[tuple[ArrayReader, Index]] = []
    owners: list[tuple[str, list[Any]]] = []
    for path, x in targets.items():
        shape = tuple(x.shape)
        if is_key(x):  # stored as key data: read whole, wrapped, then placed
            regions.append((readers[path], tuple(slice(None) for _ in readers[path].shape)))
            owners.append((path, []))
            continue
        groups: dict[tuple, tuple[Index, list[Any]]] = {}
        for device, index in x.sharding.addressable_devices_indices_map(shape).items():
            groups.setdefault(_index_key(index), (tuple(index), []))[1].append(device)
        for index, devices in groups.values():
            regions.append((readers[path], index))
            owners.append((path, devices))

    def put(i: int, block: np.ndarray) -> list[Any]:
        """One region on every device that holds it, each from the host block (as Orbax places a replicated block;
        a copy from the first device measured slower on CPU devices)."""
        path, devices = owners[i]
        if not devices:
            return [block]
        block = np.asarray(block).astype(np.dtype(targets[path].dtype), copy=False)
        return [jax.device_put(block, d) for d in devices]

    placed: dict[str, list[Any]] = {path: [] for path in targets}
    for i, arrays in read_regions(regions, put, block_bytes=context.block_bytes, budget=context.memory_budget,
                                  workers=context.workers, names=[f"{label}{path}" for path, _ in owners]):
        placed[owners[i][0]].extend(arrays)
    out = {}
    for path, x in targets.items():
        if is_key(x):
            out[path] = jax.device_put(jax.random.wrap_key_data(jax.numpy.asarray(placed[path][0]), impl=key_impl(x)),
                                       x.sharding)
            continue
        out[path] = jax.make_array_from_single_device_arrays(tuple(x.shape), x.sharding, placed[path])
    return out
