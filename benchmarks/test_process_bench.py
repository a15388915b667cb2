"""The streaming commands as a user runs them: the installed ``treetools`` script, one whole process per run.

Issue 36 ("measure what a user runs"). The checkpoint is issue 26's: one
CheckpointManager root with 2 steps of 64 float32 leaves of (1024, 2048),
512 MiB a step (rows scaled by TREETOOLS_BENCH_SCALE), saved by Orbax with its
default zstd. Each round runs one process of every row below, in an order that
alternates (forward, then reversed); one untimed run of each first, so the
files are in the page cache as when a user runs a second command on a
checkpoint (one row evicts them first).

* GB/s: logical bytes (a diff reads both steps) over the wall time beyond the
  same round's metadata-only process (``inspect RUN --step 2``; for the diff,
  ``diff RUN --step 1 --step 2`` without ``--values``): per round, then the
  median and interquartile range.
* CPU: user + system seconds of every thread of the process (``wait4``), beyond
  the metadata-only process, per GiB. The machine may be shared: wall figures
  stretch with other jobs, CPU seconds far less.
* A/A control: ``inspect --stats`` again in another slot; its paired ratio to
  the first slot says how far two identical processes drift in this run.
* Anchor: TensorStore alone reading the same 64 arrays whole on its own threads
  (one context, as many reads in flight as cores, results dropped), beyond its
  open-only process, under the settings the ``treetools`` program gives itself
  (``treetools.cli._process``): the decode bound. "vs anchor" is each row's GB/s
  over the anchor's, paired per round.

Each row is one line, ``[bench] NAME | GB/s ... | command``, to paste as it is.
"""

from __future__ import annotations

import compileall
import datetime
import math
import os
import pathlib
import shutil
import sys

import pytest
from conftest import SCALE
from process_runs import (
    ANCHOR,
    COLS,
    GiB,
    LEAVES,
    Run,
    Variant,
    beyond,
    evict,
    interleaved,
    load,
    median_iqr,
    orbax_run,
    program_env,
    rates,
    remove,
    treetools_script,
)

from treetools.checkpoint_io.stream import cores

ROWS = max(8, int(round(1024 * SCALE)))
ROUNDS = 7 if SCALE >= 0.25 else 1
REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("process_bench")
    yield orbax_run(folder / "run", ROWS)
    shutil.rmtree(folder, ignore_errors=True)  # 1 GiB at full size: not left for pytest's retention


def _rows(run: pathlib.Path, out: pathlib.Path) -> dict[str, tuple[Variant, int, str | None]]:
    """name -> (the process, its logical bytes, the name of its metadata-only counterpart)."""
    n = LEAVES * ROWS * COLS * 4
    tt = treetools_script()
    r = str(run)
    dst = out / "model.safetensors"
    meta, diff_meta = "metadata: inspect", "metadata: diff"
    anchor = [sys.executable, "-c", ANCHOR, str(run / "2" / "params")]
    return {
        meta: (Variant([*tt, "inspect", r, "--step", "2"]), 0, None),
        diff_meta: (Variant([*tt, "diff", r, "--step", "1", "--step", "2"], ok=(0, 1)), 0, None),
        "inspect --stats": (Variant([*tt, "inspect", r, "--step", "2", "--stats"]), n, meta),
        "verify": (Variant([*tt, "verify", r, "--step", "2"]), n, meta),
        "diff --values (both steps)": (Variant([*tt, "diff", r, "--step", "1", "--step", "2", "--values"], ok=(0, 1)),
                                       2 * n, diff_meta),
        "convert to .safetensors (fsync)": (Variant([*tt, "convert", r, "--step", "2", str(dst)],
                                                    before=lambda: remove(dst)), n, meta),
        "inspect --stats (A/A)": (Variant([*tt, "inspect", r, "--step", "2", "--stats"]), n, meta),
        "inspect --stats, files evicted": (Variant([*tt, "inspect", r, "--step", "2", "--stats"],
                                                   before=lambda: evict(run / "2")), n, meta),
        "convert, no fsync": (Variant([*tt, "convert", r, "--step", "2", str(dst), "--no-fsync"],
                                      before=lambda: remove(dst)), n, meta),
        "anchor: open only": (Variant([*anchor, "open"], env=program_env()), 0, None),
        "anchor: TensorStore reads": (Variant([*anchor, "read"], env=program_env()), n, "anchor: open only"),
    }


def _command(variant: Variant, run: pathlib.Path, out: pathlib.Path) -> str:
    """The argv as a user types it: ``treetools ...`` with RUN and OUT for the folders."""
    argv = list(variant.argv)
    if argv[:2] == [sys.executable, "-c"]:
        argv = ["python", "-c", "ANCHOR", *argv[3:]]  # benchmarks/process_runs.py
    elif pathlib.Path(argv[0]).name == "treetools":
        argv[0] = "treetools"
    else:
        argv = ["treetools", *argv[3:]]
    return " ".join(argv).replace(str(run), "RUN").replace(str(out), "OUT")


