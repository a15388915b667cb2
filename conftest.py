"""Set before jax starts, for every pytest run from the repository root (tests/, benchmarks/ and
``pytest --doctest-modules treetools``): 8 fake CPU devices."""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
