"""Two local processes (gloo collectives) agree on the sharded global norm."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from jax.sharding import PartitionSpec as P

from tests._multiprocess import load_module, run_two_processes

WORKER = Path(__file__).with_name("_multiprocess_norm_worker.py")
DEVICES_PER_PROCESS = 4
TIMEOUT_S = 50


def _worker_module():
    return load_module(WORKER)


def _run_two_processes(metrics_path: Path) -> list[dict]:
    return run_two_processes(WORKER, metrics_path, devices_per_process=DEVICES_PER_PROCESS, timeout_s=TIMEOUT_S)


def test_two_processes_agree_with_float64(tmp_path):
    metrics_path = tmp_path / "metrics.jsonl"
    results = _run_two_processes(metrics_path)
    assert [r["process"] for r in results] == [0, 1]
    for r in results:
        assert (r["processes"], r["devices"], r["local_devices"]) == (2, 2 * DEVICES_PER_PROCESS, DEVICES_PER_PROCESS)

    # Both processes print bit-identical values (they hold the same replicated result).
    assert results[0]["jit"] == results[1]["jit"]
    assert results[0]["per_leaf"] == results[1]["per_leaf"]
    assert results[0]["shard_map"] == results[1]["shard_map"]

    # ... equal to a single-process float64 computation on the same arrays.
    host = _worker_module().global_arrays()
    sq = {k: float(np.sum(v.astype(np.float64) ** 2)) for k, v in host.items()}
    expected = np.sqrt(sum(sq.values()))
    r = results[0]
    for path in ("jit", "eager", "gspmd_auto"):
        assert results[0][path] == results[1][path]
        np.testing.assert_allclose(r[path], expected, rtol=2e-6)
    np.testing.assert_allclose(r["shard_map"]["grad_norm"], expected, rtol=2e-6)
    np.testing.assert_allclose(r["shard_map"]["param_norm"], expected, rtol=2e-6)
    assert r["shard_map"]["nonfinite_grads"] == 0
    for k, v in sq.items():
        np.testing.assert_allclose(r["per_leaf"][k], np.sqrt(v), rtol=2e-6)
        np.testing.assert_allclose(r["shard_map"][f"grad_norm/{k}"], np.sqrt(v), rtol=2e-6)

    # Counts, abstract trees and replicate agree across processes and with a single-process view.
    assert results[0]["library"] == results[1]["library"]
    lib = r["library"]
    assert lib["num_params"] == sum(v.size for v in host.values())
    # Per device: each leaf split over the mesh axes its spec names (2 x DEVICES_PER_PROCESS mesh).
    sizes = {"data": 2, "fsdp": DEVICES_PER_PROCESS}
    expected_local = 0
    for name, (shape, spec) in _worker_module().LEAVES.items():
        parts = [int(np.prod([sizes[a] for a in (e if isinstance(e, tuple) else (e,)) if a])) for e in spec]
        expected_local += int(np.prod([d // p for d, p in zip(shape, parts)]))
    assert lib["num_params_per_device"] == lib["num_params_boxed_per_device"] == expected_local
    assert lib["replicated_everywhere"]
    for k, v in host.items():
        np.testing.assert_allclose(lib["replicated_sums"][k], v.astype(np.float64).sum(), rtol=1e-6)
        assert lib["abstract_specs"][k] == str(P(*_worker_module().LEAVES[k][1]))

    # The logger wrote steps 0 and 2 once each (process 0 only), as host numbers.
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2]
    assert lines[0]["grad_norm"] == r["shard_map"]["grad_norm"]
    assert lines[0]["nonfinite_grads"] == 0 and isinstance(lines[0]["nonfinite_grads"], int)
