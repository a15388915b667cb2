"""Two local processes (gloo collectives) save one sharded tree and restore it onto another sharding."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from treetools import checkpoint as ckpt
from treetools.partitioning import unbox

WORKER = Path(__file__).with_name("_multiprocess_ckpt_worker.py")
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 90


def _worker_module():
    spec = importlib.util.spec_from_file_location("_multiprocess_ckpt_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(ckpt_dir: Path) -> list[dict]:
    port = _free_port()
    env = dict(os.environ)
    # Overrides the 8 devices tests/conftest.py asks for: each process gets its own.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    env["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(ckpt_dir)],
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
        pytest.fail(f"two-process checkpoint workers did not finish in {TIMEOUT_S}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            pytest.fail(f"worker {i} exited with {p.returncode}:\n{err[-4000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("mp") / "checkpoints"
    return ckpt_dir, _run_two_processes(ckpt_dir)


def test_two_processes_save_and_restore_onto_another_sharding(two_process_run):
    ckpt_dir, results = two_process_run
    worker = _worker_module()
    host = worker.global_arrays()
    assert [r["process"] for r in results] == [0, 1]
    for r in results:
        assert (r["processes"], r["devices"], r["local_devices"]) == (2, 2 * DEVICES_PER_PROCESS, DEVICES_PER_PROCESS)
        assert r["steps"] == [worker.STEP]
        assert r["data_iter"] == {"epoch": 1, "seen": [worker.STEP]}
        assert r["local_shards_ok"]
        for name, (_, _, spec) in worker.LEAVES.items():
            assert r["leaves"][name]["spec"] == str(P(*spec))  # the new sharding, not the saved one
            assert r["leaves"][name]["boxed"] == (name in worker.BOXED)
    # Both processes see identical values, equal to the numpy data they were built from.
    assert results[0]["leaves"] == results[1]["leaves"]
    for name, data in host.items():
        got = results[0]["leaves"][name]
        assert {k: got[k] for k in ("sha256", "sum", "shape", "dtype")} == worker.digest(data)
        np.testing.assert_array_equal(np.asarray(got["values"], np.float32), data)


def test_single_process_restore_of_the_two_process_checkpoint(two_process_run, devices):
    ckpt_dir, results = two_process_run
    worker = _worker_module()
    host = worker.global_arrays()
    # Here: one process with 8 devices, a topology the checkpoint was not saved on.
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    target = {}
    for name, (shape, _, _) in worker.LEAVES.items():
        sds = jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, P("tp")))
        target[name] = nn.Partitioned(sds, names=("tp",)) if name in worker.BOXED else sds
    manager = ckpt.get_checkpoint_manager(1, checkpoint_dir=ckpt_dir, read_only=True)
    out = ckpt.restore_checkpoint(manager, None, {"params": target, "data_iter": None})["params"]
    manager.close()
    numpy_load = ckpt.load_parameters(ckpt_dir)
    for name, data in host.items():
        restored = np.asarray(unbox(out[name]))
        np.testing.assert_array_equal(restored, data)
        np.testing.assert_array_equal(numpy_load[name], data)
        assert worker.digest(restored) == {k: results[0]["leaves"][name][k] for k in ("sha256", "sum", "shape", "dtype")}
        assert unbox(out[name]).sharding == NamedSharding(mesh, P("tp"))
