"""Two local processes (gloo collectives) save one sharded tree and restore it onto another sharding."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests._multiprocess import load_module, run_two_processes
import treetools as ckpt
from treetools.pytree.partitioning import unbox

WORKER = Path(__file__).with_name("_multiprocess_ckpt_worker.py")
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 90


def _worker_module():
    return load_module(WORKER)


def _run_two_processes(ckpt_dir: Path) -> list[dict]:
    return run_two_processes(WORKER, ckpt_dir, devices_per_process=DEVICES_PER_PROCESS, timeout_s=TIMEOUT_S)


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


def test_two_processes_restore_from_a_bucket(two_process_run, remote_store):
    """The same checkpoint uploaded to a bucket: two processes restore it from there, each reading its own
    shards through the bucket's TensorStore store, and get exactly what the local restore gave."""
    ckpt_dir, local_results = two_process_run
    remote_store.upload(ckpt_dir, "mp", "checkpoints")
    results = run_two_processes(WORKER, remote_store.url("mp", "checkpoints"),
                                devices_per_process=DEVICES_PER_PROCESS, timeout_s=TIMEOUT_S)
    for got, want in zip(results, local_results):
        assert got["local_shards_ok"] and got["steps"] == want["steps"] and got["data_iter"] == want["data_iter"]
        assert got["leaves"] == want["leaves"]  # digests, values and the restore specs
