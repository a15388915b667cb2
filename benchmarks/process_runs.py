"""Whole processes, timed as a user runs them: shared by ``test_process_bench.py`` and ``process_diagnostics.py``.

* ``orbax_run(folder, rows)``: issue 26's checkpoint, one CheckpointManager
  root with 2 steps of 64 float32 leaves of (rows, 2048), Orbax's default zstd.
* ``timed(argv)``: one process: wall seconds, CPU seconds (user + system, all
  threads, from ``wait4``), system seconds, minor page faults and peak RSS.
* ``interleaved(variants, rounds)``: every variant once per round, in an order
  that alternates (forward, then reversed), so a slot's drift hits all alike.
* ``paired(...)``: per-round differences and ratios, their median and IQR.
* ``ANCHOR``: TensorStore alone reading an Orbax item's arrays whole on its own
  threads (a few reads in flight, results dropped): the decode bound.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

import numpy as np

LEAVES, COLS = 64, 2048
GiB = 2**30


def orbax_run(folder: pathlib.Path, rows: int) -> pathlib.Path:
    """Issue 26's checkpoint: 2 steps of ``LEAVES`` float32 leaves of (rows, COLS), saved by Orbax (default zstd)."""
    import treetools as tt

    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=folder, async_save=False)
    for step in (1, 2):
        rng = np.random.default_rng(step)
        tensors = {f"layer_{i:02d}": rng.standard_normal((rows, COLS), np.float32) for i in range(LEAVES)}
        tt.save_checkpoint(mngr, step, {"params": tensors}, wait=True, force=True)
    mngr.close()
    return folder


def files(*paths: str | os.PathLike) -> list[str]:
    """Every file at or under ``paths``."""
    out = []
    for p in map(str, paths):
        out += [p] if os.path.isfile(p) else [os.path.join(d, f) for d, _, fs in os.walk(p) for f in sorted(fs)]
    return out


def evict(*paths: str | os.PathLike) -> None:
    """Drop these files' pages from the page cache (``posix_fadvise(DONTNEED)``: these files only, nobody else's)."""
    for path in files(*paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: str | os.PathLike) -> None:
    """Remove a file or folder if it is there (a convert's destination between runs)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


@dataclasses.dataclass(frozen=True)
class Run:
    """One process: wall, CPU (user + system, all threads) and system seconds, minor faults, peak RSS (KiB; 0:
    not measured)."""

    wall: float
    cpu: float
    sys: float
    faults: int
    rss_kib: int


GNU_TIME = "/usr/bin/time"
"""GNU time, where installed, measures the peak RSS: a child of this (large) Python process would report this
process's own peak (Linux keeps ``ru_maxrss`` across fork and exec), a grandchild started by ``time`` its own."""


def timed(argv: Sequence[str], *, env: dict[str, str] | None = None, ok: Sequence[int] = (0,)) -> Run:
    """Run ``argv`` to its end (output dropped) and measure it (peak RSS 0 without GNU time)."""
    rss_file = None
    if os.access(GNU_TIME, os.X_OK):
        fd, rss_file = tempfile.mkstemp(prefix="treetools-bench-rss-")
        os.close(fd)
        argv = [GNU_TIME, "-f", "%M", "-o", rss_file, *argv]
    try:
        start = time.perf_counter()
        proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        proc.stderr.close()
        if code not in ok:
            raise RuntimeError(f"{' '.join(argv)}: exit {code}\n{err.decode(errors='replace')[-2000:]}")
        rss = 0
        if rss_file is not None:
            with open(rss_file) as f:
                rss = int(f.read().split()[-1])
    finally:
        if rss_file is not None:
            os.unlink(rss_file)
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_stime, usage.ru_minflt, rss)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A process to time: ``argv``, its environment, exit codes that are fine, and what to do before each run."""

    argv: Sequence[str]
    env: dict[str, str] | None = None
    ok: Sequence[int] = (0,)
    before: Callable[[], None] | None = None

    def run(self) -> Run:
        if self.before is not None:
            self.before()
        return timed(self.argv, env=self.env, ok=self.ok)


def interleaved(variants: dict[str, Variant], rounds: int, *, warmup: bool = True) -> dict[str, list[Run]]:
    """Each variant once per round, the order alternating (forward, reversed); one untimed run of each first."""
    if warmup:
        for v in variants.values():
            v.run()
    out: dict[str, list[Run]] = {k: [] for k in variants}
    for i in range(rounds):
        names = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for name in names:
            out[name].append(variants[name].run())
    return out


def median_iqr(xs: Sequence[float]) -> tuple[float, float, float]:
    """Median and interquartile range (the median thrice for fewer than two values)."""
    xs = list(xs)
    if len(xs) < 2:
        return (xs[0],) * 3
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q1, q3


def beyond(runs: Sequence[Run], base: Sequence[Run], field: str = "wall") -> list[float]:
    """Per round, ``field`` of a command minus the same field of its metadata-only process."""
    return [getattr(a, field) - getattr(b, field) for a, b in zip(runs, base)]


def rates(nbytes: int, runs: Sequence[Run], base: Sequence[Run]) -> list[float] | None:
    """GB/s of ``nbytes`` per round over the wall time beyond ``base``; None when some round has none."""
    spent = beyond(runs, base)
    return None if min(spent) <= 0 else [nbytes / s / 1e9 for s in spent]


def load() -> str:
    """The load average (1, 5, 15 min), as ``os.getloadavg`` gives it."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def program_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` with what the ``treetools`` program sets for its own process (``treetools.cli._process``), as
    variables: for a process that is not the program (the anchor) to run under the same settings."""
    from treetools.cli import _process

    env = dict(os.environ if environ is None else environ)
    if not any(k in env for k in _process.BLAS_THREAD_VARIABLES):
        env["OPENBLAS_NUM_THREADS"] = "1"
    if not _process.user_sets_malloc(env) and _process.glibc_mallopt() is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(_process.MMAP_THRESHOLD)
        env["MALLOC_TRIM_THRESHOLD_"] = str(_process.kept_free(env))
    return env


def treetools_script() -> list[str]:
    """The command users run: the installed ``treetools`` script beside this Python (``-m treetools`` if none)."""
    script = pathlib.Path(sys.executable).parent / "treetools"
    return [str(script)] if script.exists() else [sys.executable, "-m", "treetools"]


ANCHOR = r"""
import collections, json, os, sys
import tensorstore as ts
item, mode = sys.argv[1], sys.argv[2]
window = len(os.sched_getaffinity(0))
ctx = ts.Context()
base = {"driver": "file", "path": item + "/"}
keys = [k.decode() for k in ts.KvStore.open({"driver": "ocdbt", "base": base}, context=ctx).result().list().result()]
zarr3 = any(k.endswith("/zarr.json") for k in keys)
names = sorted({k.rsplit("/", 1)[0] for k in keys if k.endswith(("/.zarray", "/zarr.json"))})
stores = [f.result() for f in [ts.open({"driver": "zarr3" if zarr3 else "zarr", "kvstore": {
    "driver": "ocdbt", "base": base, "path": n}}, read=True, open=True, context=ctx) for n in names]]
if mode == "read":
    pending, total = collections.deque(), 0
    for store in stores:
        pending.append(store.read())
        if len(pending) >= window:
            total += pending.popleft().result().nbytes
    while pending:
        total += pending.popleft().result().nbytes
    print(total)
"""
"""``python -c ANCHOR ITEM_FOLDER open|read``: TensorStore alone on an Orbax item (OCDBT, zarr or zarr3): every
array opened in one context, then (``read``) read whole, as many reads in flight as cores, results dropped."""
