"""One process of the two-process checkpoint test (run by tests/test_checkpoint_multiprocess.py).

Usage: python _multiprocess_ckpt_worker.py PROCESS_ID PORT CHECKPOINT_DIR

A ``gs://`` or ``s3://`` CHECKPOINT_DIR (the first run's checkpoint, uploaded)
is only restored: each process reads its own shards from the bucket.

The caller sets XLA_FLAGS (CPU devices per process) and JAX_PLATFORMS=cpu.
Every process builds the same global arrays from a fixed seed, places only
its own shards (``jax.make_array_from_callback``) on a mesh over the devices
of both processes, saves them with treetools' manager, restores them in the
same run onto a different sharding, checks its local shards against the
numpy data, and prints one JSON line with a digest of every gathered leaf.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

SAVE_AXES = ("fsdp",)
RESTORE_AXES = ("data", "model")
# name -> (shape, save spec on the 1-D mesh, restore spec on the 2x2 mesh)
LEAVES = {
    "w": ((8, 12), ("fsdp", None), (None, ("data", "model"))),
    "embed": ((4, 8), (None, "fsdp"), ("data", "model")),  # stored in an nn.Partitioned box
    "b": ((12,), (None,), ("model",)),
}
BOXED = ("embed",)
STEP = 3


def global_arrays() -> dict[str, np.ndarray]:
    """The same float32 arrays in every process (and in the test)."""
    rng = np.random.default_rng(7)
    return {name: rng.normal(size=shape).astype(np.float32) for name, (shape, _, _) in LEAVES.items()}


def digest(x: np.ndarray) -> dict:
    """What the processes compare: exact bytes, a float64 sum, the shape and dtype."""
    x = np.ascontiguousarray(x)
    return {
        "sha256": hashlib.sha256(x.tobytes()).hexdigest(),
        "sum": float(x.astype(np.float64).sum()),
        "shape": list(x.shape),
        "dtype": x.dtype.name,
    }


def main(process_id: int, port: int, ckpt_dir: str) -> None:
    import jax

    from _multiprocess import init_distributed  # run as a script: tests/ is on sys.path

    init_distributed(process_id, port)
    import flax.linen as nn
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from treetools.pytree.abstract import make_abstract
    from treetools import get_checkpoint_manager, list_steps, restore_checkpoint, save_checkpoint
    from treetools.pytree.partitioning import unbox

    host = global_arrays()
    n = jax.device_count()
    save_mesh = jax.make_mesh((n,), SAVE_AXES)
    restore_mesh = jax.make_mesh((2, n // 2), RESTORE_AXES)

    def place(name: str, spec: tuple) -> jax.Array:
        sharding = NamedSharding(save_mesh, P(*spec))
        return jax.make_array_from_callback(host[name].shape, sharding, lambda idx: host[name][idx])

    params = {}
    for name, (_, save_spec, _) in LEAVES.items():
        arr = place(name, save_spec)
        params[name] = nn.Partitioned(arr, names=save_spec) if name in BOXED else arr
    # Each process holds only part of every sharded array.
    assert not params["w"].is_fully_addressable

    remote = ckpt_dir.startswith(("gs://", "s3://"))
    if remote:
        manager = ckpt_dir  # restore_checkpoint takes a path; Orbax's manager does not reach a bucket's emulator
    else:
        manager = get_checkpoint_manager(1, checkpoint_dir=ckpt_dir)
        save_checkpoint(manager, STEP, {"params": params, "data_iter": {"epoch": 1, "seen": [STEP]}}, wait=True)

    restore_shardings = {name: NamedSharding(restore_mesh, P(*spec)) for name, (_, _, spec) in LEAVES.items()}
    target = make_abstract(params, restore_shardings)
    out = restore_checkpoint(manager, "latest", {"params": target, "data_iter": None})

    leaves, local_ok = {}, True
    for name, (_, _, spec) in LEAVES.items():
        leaf = out["params"][name]
        boxed = isinstance(leaf, nn.Partitioned)
        arr = unbox(leaf)
        # Local shards first: each process checks its own pieces against numpy.
        for shard in arr.addressable_shards:
            local_ok &= bool(np.array_equal(np.asarray(shard.data), host[name][shard.index]))
        gathered = np.asarray(multihost_utils.process_allgather(arr, tiled=True))
        leaves[name] = dict(digest(gathered), spec=str(arr.sharding.spec), boxed=boxed, values=gathered.tolist())
    if not remote:
        manager.close()
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "devices": jax.device_count(),
                "local_devices": jax.local_device_count(),
                "steps": list_steps(ckpt_dir),
                "data_iter": out["data_iter"],
                "local_shards_ok": local_ok,
                "leaves": leaves,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
