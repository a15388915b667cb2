"""The real-size tier (issue 48): multi-GB safetensors files and HF folders, and tens of thousands of leaves.

Checkpoints cost no disk: a safetensors header, then ``truncate`` (holes read as zeros). Every row is a whole
process of the installed ``treetools`` script, measured by ``wait4`` (CPU: user + system of every thread) and GNU
time (peak RSS), with the anchors of the same run beside it:

* ``cat`` of the files to ``/dev/null``: what reading the bytes costs the kernel (a hole is read as zeros from
  the page cache, after one untimed read of every file);
* ``safetensors.safe_open``, the format's own reader: every tensor read whole (numpy), in one process.

Bytes: 32 float32 tensors of 256 MiB to 8 GiB in all (scaled by TREETOOLS_BENCH_SCALE), the same commands at
each size. The peak RSS must not grow with the bytes: the ratio of each command's peak at the largest size to
its peak at the smallest is printed (issue 48: at most 1.3). Convert writes real bytes (zeros) and removes them
after each run.

Leaves: 1,000, 10,000 and 50,000 tensors of 64 float32 (scaled), one file; CPU beyond the metadata-only
``inspect`` of the same file, per leaf, and the exponent of its growth between the smallest and largest count
(issue 48: at most 1.1; the per-leaf cost of ``--stats`` at most 0.3 ms).

Each row is one line, ``[bench] ...``, to paste as it is. Run alone: ``make bench`` runs every suite, or
``.venv/bin/python -m pytest -q -s benchmarks/test_real_size_bench.py --benchmark-enable``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import pytest
from conftest import SCALE
from process_runs import Run, load, remove, timed, treetools_script

GiB = 2**30
TENSORS = 32
SIZES = [s for s in (0.25, 1, 4, 8)] if SCALE >= 1 else [0.25 * SCALE, SCALE]
LEAF_COUNTS = [max(10, int(n * SCALE)) for n in (1_000, 10_000, 50_000)]
ROUNDS = 3 if SCALE >= 0.25 else 1


def sparse_safetensors(path: pathlib.Path, tensors: list[tuple[str, int]]) -> None:
    """A safetensors file of float32 tensors ``(name, elements)``, its data a hole."""
    header, offset = {}, 0
    for name, n in tensors:
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)


SAFE_OPEN = r"""
import sys
from safetensors import safe_open
total = 0
for path in sys.argv[1:]:
    with safe_open(path, "np") as f:
        for name in f.keys():
            total += f.get_tensor(name).nbytes
print(total)
"""
"""``python -c SAFE_OPEN FILE...``: safetensors' own reader, every tensor whole."""


def best(runs: list[Run]) -> Run:
    """The run of least CPU, with the largest peak RSS of all runs (a peak is not noise to take the minimum of)."""
    low = min(runs, key=lambda r: r.cpu)
    return Run(low.wall, low.cpu, low.sys, low.faults, max(r.rss_kib for r in runs))


