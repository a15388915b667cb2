"""One quick run of the whole benchmark suite at tiny sizes (part of ``make test``).

It proves the suites still run; the numbers at this size mean nothing. No time limit: on a loaded machine a
suite is slow, not broken (a 480 s limit failed ``make test`` there, issue 47); a suite that hangs is named by
pytest's ``faulthandler_timeout`` thread dump.
"""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def test_benchmarks_run_at_tiny_sizes(tmp_path):
    suites = sorted(str(p) for p in HERE.glob("test_*_bench.py"))
    assert suites, "no benchmark suites found"
    env = {**os.environ, "TREETOOLS_BENCH_SCALE": "0.0005", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--benchmark-disable",
         "--rootdir", str(HERE), *suites],
        env=env, cwd=tmp_path, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[bench]" in proc.stdout, "benchmarks printed no ratio lines"


def test_norm_diagnostics_run_at_tiny_sizes(tmp_path):
    env = {**os.environ, "TREETOOLS_BENCH_SCALE": "0.0005"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "norm_diagnostics.py")], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for section in ("1. kernels", "2. slot", "3. buffers"):
        assert section in proc.stdout


def test_process_diagnostics_run_at_tiny_sizes(tmp_path):
    env = {**os.environ, "TREETOOLS_BENCH_SCALE": "0.0005"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "process_diagnostics.py")], env=env, cwd=tmp_path, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for section in ("1. start", "2. fresh", "3. threads", "4. cache", "5. process", "6. writer", "7. anchor"):
        assert section in proc.stdout
