"""What the ``treetools`` program sets for its own process, before a command loads numpy.

Only ``run()`` (the ``treetools`` script, ``python -m treetools``) calls
``tune``: the process is the program's. ``treetools.cli.main()`` called from
Python, and the library, leave the caller's process as it is. Each setting is
skipped where the user's environment already says something about it.

* numpy's OpenBLAS starts one thread per core when numpy is imported, and
  those threads spin before they sleep: about 40 ms of CPU for ``import numpy``
  on 2 cores, 25-35 ms over a metadata ``inspect``. No command does
  BLAS work big enough to use them (the block engine has threads of its own),
  so the program asks OpenBLAS for one (``OPENBLAS_NUM_THREADS=1``) unless
  ``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS`` is set.
* glibc's malloc serves a fresh process's large blocks (a decoded 8 MiB
  chunk, a block of a diff) with ``mmap`` and gives each back to the kernel
  when it is freed; its own threshold adapts only later, and the heaps still
  return their free top above twice that threshold. Each block's pages are then
  faulted in anew: about 200-250 page faults per MiB read, each byte's page
  faulted once (``diff --values`` of 1 GiB: 200,000-290,000), a fifth of the
  command's CPU time. With blocks up to ``MMAP_THRESHOLD`` taken from the heap
  and ``TRIM_THRESHOLD`` of free memory kept for the next block, the freed pages
  are reused (``diff --values``: about 50,000 faults; peak memory 20-50 MiB
  higher). The free memory kept is ``TRIM_BLOCKS`` blocks of the block size
  the commands read with (``TREETOOLS_CHUNK_BYTES``), at most ``TRIM_THRESHOLD``:
  a user who shrinks the blocks to hold memory down keeps that much less.
  Those thresholds hold per malloc arena, and glibc gives threads up to eight
  arenas per core: TensorStore's threads, which write an Orbax checkpoint's
  blocks, each kept freed blocks in their own, so ``convert --to orbax``
  peaked 150-250 MiB higher and grew with the bytes (431 -> 489 MiB from 1 to
  8 GiB of 16 MiB leaves). With ``ARENA_MAX`` arenas it holds 238 -> 250 MiB,
  at the same CPU; ``inspect --stats``, ``verify`` and ``diff --values`` are
  unchanged in CPU and page faults.
  Skipped unless the C library is glibc, and where any ``MALLOC_*``
  variable or a ``glibc.malloc`` tunable is set.
* Python's cyclic garbage collector walks every live container object at each
  full collection, and a command that reads a checkpoint of many leaves builds
  its rows, readers and parsed metadata as it goes: collections at Python's
  default thresholds (700 allocations) came ever more often over ever more
  objects, 11 full ones over 4-5 million objects in a metadata ``inspect`` of
  50,000 Orbax leaves, 0.75 of its 2.2 CPU s, and the growth of its CPU with
  the leaves (exponent 1.2 from 10,000 to 50,000; 1.06 without). The program
  collects ``GC_THRESHOLD`` allocations apart (as mypy does): objects are
  still freed when their last reference goes; only garbage in reference cycles
  waits longer.
"""

from __future__ import annotations

import os
from typing import Callable, MutableMapping

from treetools.shared.errors import CheckpointError
from treetools.shared.settings import DEFAULT_BLOCK_BYTES, block_bytes_from

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
"""Variables by which a user sets OpenBLAS's threads (any one set: the program leaves it alone)."""

GC_THRESHOLD = (200_000, 30, 30)
"""``gc.set_threshold`` of the program's process (Python's default: 700, 10, 10)."""

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
MMAP_THRESHOLD = 32 * 2**20
"""Blocks up to this size come from malloc's heap, not from ``mmap`` (glibc's largest dynamic threshold)."""
TRIM_THRESHOLD = 64 * 2**20
"""Free memory at a heap's top kept for the next blocks, not given back to the kernel (at most)."""
TRIM_BLOCKS = 4
"""... and at most this many blocks of the commands' block size (the default 8 MiB blocks: 32 MiB)."""
ARENA_MAX = 2
"""malloc arenas the threads share (glibc's default: eight per core), each keeping what the thresholds keep."""


def kept_free(environ: MutableMapping[str, str]) -> int:
    """Bytes of free memory malloc keeps for the next blocks: ``TRIM_BLOCKS`` blocks, at most ``TRIM_THRESHOLD``.

    >>> kept_free({}) >> 20, kept_free({"TREETOOLS_CHUNK_BYTES": str(2**21)}) >> 20
    (32, 8)
    """
    try:
        block = block_bytes_from(environ.get("TREETOOLS_CHUNK_BYTES"))
    except CheckpointError:  # the command itself reports the bad value, in its one line
        block = DEFAULT_BLOCK_BYTES
    return min(TRIM_THRESHOLD, TRIM_BLOCKS * block)


def user_sets_malloc(environ: MutableMapping[str, str]) -> bool:
    """Whether the environment tunes glibc's malloc itself (a ``MALLOC_*`` variable, a ``glibc.malloc`` tunable).

    >>> user_sets_malloc({"MALLOC_ARENA_MAX": "2"}), user_sets_malloc({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})
    (True, True)
    >>> user_sets_malloc({"GLIBC_TUNABLES": "glibc.rtld.nns=8"})
    False
    """
    return any(k.startswith("MALLOC_") for k in environ) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None under another C library."""
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
    except (AttributeError, ValueError, OSError):  # not glibc (macOS, musl, Windows)
        return None
    import ctypes  # here: the one use, on glibc only (1-2 ms to import)

    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def tune(environ: MutableMapping[str, str] | None = None,
         mallopt: Callable[[int, int], int] | None = None) -> list[str]:
    """Set OpenBLAS's threads and malloc's thresholds for this process (see the module docstring); returns
    what was set, in words. ``mallopt`` defaults to glibc's (None elsewhere: skipped).

    >>> import gc
    >>> saved = gc.get_threshold()
    >>> env = {"OMP_NUM_THREADS": "4"}
    >>> for line in tune(env, mallopt=lambda option, value: 1):
    ...     print(line)
    gc: collections 200,000 allocations apart
    malloc: blocks up to 32 MiB from the heap, 32 MiB kept free, 2 arenas
    >>> env, gc.get_threshold()
    ({'OMP_NUM_THREADS': '4'}, (200000, 30, 30))
    >>> gc.set_threshold(*saved)
    """
    import gc

    environ = os.environ if environ is None else environ
    gc.set_threshold(*GC_THRESHOLD)
    done = [f"gc: collections {GC_THRESHOLD[0]:,} allocations apart"]
    if not any(k in environ for k in BLAS_THREAD_VARIABLES):
        environ["OPENBLAS_NUM_THREADS"] = "1"
        done.append("OPENBLAS_NUM_THREADS=1")
    if not user_sets_malloc(environ):
        mallopt = mallopt if mallopt is not None else glibc_mallopt()
        keep = kept_free(environ)
        if mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, keep) \
                and mallopt(M_ARENA_MAX, ARENA_MAX):
            done.append(f"malloc: blocks up to {MMAP_THRESHOLD >> 20} MiB from the heap, {keep >> 20} MiB kept free, "
                        f"{ARENA_MAX} arenas")
    return done
