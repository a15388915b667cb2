"""treetools.checkpoint_tools.stats: every statistic against numpy float64 over the whole array.

Tolerances: float statistics of float32 (and narrower) data are reduced in
float32 per cache-sized piece and merged in float64; they match float64 numpy
to ``rtol=1e-6`` (mean is compared against the spread: ``atol = 1e-6 * std``,
which is what matters when the mean is large and the std small). float64 and
integer data are reduced in float64: ``rtol=1e-10``. Counts, min and max are exact.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.readers import FileReader, InMemoryReader
from treetools.checkpoint_tools.progress import Progress
from treetools.checkpoint_tools.stats import StatsAccumulator, array_stats, compute_stats, leaf_stats


def _expected(x: np.ndarray) -> dict:
    """numpy float64 over the whole array, finite elements only, written independently of the module."""
    f = np.abs(x).astype(np.float64).ravel() if np.iscomplexobj(x) else np.asarray(x).astype(np.float64).ravel()
    fin = f[np.isfinite(f)]
    counts = {"zeros": int(np.sum(fin == 0)), "nan": int(np.isnan(f).sum()),
              "posinf": int(np.sum(f == np.inf)), "neginf": int(np.sum(f == -np.inf))}
    if fin.size == 0:
        return {**dict.fromkeys(("mean", "std", "min", "max", "l2", "abs_max"), math.nan), **counts}
    return {"mean": fin.mean(), "std": fin.std(), "min": fin.min(), "max": fin.max(),
            "l2": math.sqrt(float(np.sum(fin * fin))), "abs_max": np.abs(fin).max(), **counts}


def _check(got: dict, x: np.ndarray, rtol: float) -> None:
    want = _expected(x)
    for k in ("zeros", "nan", "posinf", "neginf"):
        assert got[k] == want[k], k
    if math.isnan(want["mean"]):
        assert all(math.isnan(got[k]) for k in ("mean", "std", "min", "max", "l2", "abs_max"))
        return
    for k in ("min", "max", "abs_max"):
        assert got[k] == want[k], k
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=rtol, atol=rtol * want["std"] + 1e-300)
    for k in ("std", "l2"):
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-300, err_msg=k)


def _rtol(dtype, name: str = "") -> float:
    if name == "large_mean_small_std_f64":
        # mean/std = 1e11: float64 means themselves carry 1e-16 * 1e8 of rounding, which merging
        # pieces (Chan) turns into ~1e-8 of the std; numpy's two-pass std is no better than ~1e-10 here.
        return 1e-7
    return 1e-10 if np.dtype(dtype) in (np.float64, np.complex128) or np.dtype(dtype).kind in "biu" else 1e-6


rng = np.random.default_rng(0)


def _mixed_nonfinite(n: int) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.choice(n, n // 10, replace=False)] = np.nan
    x[rng.choice(n, 7, replace=False)] = np.inf
    x[rng.choice(n, 5, replace=False)] = -np.inf
    x[rng.choice(n, 11, replace=False)] = 0
    return x


CASES = {
    "normal_f32": rng.standard_normal((300, 257)).astype(np.float32),
    "normal_f64": rng.standard_normal(100_003),
    "large_mean_small_std_f32": (1e4 + 1e-2 * rng.standard_normal(200_000)).astype(np.float32),
    "large_mean_small_std_f64": 1e8 + 1e-3 * rng.standard_normal(200_000),
    "nonfinite_mixed": _mixed_nonfinite(150_000),
    "all_nan": np.full(1000, np.nan, np.float32),
    "only_inf": np.array([np.inf, -np.inf, np.inf], np.float32),
    "bf16": rng.standard_normal(70_001).astype(ml_dtypes.bfloat16),
    "fp16": rng.standard_normal(70_001).astype(np.float16),
    "int32": rng.integers(-1000, 1000, 90_000).astype(np.int32),
    "uint8": rng.integers(0, 255, 90_000).astype(np.uint8),
    "int64_big": rng.integers(-2**40, 2**40, 10_000),
    "bool": rng.random(50_000) < 0.3,
    "complex64": (rng.standard_normal(40_000) + 1j * rng.standard_normal(40_000)).astype(np.complex64),
    "empty": np.zeros((0, 4), np.float32),
    "scalar": np.array(3.5, np.float32),
    "huge_f32": (rng.standard_normal(50_000) * 1e30).astype(np.float32),
    "tiny_f32": (rng.standard_normal(50_000) * 1e-30).astype(np.float32),
    "zeros": np.zeros(12345, np.float32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_array_stats_matches_numpy_float64(name):
    x = CASES[name]
    _check(array_stats(x), x, _rtol(x.dtype, name))


@pytest.mark.parametrize("name", ["normal_f32", "nonfinite_mixed", "large_mean_small_std_f32", "bf16", "int32"])
@pytest.mark.parametrize("block_bytes", [1024, 4099, 1 << 20])  # many blocks, odd sizes, one block
def test_leaf_stats_in_blocks_matches_numpy(name, block_bytes):
    x = CASES[name]
    _check(leaf_stats(InMemoryReader(x), block_bytes=block_bytes).result(), x, _rtol(x.dtype, name))


def test_compute_stats_parallel_equals_sequential_and_numpy(tmp_path):
    names = sorted(CASES)
    arrays = [CASES[k] for k in names]
    readers = [InMemoryReader(x) for x in arrays]
    path = tmp_path / "raw.bin"
    big = rng.standard_normal((513, 1000)).astype(np.float32)
    big.tofile(path)
    readers.append(FileReader(ReadContext().confined_to(str(path)), str(path), 0, big.shape, big.dtype))
    arrays.append(big)
    names.append("big")
    seq = [leaf_stats(r, block_bytes=5000).result() for r in readers]
    par = [a.result() for a in compute_stats(readers, block_bytes=5000, workers=4)]
    one = [a.result() for a in compute_stats(readers, block_bytes=5000, workers=1)]
    assert par == one  # merged in block order: timing never changes the numbers
    for s, p, x, name in zip(seq, par, arrays, names):
        _check(p, x, _rtol(x.dtype, name))
        for k in s:
            if isinstance(s[k], int) or math.isnan(s[k]):
                assert s[k] == p[k] or (math.isnan(s[k]) and math.isnan(p[k])), k
            else:
                tol = _rtol(x.dtype, name)  # float32 shifts depend on grouping: the same tolerance as vs numpy
                np.testing.assert_allclose(p[k], s[k], rtol=tol, atol=tol * max(1.0, abs(s["std"])), err_msg=k)


def test_compute_stats_progress_counts_every_byte():
    readers = [InMemoryReader(CASES[k]) for k in ("normal_f32", "bf16", "int32")]
    total = sum(r.dtype.itemsize * math.prod(r.shape) for r in readers)
    bar = Progress(total, enabled=False)
    compute_stats(readers, block_bytes=4096, progress=bar, workers=3, labels=["a", "b", "c"])
    assert bar.done == total


def test_merge_equals_one_stream():
    x = CASES["nonfinite_mixed"]
    a, b = StatsAccumulator(), StatsAccumulator()
    a.update(x[:70_001])
    b.update(x[70_001:])
    _check(a.merge(b).result(), x, 1e-6)


_CHILD = (
    "import sys, numpy as np, resource\n"
    "from treetools.checkpoint_io.readers import FileReader\n"
    "from treetools.checkpoint_io.context import ReadContext\n"
    "from treetools.checkpoint_tools.stats import compute_stats\n"
    "n = int(sys.argv[2])\n"
    "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "acc = compute_stats([FileReader(ReadContext().confined_to(sys.argv[1]), sys.argv[1], 0, (n,), np.float32)],"
    " block_bytes=1 << 20, workers=2)[0]\n"
    "print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, acc.count)\n"
)


def test_peak_memory_is_bounded_by_blocks_not_file(tmp_path):
    n = 64 * 2**20  # 256 MiB of float32, streamed in 1 MiB blocks by 2 threads
    path = tmp_path / "big.f32"
    with open(path, "wb") as f:
        for _ in range(64):
            rng.standard_normal(2**20, dtype=np.float32).tofile(f)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(n)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    base_kib, peak_kib, count = map(int, proc.stdout.split())
    assert count == n
    grown_mib = (peak_kib - base_kib) / 1024
    assert grown_mib < 32, f"stats of a 256 MiB file grew the process by {grown_mib:.0f} MiB"


def test_the_nonfinite_sum_is_written_once():
    # Issue 36: nan + posinf + neginf was summed in four places (the table's column, the statistics accumulator,
    # `plot --stats`, `inspect --show`); shared.rows.nonfinite_count is the one.
    import pathlib
    import re

    import treetools
    from treetools.shared.rows import NONFINITE_COUNTS, nonfinite_count

    package = pathlib.Path(treetools.__file__).parent
    written = re.compile(r"""nan\W{1,12}\+\W{0,12}\w*\W{0,4}posinf|\("nan", "posinf", "neginf"\)""")
    found = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py") if written.search(p.read_text()))
    assert found == ["shared/rows.py"]
    assert NONFINITE_COUNTS == ("nan", "posinf", "neginf")
    x = np.array([np.nan, np.inf, -np.inf, -np.inf, 1.0])
    assert nonfinite_count(array_stats(x)) == int(np.count_nonzero(~np.isfinite(x))) == 4
