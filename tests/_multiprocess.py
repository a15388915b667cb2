"""Two local JAX processes on CPU: the launcher the tests use and the set-up the workers use.

Each worker is a script run as ``python WORKER PROCESS_ID PORT *ARGS``; it calls
``init_distributed`` (gloo collectives, coordinator on 127.0.0.1) and prints
one JSON line last on stdout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType


def load_module(path: Path) -> ModuleType:
    """Import a worker script as a module (for its data helpers)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(worker: Path, *args: str, devices_per_process: int, timeout_s: float) -> list[dict]:
    """Run ``worker`` as processes 0 and 1; return each one's last JSON line.

    Fails the calling test (``pytest.fail``) on a timeout or a non-zero exit,
    with the worker's stderr; the children are always killed.
    """
    import pytest

    port = _free_port()
    env = dict(os.environ)
    # Overrides the 8 devices tests/conftest.py asks for: each process gets its own.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
    env["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(i), str(port), *map(str, args)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outs: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        pytest.fail(f"two-process workers of {worker.name} did not finish in {timeout_s}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            pytest.fail(f"{worker.name} process {i} exited with {p.returncode}:\n{err[-4000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def init_distributed(process_id: int, port: int) -> None:
    """``jax.distributed.initialize`` for two local processes with gloo CPU collectives."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=40)
