"""``convert --to orbax`` by several processes (``--processes N``, ``--distributed``): each process writes the
leaves it owns (by bytes) into its own OCDBT database, Orbax's primary process merges them, and Orbax's own
restore reads the same tree, dtypes and values, bit for bit, as from one process's output.

Every process launch pays jax's start-up on a shared machine: one multi-process run per case (2 processes from a
safetensors file, 4 from an Orbax checkpoint into a manager step, 2 started by hand with a failing read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from safetensors.numpy import load_file, save_file

from tests.test_processes import _free_port

rng = np.random.default_rng(7)


ROOT = str(Path(__file__).resolve().parents[1])
ENV = {**os.environ, "JAX_PLATFORMS": "cpu",  # this checkout's treetools, from any working folder
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def _treetools(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "treetools", *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, env=ENV)


def _restore(path, step=None):
    """Orbax's own restore: a StandardCheckpointer checkpoint, or step ``step`` of a manager root."""
    if step is None:
        with ocp.StandardCheckpointer() as c:
            return c.restore(os.path.abspath(path))
    with ocp.CheckpointManager(os.path.abspath(path)) as m:
        return m.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]


def _flat(tree):
    """``{key path: numpy array}`` of a restored tree."""
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_same(a, b):
    """The same tree, dtypes, shapes and bytes."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    fa, fb = _flat(a), _flat(b)
    assert list(fa) == list(fb)
    for key in fa:
        assert (fa[key].dtype, fa[key].shape) == (fb[key].dtype, fb[key].shape), key
        assert fa[key].tobytes() == fb[key].tobytes(), key


def _written_by(path):
    """The leaves in each process's OCDBT database (``ocdbt.process_N``), listed with TensorStore's own kvstore:
    keys are ``<leaf>/.zarray`` and ``<leaf>/<chunk>``."""
    out = {}
    for folder in sorted(path.glob("ocdbt.process_*")):
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{folder}"}).result()
        out[int(folder.name.rsplit("_", 1)[1])] = {k.decode().rsplit("/", 1)[0] for k in kv.list().result()}
    return out


def _items(folder):
    """``treetools inspect . --stats --leaves`` run inside ``folder`` (so the path is the same), less the save
    time."""
    proc = _treetools("inspect", ".", "--stats", "--leaves", "--format", "json", cwd=folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [c["items"] for c in json.loads(proc.stdout)["checkpoints"]]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("orbaxmp")
    # Bytes: embed 3000 * 64 * 4 = 768,000; the five layers 37 * 64 * 4 * (1 + ... + 5) = 142,080, with half and
    # count 80 bytes more: less than embed, so two processes split {embed} and everything else.
    tensors = {f"model.layers.{i}.w": rng.standard_normal((37 * (i + 1), 64)).astype(np.float32) for i in range(5)}
    tensors["model.embed"] = rng.standard_normal((3000, 64)).astype(np.float32)
    tensors["model.half"] = rng.standard_normal((10, 3)).astype(np.float16)
    tensors["model.count"] = np.arange(5, dtype=np.int32)
    save_file(tensors, str(folder / "a.safetensors"))
    # Orbax's own save. Bytes: embed 1000 * 48 * 2 = 96,000; kernel 300 * 70 * 4 = 84,000; bias 280; int8 33;
    # count 4. Four processes, the largest first to the least loaded: embed 0, kernel 1, bias 2, int8 3, and count
    # to process 3 (33 bytes, the least).
    tree = {"embed": rng.standard_normal((1000, 48)).astype(ml_dtypes.bfloat16),
            "dense": {"kernel": rng.standard_normal((300, 70)).astype(np.float32),
                      "bias": rng.standard_normal(70).astype(np.float32)},
            "int8": rng.integers(-128, 127, 33).astype(np.int8),
            "count": np.array(4, np.int32)}
    with ocp.StandardCheckpointer() as c:
        c.save(os.path.abspath(folder / "orbax"), tree)
    return folder, tensors, tree


def test_two_processes_write_what_one_writes_from_safetensors(sources, tmp_path):
    folder, tensors, _ = sources
    src = folder / "a.safetensors"
    alone = _treetools("convert", src, tmp_path / "one", "--to", "orbax")
    assert alone.returncode == 0, alone.stderr[-2000:]
    two = _treetools("convert", src, tmp_path / "two", "--to", "orbax", "--processes", "2", "--verify")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "verify: ok" in two.stdout and two.stdout.count("wrote ") == 1  # one report, process 0's
    restored = _restore(tmp_path / "two")
    _assert_same(restored, _restore(tmp_path / "one"))
    # And the source's values, read by safetensors' own reader.
    flat = _flat(restored)
    source = load_file(str(src))
    assert len(flat) == len(source)
    for name, array in source.items():
        key = "".join(f"['{part}']" for part in name.split("."))
        assert flat[key].dtype == array.dtype and flat[key].tobytes() == array.tobytes(), name
    # Each process wrote its own leaves into its own database, and nothing else (see the fixture's bytes).
    assert _written_by(tmp_path / "two") == {0: {"model.embed"}, 1: {n for n in tensors if n != "model.embed"}}
    assert _written_by(tmp_path / "one") == {0: set(tensors)}
    # treetools reads it as it reads one process's output.
    assert _items(tmp_path / "two") == _items(tmp_path / "one")
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]  # no temporary left


def test_four_processes_write_a_manager_step_from_an_orbax_checkpoint(sources, tmp_path):
    folder, _, tree = sources
    src = folder / "orbax"
    alone = _treetools("convert", src, tmp_path / "one", "--to", "orbax", "--dst-step", "3")
    assert alone.returncode == 0, alone.stderr[-2000:]
    four = _treetools("convert", src, tmp_path / "four", "--to", "orbax", "--dst-step", "3", "--processes", "4")
    assert four.returncode == 0, four.stderr[-3000:]
    restored = _restore(tmp_path / "four", step=3)
    _assert_same(restored, _restore(tmp_path / "one", step=3))
    _assert_same(restored, tree)  # the source's own arrays, bfloat16 and the 0-d one included
    assert _written_by(tmp_path / "four" / "3" / "params") == {
        0: {"embed"}, 1: {"dense.kernel"}, 2: {"dense.bias"}, 3: {"int8", "count"}}
    assert sorted(os.listdir(tmp_path / "four")) == ["3"]  # the step, no temporary beside it
    assert sorted(os.listdir(tmp_path)) == ["four", "one"]


_FAILING = """
import sys
import treetools.checkpoint_io.formats._tensorstore as tsr
original = tsr.TensorStoreReader.read
def read(reader, index):
    if tuple(reader.shape) == (7,):
        raise tsr.CheckpointError(f"{reader._where}: cannot read array data (a damaged chunk).")
    return original(reader, index)
tsr.TensorStoreReader.read = read
sys.argv = ["treetools", *sys.argv[1:]]
from treetools.cli import run
run()
"""


def test_a_read_failing_in_one_process_fails_every_process_and_leaves_nothing(tmp_path):
    # Leaf b (7 int32, 28 bytes) is process 1's (a: 1,200 bytes, process 0's); its read fails there, inside
    # Orbax's save. Every process ends with the same one line, and neither the destination nor a temporary is left.
    with ocp.StandardCheckpointer() as c:
        c.save(os.path.abspath(tmp_path / "src"), {"a": np.ones(300, np.float32), "b": np.zeros(7, np.int32)})
    wrapper = tmp_path / "failing.py"
    wrapper.write_text(_FAILING)
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(wrapper), "convert", str(tmp_path / "src"), str(tmp_path / "o"),
                               "--to", "orbax", "--distributed"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**ENV, "JAX_COORDINATOR_ADDRESS": address,
                                   "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], [err[-2000:] for _, err in outs]
    for _, err in outs:
        last = err.strip().splitlines()[-1]
        assert last.startswith("treetools: error:") and "a damaged chunk" in last and "`b`" in last, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failing.py", "src"]
