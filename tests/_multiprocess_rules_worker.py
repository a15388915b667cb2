"""One process of the two-process restore-with-rules test (run by tests/test_rules_restore.py).

Usage: python _multiprocess_rules_worker.py PROCESS_ID PORT SAFETENSORS_FILE

Both processes restore the same safetensors file (a stacked leaf ``layers/w``
and ``embed``) through rules (unstack, rename, transpose, bfloat16) onto a
2x2 mesh over the devices of both processes, each reading only the blocks its
devices hold; each checks its local shards against numpy and prints one JSON
line with every gathered leaf's digest and sharding spec.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

LAYERS, D_IN, D_OUT = 4, 8, 16


def rules():
    import treetools as tt

    return tt.Rules(drop=["^step$"], unstack=[r"^layers/"], rename=[(r"^layers/(\d+)/w$", r"blocks/\1/kernel")],
                    transpose=[(r"kernel$", (1, 0))], dtype="bfloat16")


def target(mesh):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    split = NamedSharding(mesh, P("data", "model"))
    return {"embed": jax.ShapeDtypeStruct((16, D_IN), jnp.bfloat16, sharding=NamedSharding(mesh, P("model"))),
            "blocks": [{"kernel": jax.ShapeDtypeStruct((D_OUT, D_IN), jnp.bfloat16, sharding=split)}
                       for _ in range(LAYERS)]}


def truth(stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import jax.numpy as jnp

    out = {"embed": stored["embed"].astype(jnp.bfloat16)}
    for i in range(LAYERS):
        out[f"blocks/{i}/kernel"] = stored["layers/w"][i].T.astype(jnp.bfloat16)
    return out


def restore(path: str, mesh) -> tuple[dict, bool]:
    """Restore through the rules; ``(leaf path -> digest, spec, values), local shards ok)``."""
    from jax.experimental import multihost_utils
    from safetensors.numpy import load_file

    import treetools as tt

    out = tt.flatten(tt.restore_checkpoint(path, None, {"default": target(mesh)}, rules=rules())["default"])
    want = truth(load_file(path))
    leaves, local_ok = {}, True
    for name, arr in out.items():
        for shard in arr.addressable_shards:
            local_ok &= bool(np.array_equal(np.asarray(shard.data), want[name][shard.index]))
        gathered = np.asarray(multihost_utils.process_allgather(arr, tiled=True)) if arr.is_fully_addressable is False \
            else np.asarray(arr)
        data = np.ascontiguousarray(gathered)
        leaves[name] = {"sha256": hashlib.sha256(data.tobytes()).hexdigest(), "dtype": data.dtype.name,
                        "shape": list(data.shape), "spec": str(arr.sharding.spec),
                        "equal": bool(np.array_equal(data, want[name]))}
    return leaves, local_ok


def main(process_id: int, port: int, path: str) -> None:
    import jax

    from _multiprocess import init_distributed  # run as a script: tests/ is on sys.path

    init_distributed(process_id, port)
    mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "model"))
    leaves, local_ok = restore(path, mesh)
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(), "local_shards_ok": local_ok,
                      "leaves": leaves}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
