"""The checkpoint inspector: metadata time vs size, and ``--stats`` vs an Orbax restore + numpy.

One tree structure (32 layers of ``w`` (d, d) and ``b`` (d,), float32, 64
leaves), saved FSDP-sharded from 8 devices (``P("fsdp", None)``) at two sizes:
~2 MiB and ~2 GiB, both scaled by TREETOOLS_BENCH_SCALE.

* Metadata mode reads no array data, so inspecting the 2 GiB checkpoint takes
  about as long as the 2 MiB one (target ratio <= 1.2); the anchor is what a
  user does without the inspector: restore the checkpoint with Orbax (to host
  numpy) just to look at it.
* ``--stats`` streams every array in bounded blocks; the anchor restores with
  Orbax and runs the same float64 statistics with numpy. Throughput of both,
  and the peak RSS of each in a subprocess against the checkpoint size.
"""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import SCALE, report
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from treetools.inspect import inspect_path

LAYERS = 32
FULL_SMALL = 2 * 2**20
FULL_LARGE = 2 * 2**30


def _dim(total_bytes: float) -> int:
    """d such that 32 layers of (d, d) float32 hold about ``total_bytes``; a multiple of 8."""
    d = math.sqrt(total_bytes / (LAYERS * 4))
    return max(8, int(round(d / 8)) * 8)


def _save(path: str, d: int) -> int:
    """Save the tree at width ``d``; each shard is generated in place (no full host copy)."""
    n = min(8, jax.device_count())
    mesh = jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n])

    def array(shape, seed):
        sharding = NamedSharding(mesh, P("fsdp", *([None] * (len(shape) - 1))))

        def shard(index):
            block = np.empty(shape, np.float32)[index].shape
            rng = np.random.default_rng((seed, index[0].start or 0))
            return rng.standard_normal(block, np.float32)

        return jax.make_array_from_callback(shape, sharding, shard)

    tree = {f"layer_{i:02d}": {"w": array((d, d), 2 * i), "b": array((d,), 2 * i + 1)} for i in range(LAYERS)}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)
    del tree
    return nbytes


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect_bench")
    small, large = str(root / "small"), str(root / "large")
    sizes = {"small": _save(small, _dim(FULL_SMALL * SCALE)), "large": _save(large, _dim(FULL_LARGE * SCALE))}
    yield {"small": small, "large": large, "bytes": sizes}
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def _best(fn, repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _orbax_restore_numpy(path: str):
    """What a user does without the inspector: restore every array to host numpy."""
    handler = ocp.PyTreeCheckpointHandler()
    meta = handler.metadata(epath.Path(path)).tree
    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    with ocp.Checkpointer(handler) as ckptr:
        return ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def _numpy_stats(x: np.ndarray) -> dict:
    f = x.astype(np.float64).ravel()
    fin = f[np.isfinite(f)]
    return {"mean": fin.mean(), "std": fin.std(), "min": fin.min(), "max": fin.max(),
            "l2": math.sqrt(float(np.dot(fin, fin))), "abs_max": np.abs(fin).max(),
            "zeros": int(np.count_nonzero(f == 0)), "nan": int(np.isnan(f).sum()),
            "posinf": int(np.sum(f == np.inf)), "neginf": int(np.sum(f == -np.inf))}


def _anchor_stats(path: str) -> dict:
    from treetools.paths import flatten

    return {p: _numpy_stats(x) for p, x in flatten(_orbax_restore_numpy(path)).items()}


def test_metadata_time_depends_on_leaves_not_bytes(benchmark, ckpts):
    for p in (ckpts["small"], ckpts["large"]):  # warm the page cache and imports for both
        inspect_path(p)
    small_t = _best(lambda: inspect_path(ckpts["small"]), 5)
    large_t = _best(lambda: inspect_path(ckpts["large"]), 5)
    mib = ckpts["bytes"]["large"] / 2**20
    ratio = report(f"inspect metadata {mib:.0f} MiB vs {ckpts['bytes']['small'] / 2**20:.2f} MiB (64 leaves)",
                   large_t, small_t, "same tree small", target="<= 1.2")
    assert ratio < 3, "metadata mode must not read array data"
    rows = inspect_path(ckpts["large"]).by_step[0].items["default"]
    assert rows.total.bytes == ckpts["bytes"]["large"]
    benchmark.pedantic(inspect_path, args=(ckpts["large"],), rounds=3, iterations=1)


def test_metadata_inspect_vs_orbax_restore(benchmark, ckpts):
    path = ckpts["large"]
    anchor_t = _best(lambda: _orbax_restore_numpy(path), 1 if SCALE >= 0.5 else 3)
    ours_t = _best(lambda: inspect_path(path), 3)
    mib = ckpts["bytes"]["large"] / 2**20
    report(f"inspect metadata {mib:.0f} MiB", ours_t, anchor_t, "orbax restore to look", target="<< 1")
    benchmark.pedantic(inspect_path, args=(path,), rounds=3, iterations=1)


def test_stats_throughput_vs_orbax_restore_and_numpy(benchmark, ckpts):
    path = ckpts["large"]
    nbytes = ckpts["bytes"]["large"]
    t0 = time.perf_counter()
    anchor = _anchor_stats(path)
    anchor_t = time.perf_counter() - t0
    times = []

    def ours_fn():
        t = time.perf_counter()
        out = inspect_path(path, stats=True)
        times.append(time.perf_counter() - t)
        return out

    ours = benchmark.pedantic(ours_fn, rounds=1, iterations=1)  # runs once even with --benchmark-disable
    ours_t = min(times)
    rows = {r.path: r.stats for r in ours.by_step[0].items["default"].rows}
    for key in ("layer_00/w", f"layer_{LAYERS - 1:02d}/b"):  # same numbers as numpy on the restored arrays
        np.testing.assert_allclose(rows[key]["std"], anchor[key]["std"], rtol=1e-6)
        assert rows[key]["zeros"] == anchor[key]["zeros"]
    mib = nbytes / 2**20
    report(f"inspect --stats {mib:.0f} MiB ({mib / ours_t:.0f} MiB/s vs {mib / anchor_t:.0f} MiB/s)",
           ours_t, anchor_t, "orbax restore + numpy stats", target="<= 1.5")


_PEAK = (
    "import resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
    "assert p.returncode == 0, p.stderr[-2000:]\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)
_ANCHOR = (
    "import sys; sys.path.insert(0, sys.argv[2])\n"
    "import test_inspect_bench as b\n"
    "b._anchor_stats(sys.argv[1])\n"
)


def _peak_mib(*argv: str) -> float:
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", _PEAK, *argv], capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip()) / 1024


def test_stats_peak_rss_vs_checkpoint_size(ckpts):
    path = ckpts["large"]
    mib = ckpts["bytes"]["large"] / 2**20
    here = os.path.dirname(os.path.abspath(__file__))
    base = _peak_mib(sys.executable, "-m", "treetools", "inspect", path, "--format", "json")
    ours = _peak_mib(sys.executable, "-m", "treetools", "inspect", path, "--stats", "--format", "json")
    anchor = _peak_mib(sys.executable, "-c", _ANCHOR, path, here)
    print(f"[bench] inspect --stats peak RSS on {mib:.0f} MiB: ours {ours:.0f} MiB "
          f"(+{ours - base:.0f} over metadata mode), orbax restore + numpy {anchor:.0f} MiB, "
          f"ratio {ours / anchor:.3f}", flush=True)
    if mib >= 256:  # below that, interpreter and library baselines dominate
        assert ours - base < mib / 4
