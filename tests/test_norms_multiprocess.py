"""Two local processes (gloo collectives) agree on the sharded global norm."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("_multiprocess_norm_worker.py")
DEVICES_PER_PROCESS = 4
TIMEOUT_S = 50


def _worker_module():
    spec = importlib.util.spec_from_file_location("_multiprocess_norm_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(metrics_path: Path) -> list[dict]:
    port = _free_port()
    env = dict(os.environ)
    # Overrides the 8 devices tests/conftest.py asks for: each process gets its own.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    env["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(metrics_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs: list[tuple[str, str]] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        pytest.fail(f"two-process norm workers did not finish in {TIMEOUT_S}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            pytest.fail(f"worker {i} exited with {p.returncode}:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


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
    np.testing.assert_allclose(r["jit"], expected, rtol=2e-6)
    np.testing.assert_allclose(r["shard_map"]["grad_norm"], expected, rtol=2e-6)
    np.testing.assert_allclose(r["shard_map"]["param_norm"], expected, rtol=2e-6)
    assert r["shard_map"]["nonfinite_grads"] == 0
    for k, v in sq.items():
        np.testing.assert_allclose(r["per_leaf"][k], np.sqrt(v), rtol=2e-6)
        np.testing.assert_allclose(r["shard_map"][f"grad_norm/{k}"], np.sqrt(v), rtol=2e-6)

    # The logger wrote steps 0 and 2 once each (process 0 only), as host numbers.
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2]
    assert lines[0]["grad_norm"] == r["shard_map"]["grad_norm"]
    assert lines[0]["nonfinite_grads"] == 0 and isinstance(lines[0]["nonfinite_grads"], int)
