"""One process of the two-process norm test (run by tests/test_norms_multiprocess.py).

Usage: python _multiprocess_norm_worker.py PROCESS_ID PORT METRICS_JSONL

The caller sets XLA_FLAGS (CPU devices per process) and JAX_PLATFORMS=cpu in
the environment. Every process builds the same global arrays from a fixed
seed, places its own shards with ``jax.make_array_from_callback`` on a mesh of
all devices of both processes, computes the sharded global norm under jit
(GSPMD) and inside shard_map (flax boxes), logs the metrics through ``MetricsLogger`` + ``JsonlWriter``
(only process 0 writes the shared file), and prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import numpy as np

MESH_AXES = ("data", "fsdp")
# name -> (shape, spec entries): fsdp-sharded, tp-like, fully sharded, replicated.
LEAVES = {
    "w_fsdp": ((6, 16), (None, "fsdp")),
    "w_data": ((8, 5), ("data", None)),
    "w_full": ((4, 8), ("data", "fsdp")),
    "w_flat": ((24, 3), (("data", "fsdp"), None)),
    "rep": ((7,), (None,)),
}


def global_arrays() -> dict[str, np.ndarray]:
    """The same float32 arrays in every process (and in the test)."""
    rng = np.random.default_rng(1234)
    return {name: rng.normal(size=shape).astype(np.float32) for name, (shape, _) in LEAVES.items()}


def main(process_id: int, port: int, metrics_path: str) -> None:
    import jax

    from _multiprocess import init_distributed  # run as a script: tests/ is on sys.path

    init_distributed(process_id, port)
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec as P

    from treetools.pytree.metrics import JsonlWriter, MetricsLogger
    from treetools.pytree.norms import get_sharded_global_norm, norm_metrics

    n = jax.device_count()
    mesh = jax.make_mesh((2, n // 2), MESH_AXES)
    host = global_arrays()
    arrays = {
        name: jax.make_array_from_callback(
            host[name].shape, NamedSharding(mesh, P(*spec)), lambda idx, a=host[name]: a[idx]
        )
        for name, (_, spec) in LEAVES.items()
    }
    g_jit, per_leaf = jax.jit(get_sharded_global_norm)(arrays)  # Explicit axes: one psum per axis set
    g_eager = get_sharded_global_norm(arrays)[0]  # concrete NamedShardings: the same path, eagerly
    auto_mesh = jax.make_mesh((2, n // 2), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    auto = {k: jax.device_put(v, NamedSharding(auto_mesh, v.sharding.spec)) for k, v in arrays.items()}
    g_auto = jax.jit(get_sharded_global_norm)(auto)[0]  # Auto axes: the compiler places the collectives

    boxes = {name: nn.Partitioned(arrays[name], names=spec) for name, (_, spec) in LEAVES.items()}
    specs = nn.get_partition_spec(boxes)

    def inside(tree):
        return norm_metrics(grads=tree, params=tree, per_param=True)

    metrics = jax.jit(jax.shard_map(inside, mesh=mesh, in_specs=(specs,), out_specs=P()))(boxes)
    # The rest of the library on the same global arrays: counts, abstract trees, replicate.
    import treetools as tt

    replicated = tt.replicate(host, NamedSharding(mesh, P()))
    rep_sums = {k: float(np.asarray(v.addressable_shards[0].data, np.float64).sum()) for k, v in replicated.items()}
    abstract = tt.make_abstract(arrays)
    library = {
        "num_params": tt.get_num_params(arrays),
        "num_params_per_device": tt.get_num_params(arrays, per_device=True),
        "num_params_boxed_per_device": tt.get_num_params(boxes, per_device=True, mesh=mesh),
        "abstract_specs": {k: str(v.sharding.spec) for k, v in abstract.items()},
        "replicated_sums": rep_sums,
        "replicated_everywhere": all(v.sharding.is_fully_replicated for v in replicated.values()),
    }
    logger = MetricsLogger(JsonlWriter(metrics_path), every=2)
    for step in range(3):  # logs steps 0 and 2, from process 0 only
        logger(step, metrics)
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "devices": n,
                "local_devices": jax.local_device_count(),
                "jit": float(g_jit),
                "eager": float(g_eager),
                "gspmd_auto": float(g_auto),
                "per_leaf": {k: float(v) for k, v in per_leaf.items()},
                "shard_map": {k: float(v) for k, v in metrics.items()},
                "library": library,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