def measure(argv: list[str], *, rounds: int = ROUNDS, after=None) -> Run:
    runs = []
    for _ in range(rounds):
        runs.append(timed(argv))
        if after is not None:
            after()
    return best(runs)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("real_size")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_bytes(work):
    tt = treetools_script()
    print(f"\n[bench] real-size bytes: {TENSORS} float32 tensors, sizes {SIZES} GiB; load {load()}", flush=True)
    table: dict[str, dict[float, Run]] = {}
    for size in SIZES:
        each = int(size * GiB) // TENSORS // 4
        src = work / f"s{size}.safetensors"
        other = work / f"s{size}-b.safetensors"
        for f in (src, other):
            sparse_safetensors(f, [(f"model.layers.{i}.w", each) for i in range(TENSORS)])
        subprocess.run(["cat", str(src), str(other)], stdout=subprocess.DEVNULL, check=True)  # holes into the cache
        out = work / "out"
        rows = {
            "cat (anchor)": (["cat", str(src)], None),
            "safe_open (anchor)": ([sys.executable, "-c", SAFE_OPEN, str(src)], None),
            "inspect": ([*tt, "inspect", str(src)], None),
            "inspect --stats": ([*tt, "inspect", str(src), "--stats"], None),
            "verify": ([*tt, "verify", str(src)], None),
            "diff --values": ([*tt, "diff", str(src), str(other), "--values"], None),
            "convert .safetensors": ([*tt, "convert", str(src), str(out) + ".safetensors"],
                                     lambda: remove(str(out) + ".safetensors")),
            "convert HF shards": ([*tt, "convert", str(src), str(out), "--shard-size", "1GB"], lambda: remove(out)),
        }
        for name, (argv, after) in rows.items():
            run = measure(argv, after=after, rounds=ROUNDS if size <= 1 else 1)  # 4 and 8 GiB: one run each
            table.setdefault(name, {})[size] = run
            nbytes = 2 * size if name == "diff --values" else size
            print(f"[bench] real-size {name} | {size:g} GiB | CPU {run.cpu:.2f} s ({run.cpu / nbytes:.2f} s/GiB) | "
                  f"peak RSS {run.rss_kib / 1024:.0f} MiB", flush=True)
        for f in (src, other):
            f.unlink()
    lo, hi = SIZES[0], SIZES[-1]
    for name, runs in table.items():
        if name == "safe_open (anchor)" or not runs[lo].rss_kib:
            continue
        ratio = runs[hi].rss_kib / runs[lo].rss_kib
        print(f"[bench] real-size {name} | peak RSS {runs[lo].rss_kib / 1024:.0f} MiB at {lo:g} GiB, "
              f"{runs[hi].rss_kib / 1024:.0f} MiB at {hi:g} GiB | ratio {ratio:.2f} (target at most 1.3)", flush=True)


def test_leaves(work):
    tt = treetools_script()
    print(f"\n[bench] real-size leaves: tensors of 64 float32, counts {LEAF_COUNTS}; load {load()}", flush=True)
    per: dict[str, dict[int, float]] = {}
    for count in LEAF_COUNTS:
        src = work / f"l{count}.safetensors"
        sparse_safetensors(src, [(f"model.layers.{i // 8}.p{i % 8}", 64) for i in range(count)])
        out = work / "lout.safetensors"
        rows = {
            "safe_open (anchor)": ([sys.executable, "-c", SAFE_OPEN, str(src)], None),
            "inspect --stats": ([*tt, "inspect", str(src), "--stats"], None),
            "verify": ([*tt, "verify", str(src)], None),
            "diff --values": ([*tt, "diff", str(src), str(src), "--values"], None),
            "convert": ([*tt, "convert", str(src), str(out)], lambda: remove(out)),
        }
        base = measure([*tt, "inspect", str(src)])
        anchor_base = measure([sys.executable, "-c", "import safetensors"])
        for name, (argv, after) in rows.items():
            run = measure(argv, after=after)
            marginal = run.cpu - (anchor_base.cpu if "anchor" in name else base.cpu)
            per.setdefault(name, {})[count] = marginal
            print(f"[bench] real-size leaves {name} | {count:,} leaves | CPU {run.cpu:.2f} s, beyond "
                  f"{'import' if 'anchor' in name else 'metadata inspect'} {marginal:.2f} s "
                  f"({1e3 * marginal / count:.3f} ms/leaf) | peak RSS {run.rss_kib / 1024:.0f} MiB", flush=True)
        src.unlink()
    lo, hi = LEAF_COUNTS[0], LEAF_COUNTS[-1]
    for name, cpu in per.items():
        if min(cpu[lo], cpu[hi]) <= 0:
            continue
        exponent = math.log(cpu[hi] / cpu[lo]) / math.log(hi / lo)
        print(f"[bench] real-size leaves {name} | exponent {exponent:.2f} from {lo:,} to {hi:,} leaves "
              f"(target at most 1.1) | {1e3 * cpu[hi] / hi:.3f} ms/leaf at {hi:,}", flush=True)


