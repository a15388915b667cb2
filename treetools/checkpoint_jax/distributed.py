"""Several processes on one checkpoint, on the engine JAX users already run: ``jax.distributed``.

``connect_processes()`` joins (or starts) a ``jax.distributed`` run and returns this process's ``JaxShare``
(``treetools.checkpoint_io.share.Share``): its index, the number of processes, and ``allgather``, built on
``jax.experimental.multihost_utils.process_allgather`` (gloo collectives on CPU). Give it to a command's
options (``share=``), and the block engine reads this process's jobs only and pools every process's results:
``inspect --stats``, ``verify`` and ``diff --values`` report exactly what one process reports.

Where the run comes from, in order:

* arguments (``coordinator``, ``count``, ``index``), as ``--processes N`` passes them to the local processes it
  starts;
* ``JAX_COORDINATOR_ADDRESS`` with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, set by hand on each host;
* what ``jax.distributed.initialize()`` finds by itself (SLURM, Open MPI, Kubernetes, Cloud TPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Iterator

import numpy as np

from treetools.shared.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class JaxShare:
    """This process's place in a ``jax.distributed`` run (``treetools.checkpoint_io.share.Share``)."""

    index: int
    count: int

    def allgather(self, payload: bytes) -> list[bytes]:
        """Every process's ``payload``, by process index (a collective: every process calls it in turn)."""
        from jax.experimental import multihost_utils

        with _stdout_to_stderr():  # gloo says "[Gloo] Rank 0 is connected to 1 peer ranks" on stdout
            sizes = np.asarray(multihost_utils.process_allgather(np.array([len(payload)], np.int32))).reshape(-1)
            buffer = np.zeros(max(1, int(sizes.max())), np.uint8)
            buffer[:len(payload)] = np.frombuffer(payload, np.uint8)
            every = np.asarray(multihost_utils.process_allgather(buffer)).reshape(len(sizes), -1)
        return [every[p, :int(n)].tobytes() for p, n in enumerate(sizes)]


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 sent to 2 for the block: what a C++ library prints on stdout is no report's data."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all (`>&-`)
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"`{name}` must be an integer, got {text[:40]!r}.") from None


def connect_processes(coordinator: str | None = None, count: int | None = None, index: int | None = None, *,
            timeout_s: int = 300) -> JaxShare:
    """Join a ``jax.distributed`` run (initialized here unless it already is) and return this process's share.

    Args:
      coordinator: ``host:port`` of process 0's coordinator (default ``JAX_COORDINATOR_ADDRESS``, else what
        ``jax.distributed.initialize`` detects).
      count: the number of processes (default ``JAX_NUM_PROCESSES``, else detected).
      index: this process's index (default ``JAX_PROCESS_ID``, else detected).
      timeout_s: how long to wait for the other processes to join.

    Raises:
      CheckpointError: the run could not be joined (one line naming what was missing or what failed).
    """
    import jax

    if not jax.distributed.is_initialized():
        coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
        count = count if count is not None else _env_int("JAX_NUM_PROCESSES")
        index = index if index is not None else _env_int("JAX_PROCESS_ID")
        # CPU collectives (the pooling) need one; jax's Config stub declares no option attributes
        if not jax.config.jax_cpu_collectives_implementation:  # type: ignore[attr-defined]
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=index,
                                       initialization_timeout=timeout_s)
        except (ValueError, RuntimeError) as e:  # jax's own words: no coordinator found, a peer never came...
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"cannot join the jax.distributed run ({text[:300]}); set JAX_COORDINATOR_ADDRESS, "
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process, or run under SLURM, Open MPI or "
                "Kubernetes, or use --processes N on one machine."
            ) from None
    return JaxShare(jax.process_index(), jax.process_count())