def _line(name: str, nbytes: int, runs: list[Run], base: list[Run], anchor_rates: list[float] | None,
          command: str) -> str:
    wall = median_iqr([r.wall for r in runs])[0]
    base_wall = median_iqr([r.wall for r in base])[0]
    gib = nbytes / GiB
    cpu = median_iqr([c / gib for c in beyond(runs, base, "cpu")])
    sys_ = median_iqr([c / gib for c in beyond(runs, base, "sys")])[0]
    faults = median_iqr([f / (nbytes / 2**20) for f in beyond(runs, base, "faults")])[0]
    rss = median_iqr([r.rss_kib for r in runs])[0] / 1024
    rss_text = f"peak RSS {rss:.0f} MiB (metadata {median_iqr([r.rss_kib for r in base])[0] / 1024:.0f})" if rss else ""
    per_round = rates(nbytes, runs, base)
    if per_round is None:  # tiny smoke sizes: nothing beyond start-up to measure
        speed = "no time beyond metadata at this size"
    else:
        g = median_iqr(per_round)
        speed = f"{g[0]:5.2f} GB/s (IQR {g[1]:.2f}-{g[2]:.2f}) beyond metadata"
        if anchor_rates is not None:
            v = median_iqr([a / b for a, b in zip(per_round, anchor_rates)])
            speed += f", {v[0]:.2f} of the anchor (IQR {v[1]:.2f}-{v[2]:.2f})"
    return (f"[bench] {name:32s} | {speed} | wall {wall * 1e3:.0f} ms, metadata {base_wall * 1e3:.0f} ms | "
            f"CPU {cpu[0]:.2f} s/GiB beyond metadata (IQR {cpu[1]:.2f}-{cpu[2]:.2f}), system {sys_:.2f} | "
            f"{faults:.0f} page faults/MiB | {rss_text} | `{command}`")


def test_streaming_commands_as_whole_processes(run_folder, tmp_path):
    # An installed package has its bytecode compiled; an editable checkout compiles it here once (as pip does).
    compileall.compile_dir(str(REPO / "treetools"), quiet=1)
    rows = _rows(run_folder, tmp_path)
    start_load = load()
    times = interleaved({name: variant for name, (variant, _, _) in rows.items()}, ROUNDS, warmup=SCALE >= 0.25)
    end_load = load()
    n = LEAVES * ROWS * COLS * 4
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n[bench] whole processes of the installed `treetools` script, {now}: Orbax zstd, 2 steps of {LEAVES} "
          f"float32 leaves of ({ROWS}, {COLS}), {n / 2**20:.0f} MiB a step; {cores()} cores; {ROUNDS} interleaved "
          f"rounds, paired medians; load average {start_load} at the start, {end_load} at the end", flush=True)
    given = {k: os.environ[k] for k in ("TREETOOLS_WORKERS", "TREETOOLS_CHUNK_BYTES", "OPENBLAS_NUM_THREADS",
                                        "GLIBC_TUNABLES") if k in os.environ}
    given.update({k: v for k, v in os.environ.items() if k.startswith("MALLOC_")})
    if given:
        print(f"[bench] environment given: {given}", flush=True)
    anchor_rates = rates(n, times["anchor: TensorStore reads"], times["anchor: open only"])
    for name, (variant, nbytes, base) in rows.items():
        if base is None:
            continue
        ref = anchor_rates if not name.startswith("anchor") else None
        print(_line(name, nbytes, times[name], times[base], ref, _command(variant, run_folder, tmp_path)), flush=True)
    for name in ("metadata: inspect", "metadata: diff", "anchor: open only"):
        w = median_iqr([r.wall for r in times[name]])
        c = median_iqr([r.cpu for r in times[name]])
        print(f"[bench] {name:32s} | wall {w[0] * 1e3:.0f} ms (IQR {w[1] * 1e3:.0f}-{w[2] * 1e3:.0f}), CPU "
              f"{c[0] * 1e3:.0f} ms | `{_command(rows[name][0], run_folder, tmp_path)}`", flush=True)
    first = beyond(times["inspect --stats"], times["metadata: inspect"])
    again = beyond(times["inspect --stats (A/A)"], times["metadata: inspect"])
    if min(first) > 0 and min(again) > 0:
        aa = median_iqr([b / a for a, b in zip(first, again)])
        print(f"[bench] A/A control: inspect --stats in two slots, paired ratio of the time beyond metadata "
              f"{aa[0]:.3f} (IQR {aa[1]:.3f}-{aa[2]:.3f})", flush=True)
    dst = tmp_path / "model.safetensors"
    assert dst.stat().st_size > n  # the last convert's output: every tensor and its header
    remove(dst)
    assert all(math.isfinite(r.wall) for rs in times.values() for r in rs)