def test_processes(work):
    # The speed-up of --processes on this machine: random float32 (statistics cost CPU, holes would not), 64
    # tensors; and many small leaves, where one process is bound by one core's Python. Wall time, interleaved
    # rounds (1 process, then 2), median ratio; the machine's load is printed beside it.
    import numpy as np
    from safetensors.numpy import save_file

    tt = treetools_script()
    rng = np.random.default_rng(0)
    cases = {
        "64 tensors": {f"w{i}": rng.standard_normal(max(16, int(2**22 * SCALE))).astype(np.float32)
                       for i in range(64)},
        "20,000 leaves": {f"p{i}": rng.standard_normal(64).astype(np.float32)
                          for i in range(max(20, int(2e4 * SCALE)))},
    }
    print(f"\n[bench] real-size processes: load {load()}", flush=True)
    for case, tensors in cases.items():
        src = work / "procs.safetensors"
        save_file(tensors, str(src))
        for command in (["inspect", str(src), "--stats"], ["verify", str(src)]):
            one, two = [], []
            for _ in range(ROUNDS):
                one.append(timed([*tt, *command]))
                two.append(timed([*tt, *command, "--processes", "2"]))
            w1 = sorted(r.wall for r in one)[len(one) // 2]
            w2 = sorted(r.wall for r in two)[len(two) // 2]
            print(f"[bench] real-size processes {command[0]}{' --stats' if '--stats' in command else ''} | {case} | "
                  f"1 process {w1:.2f} s, 2 processes {w2:.2f} s wall | speed-up {w1 / w2:.2f} | CPU "
                  f"{min(r.cpu for r in one):.2f} vs {min(r.cpu for r in two):.2f} s (the second process's jax "
                  "start-up included)", flush=True)
        src.unlink()


def test_processes_convert_orbax(work):
    # `convert --to orbax` by 1 and 2 processes (each writing the leaves it owns into its own OCDBT database,
    # merged by process 0): random float32, 64 tensors of 4 MiB; and 2,000 small leaves. Wall time, interleaved
    # rounds, median; CPU includes the second process (its jax start-up too); peak RSS is the largest process's.
    import numpy as np
    from safetensors.numpy import save_file

    tt = treetools_script()
    rng = np.random.default_rng(0)
    cases = {
        "64 tensors, 256 MiB": {f"w{i}": rng.standard_normal(max(16, int(2**20 * SCALE))).astype(np.float32)
                                for i in range(64)},
        "2,000 leaves of 64": {f"p{i}": rng.standard_normal(64).astype(np.float32)
                               for i in range(max(20, int(2e3 * SCALE)))},
    }
    print(f"\n[bench] real-size processes convert --to orbax: load {load()}", flush=True)
    src, dst = work / "procs.safetensors", work / "procs_orbax"
    for case, tensors in cases.items():
        save_file(tensors, str(src))
        one, two = [], []
        for _ in range(ROUNDS):
            for runs, extra in ((one, []), (two, ["--processes", "2"])):
                runs.append(timed([*tt, "convert", str(src), str(dst), "--to", "orbax", *extra]))
                remove(dst)
        w1 = sorted(r.wall for r in one)[len(one) // 2]
        w2 = sorted(r.wall for r in two)[len(two) // 2]
        print(f"[bench] real-size processes convert --to orbax | {case} | 1 process {w1:.2f} s, 2 processes "
              f"{w2:.2f} s wall | speed-up {w1 / w2:.2f} | CPU {min(r.cpu for r in one):.2f} vs "
              f"{min(r.cpu for r in two):.2f} s | peak RSS {max(r.rss_kib for r in one) / 1024:.0f} vs "
              f"{max(r.rss_kib for r in two) / 1024:.0f} MiB (the largest process)", flush=True)
        src.unlink()
