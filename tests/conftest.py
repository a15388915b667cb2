"""Every test runs on 8 fake CPU devices: the repository's conftest.py sets the flag before jax starts."""

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 fake CPU devices, got {len(devs)}"
    return devs

# Local S3 (moto) and GCS (fake-gcs-server) servers for the gs:// and s3:// tests: s3_store, gcs_store, remote_store.
from tests._buckets import _gcs_service, _s3_service, gcs_store, remote_store, s3_store  # noqa: E402,F401
