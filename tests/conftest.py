"""Every test runs on 8 fake CPU devices: the repository's conftest.py sets the flag before jax starts.

One compilation cache for the test run: many tests compile the same programs again (each ``train()`` of the
reference trainer jits its step afresh, a resume test trains the same model two or three times, the README's
commands train what other tests train). JAX's persistent compilation cache, in a folder made for this run,
serves those repeats from disk: the xdist workers, the ``treetools`` subprocesses and the benchmark smoke run
(benchmarks/test_smoke.py, run with tests/) inherit its environment variables and share it. What runs is
unchanged (the same programs, compiled by the same XLA); only a second compile of an identical program is
skipped. A size limit turns on JAX's file lock around each read and write, so no process reads an entry another
is still writing. The folder is removed when the run ends. ``make bench`` does not load this file: benchmarks
time their compiles as a user's first run has them. A ``JAX_COMPILATION_CACHE_DIR`` set by the caller is used as
it is (set it to "" for a run without a cache).
"""

import importlib.util
import os
import shutil
import tempfile

_MADE_CACHE = None  # the folder this process made (the xdist controller, or a plain pytest run); removed at exit
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and importlib.util.find_spec("filelock") is not None:
    _MADE_CACHE = tempfile.mkdtemp(prefix="treetools-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _MADE_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")  # jax's default, 1 s, misses many
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))  # any limit takes the file lock

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
    if _MADE_CACHE is not None:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 fake CPU devices, got {len(devs)}"
    return devs

# Local S3 (moto) and GCS (fake-gcs-server) servers for the gs:// and s3:// tests: s3_store, gcs_store, remote_store.
from tests._buckets import _gcs_service, _s3_service, gcs_store, remote_store, s3_store  # noqa: E402,F401
