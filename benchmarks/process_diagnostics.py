"""Where a whole ``treetools`` process spends what an in-process call does not: each suspect measured alone.

Run: ``.venv/bin/python benchmarks/process_diagnostics.py [SECTION ...] [vs REV]`` (about 5 min; not part of
``make bench``; ``TREETOOLS_BENCH_SCALE`` scales the checkpoint, the smoke run uses a tiny one). The checkpoint
is ``test_process_bench.py``'s (2 steps of 64 float32 leaves of (1024, 2048), Orbax zstd). Each section runs its
processes in interleaved rounds (order alternating) and prints medians: wall, CPU (user + system, all
threads), system time and minor page faults; "beyond" is beyond the same round's metadata-only process.

1. ``start``: process start and imports (``python -c pass``, ``import numpy`` with numpy's OpenBLAS threads
   and with one; metadata ``inspect`` with treetools' bytecode compiled and without it).
2. ``fresh``: the same Python code as an in-process call, in a fresh process: ``treetools.cli.main(argv)``
   called 3 times in one process after the program's own settings, against the script's whole process.
3. ``threads``: ``TREETOOLS_WORKERS`` 1, 2 and 4, and the process pinned to one core (``taskset``).
4. ``cache``: the files in the page cache or evicted first (``posix_fadvise``, these files only).
5. ``process``: what the program sets for itself (``treetools.cli._process``) against glibc's and OpenBLAS's
   defaults (``MALLOC_PERTURB_=0``, a no-op, makes the program leave malloc alone; ``OPENBLAS_NUM_THREADS`` =
   the cores is OpenBLAS's default).
6. ``writer``: ``convert`` to a file on disk with fsync (the default), without (``--no-fsync``), and into
   ``/dev/shm``; and the write alone (Python writing the same bytes from one buffer to a new file).
7. ``anchor``: TensorStore alone, the arrays opened in one context (``process_runs.ANCHOR``) or one context
   per array (as treetools opens them), as many reads in flight as cores or twice that.
8. ``vs REV`` (only when asked): the four commands of this checkout against revision REV's, paired.
"""

from __future__ import annotations

import compileall
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from process_runs import (  # noqa: E402
    ANCHOR,
    COLS,
    LEAVES,
    Variant,
    beyond,
    evict,
    interleaved,
    load,
    median_iqr,
    orbax_run,
    program_env,
    remove,
    treetools_script,
)

from treetools.checkpoint_io.stream import cores  # noqa: E402

SCALE = float(os.environ.get("TREETOOLS_BENCH_SCALE", "1.0"))
ROWS = max(8, int(round(1024 * SCALE)))
ROUNDS = 5 if SCALE >= 0.25 else 1
WARMUP = SCALE >= 0.25  # one untimed run of each first (the page cache filled); not at smoke sizes
NBYTES = LEAVES * ROWS * COLS * 4
REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULTS = {"MALLOC_PERTURB_": "0", "OPENBLAS_NUM_THREADS": str(os.cpu_count() or 1)}
"""An environment in which the program sets nothing for itself: glibc's and OpenBLAS's own defaults."""

_CALLS = """
import contextlib, json, os, sys, time
from treetools.cli import _process, main
_process.tune()  # what run() does first
out = []
with open(os.devnull, "w") as null:
    for argv in json.loads(sys.argv[1]):
        t, c = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(null):
            main(argv)
        out.append((time.perf_counter() - t, time.process_time() - c))
print(json.dumps(out))
"""


def _med(xs) -> float:
    return statistics.median(list(xs))


def _table(title: str, times: dict, base: str | None = None, nbytes: int = NBYTES, commands: dict | None = None):
    print(f"\n[diag] {title} ({ROUNDS} rounds, load {load()})", flush=True)
    for name, runs in times.items():
        line = (f"[diag]   {name:44s} wall {_med(r.wall for r in runs) * 1e3:6.0f} ms  CPU "
                f"{_med(r.cpu for r in runs) * 1e3:6.0f} ms  system {_med(r.sys for r in runs) * 1e3:5.0f} ms  "
                f"{_med(r.faults for r in runs):7.0f} faults")
        if base is not None and name != base:
            spent = _med(beyond(runs, times[base]))
            cpu = _med(beyond(runs, times[base], "cpu"))
            if spent > 0:
                line += (f"  | beyond {base}: {spent * 1e3:5.0f} ms, {nbytes / spent / 1e9:5.2f} GB/s, "
                         f"CPU {cpu * 1e3:5.0f} ms")
        if commands and name in commands:
            line += f"  | `{commands[name]}`"
        print(line, flush=True)


def start(run: pathlib.Path) -> None:
    py = sys.executable
    meta = [*treetools_script(), "inspect", str(run), "--step", "2"]
    # This checkout's package copied without its bytecode, first on the path, never compiled (what an editable
    # install costs where PYTHONDONTWRITEBYTECODE is set); numpy and the others keep theirs.
    empty = tempfile.mkdtemp(prefix="treetools-no-bytecode-")
    shutil.copytree(REPO / "treetools", pathlib.Path(empty) / "treetools", ignore=shutil.ignore_patterns("__pycache__"))
    variants = {
        "python -c pass": Variant([py, "-c", "pass"]),
        "import numpy (OpenBLAS: a thread per core)": Variant([py, "-c", "import numpy"],
                                                              env={**os.environ, **DEFAULTS}),
        "import numpy (OPENBLAS_NUM_THREADS=1)": Variant([py, "-c", "import numpy"],
                                                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}),
        "metadata inspect, bytecode compiled": Variant(meta),
        "metadata inspect, treetools without bytecode": Variant(meta, env={**os.environ, "PYTHONPATH": empty,
                                                                           "PYTHONDONTWRITEBYTECODE": "1"}),
    }
    _table("1. start: process start and imports", interleaved(variants, ROUNDS, warmup=WARMUP))
    shutil.rmtree(empty, ignore_errors=True)


def fresh(run: pathlib.Path) -> None:
    r = str(run)
    meta = ["inspect", r, "--step", "2"]
    commands = {"inspect --stats": [*meta, "--stats"], "verify": ["verify", r, "--step", "2"]}
    print(f"\n[diag] 2. fresh: the same Python code in a fresh process and in a warm one ({ROUNDS} rounds, "
          f"load {load()})", flush=True)
    for name, argv in commands.items():
        whole = {"metadata": Variant([*treetools_script(), *meta]), name: Variant([*treetools_script(), *argv])}
        calls = [meta, argv, argv, argv]
        inner = []
        for _ in range(ROUNDS):
            times = interleaved(whole, 1, warmup=False)
            proc = subprocess.run([sys.executable, "-c", _CALLS, json.dumps(calls)], capture_output=True, text=True,
                                  check=True)
            inner.append((times, json.loads(proc.stdout.splitlines()[-1])))
        process = _med(t[name][0].wall - t["metadata"][0].wall for t, _ in inner)
        process_cpu = _med(t[name][0].cpu - t["metadata"][0].cpu for t, _ in inner)
        first = [_med(c[i][0] for _, c in inner) for i in range(4)]
        first_cpu = [_med(c[i][1] for _, c in inner) for i in range(4)]
        print(f"[diag]   {name:16s} whole process beyond the metadata process: {process * 1e3:5.0f} ms "
              f"(CPU {process_cpu * 1e3:4.0f}) | in one process, main() after metadata main(): first call "
              f"{first[1] * 1e3:5.0f} ms (CPU {first_cpu[1] * 1e3:4.0f}), warm calls {first[2] * 1e3:5.0f} and "
              f"{first[3] * 1e3:5.0f} ms (CPU {first_cpu[2] * 1e3:4.0f}, {first_cpu[3] * 1e3:4.0f}); the metadata "
              f"call {first[0] * 1e3:4.0f} ms", flush=True)


def threads(run: pathlib.Path) -> None:
    r, tt = str(run), treetools_script()
    meta, commands = {}, {}
    for name, argv in (("inspect --stats", ["inspect", r, "--step", "2", "--stats"]),
                       ("verify", ["verify", r, "--step", "2"])):
        for label, env in (("TREETOOLS_WORKERS=1", "1"), ("the default", None), ("TREETOOLS_WORKERS=4", "4")):
            given = {**os.environ, "TREETOOLS_WORKERS": env} if env else None
            meta[f"{name}, {label}"] = Variant([*tt, *argv], env=given)
        if shutil.which("taskset") and cores() > 1:
            meta[f"{name}, taskset -c 0"] = Variant(["taskset", "-c", "0", *tt, *argv])
    variants = {"metadata": Variant([*tt, "inspect", r, "--step", "2"]), **meta}
    if shutil.which("taskset") and cores() > 1:
        variants["metadata, taskset -c 0"] = Variant(["taskset", "-c", "0", *tt, "inspect", r, "--step", "2"])
    _table("3. threads: the block engine's threads, and one core", interleaved(variants, ROUNDS, warmup=WARMUP),
           "metadata")


def cache(run: pathlib.Path) -> None:
    r, tt = str(run), treetools_script()
    variants = {
        "metadata": Variant([*tt, "inspect", r, "--step", "2"]),
        "inspect --stats, files in the page cache": Variant([*tt, "inspect", r, "--step", "2", "--stats"]),
        "inspect --stats, files evicted first": Variant([*tt, "inspect", r, "--step", "2", "--stats"],
                                                        before=lambda: evict(run / "2")),
        "cat of the step's files, cached": Variant(["sh", "-c", f"cat $(find {run / '2'} -type f) > /dev/null"]),
        "cat of the step's files, evicted first": Variant(["sh", "-c", f"cat $(find {run / '2'} -type f) > /dev/null"],
                                                          before=lambda: evict(run / "2")),
    }
    _table("4. cache: page cache, warm or cold", interleaved(variants, ROUNDS, warmup=WARMUP), "metadata")


def process(run: pathlib.Path) -> None:
    r, tt = str(run), treetools_script()
    old = {**os.environ, **DEFAULTS}
    variants = {}
    for name, argv in (("metadata", ["inspect", r, "--step", "2"]),
                       ("inspect --stats", ["inspect", r, "--step", "2", "--stats"]),
                       ("verify", ["verify", r, "--step", "2"]),
                       ("diff --values", ["diff", r, "--step", "1", "--step", "2", "--values"])):
        variants[f"{name}, the program's settings"] = Variant([*tt, *argv], ok=(0, 1))
        variants[f"{name}, glibc's and OpenBLAS's defaults"] = Variant([*tt, *argv], env=old, ok=(0, 1))
    times = interleaved(variants, ROUNDS, warmup=WARMUP)
    print(f"\n[diag] 5. process: what the program sets for itself, or not ({ROUNDS} rounds, load {load()})", flush=True)
    for name in variants:
        runs = times[name]
        base = times["metadata, " + name.split(", ", 1)[1]]
        line = (f"[diag]   {name:52s} wall {_med(x.wall for x in runs) * 1e3:6.0f} ms  CPU "
                f"{_med(x.cpu for x in runs) * 1e3:6.0f} ms  system {_med(x.sys for x in runs) * 1e3:5.0f} ms  "
                f"{_med(x.faults for x in runs):7.0f} faults  peak RSS {_med(x.rss_kib for x in runs) / 1024:4.0f} MiB")
        if not name.startswith("metadata"):
            nbytes = 2 * NBYTES if name.startswith("diff") else NBYTES
            spent = _med(beyond(runs, base))
            if spent > 0:
                line += (f"  | beyond metadata {nbytes / spent / 1e9:5.2f} GB/s, CPU "
                         f"{_med(beyond(runs, base, 'cpu')) / (nbytes / 2**30):.2f} s/GiB")
        print(line, flush=True)


def writer(run: pathlib.Path, scratch: pathlib.Path) -> None:
    r, tt = str(run), treetools_script()
    disk = scratch / "model.safetensors"
    shm = pathlib.Path("/dev/shm") / f"treetools-diag-{os.getpid()}.safetensors"
    write = ("import os, sys, numpy as np\nblock = np.random.default_rng(0).standard_normal(%d, np.float32)\n"
             "with open(sys.argv[1], 'wb') as f:\n    for _ in range(%d):\n        f.write(block)\n"
             "    f.flush()\n    if sys.argv[2] == '1':\n        os.fsync(f.fileno())\n"
             ) % (2 * 2**20, NBYTES // 2**23 or 1)
    variants = {
        "metadata": Variant([*tt, "inspect", r, "--step", "2"]),
        "convert to disk (fsync)": Variant([*tt, "convert", r, "--step", "2", str(disk)], before=lambda: remove(disk)),
        "convert to disk, --no-fsync": Variant([*tt, "convert", r, "--step", "2", str(disk), "--no-fsync"],
                                               before=lambda: remove(disk)),
        "python start + numpy + one 8 MiB buffer": Variant([sys.executable, "-c", write.split("with open")[0]],
                                                           env=program_env()),
        "the write alone: same bytes to disk": Variant([sys.executable, "-c", write, str(disk), "0"],
                                                       env=program_env(), before=lambda: remove(disk)),
        "the write alone, fsync": Variant([sys.executable, "-c", write, str(disk), "1"], env=program_env(),
                                          before=lambda: remove(disk)),
    }
    if os.access("/dev/shm", os.W_OK):
        variants["convert to /dev/shm (memory)"] = Variant([*tt, "convert", r, "--step", "2", str(shm)],
                                                           before=lambda: remove(shm))
    try:
        times = interleaved(variants, ROUNDS, warmup=WARMUP)
    finally:
        remove(shm)
    _table("6. writer: convert's write and fsync", {k: v for k, v in times.items() if not k.startswith(("python",
           "the write"))}, "metadata")
    _table("6. writer: the write alone", {k: v for k, v in times.items() if k.startswith(("python", "the write"))},
           "python start + numpy + one 8 MiB buffer")


def anchor(run: pathlib.Path) -> None:
    item = str(run / "2" / "params")
    per_array = ANCHOR.replace(
        "stores = [f.result() for f in [ts.open(",
        "stores = [f.result() for f in [ts.open(").replace(
        '"path": n}}, read=True, open=True, context=ctx) for n in names]]',
        '"path": n}}, read=True, open=True, context=ts.Context()) for n in names]]')
    twice = "window = 2 * len(os.sched_getaffinity(0))"
    variants = {
        "open only, one context": Variant([sys.executable, "-c", ANCHOR, item, "open"], env=program_env()),
        "read, one context, reads in flight = cores": Variant([sys.executable, "-c", ANCHOR, item, "read"],
                                                              env=program_env()),
        "read, one context, 2 x cores in flight": Variant([sys.executable, "-c", ANCHOR.replace(
            "window = len(os.sched_getaffinity(0))", twice), item, "read"], env=program_env()),
        "read, a context per array, cores in flight": Variant([sys.executable, "-c", per_array, item, "read"],
                                                              env=program_env()),
        "read, a context per array, 2 x cores": Variant([sys.executable, "-c", per_array.replace(
            "window = len(os.sched_getaffinity(0))", twice), item, "read"], env=program_env()),
    }
    _table("7. anchor: TensorStore alone", interleaved(variants, ROUNDS, warmup=WARMUP), "open only, one context")


def versus(run: pathlib.Path, scratch: pathlib.Path, rev: str) -> None:
    """This checkout's commands against revision ``rev``'s (its ``treetools`` package from ``git archive``, first on
    ``PYTHONPATH``; the same script, interpreter and libraries), paired per round, each beyond its own metadata."""
    old = scratch / "rev"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "treetools"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    compileall.compile_dir(str(old / "treetools"), quiet=1)
    r, tt, dst = str(run), treetools_script(), scratch / "model.safetensors"
    then = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(old)}
    commands = {"metadata": ["inspect", r, "--step", "2"], "inspect --stats": ["inspect", r, "--step", "2", "--stats"],
                "verify": ["verify", r, "--step", "2"],
                "diff --values": ["diff", r, "--step", "1", "--step", "2", "--values"],
                "convert": ["convert", r, "--step", "2", str(dst)]}
    variants = {}
    for name, argv in commands.items():
        for label, env in (("this checkout", None), (rev, then)):
            variants[(name, label)] = Variant([*tt, *argv], env=env, ok=(0, 1), before=lambda: remove(dst))
    times = interleaved({f"{name} | {label}": v for (name, label), v in variants.items()}, ROUNDS, warmup=WARMUP)
    print(f"\n[diag] 8. versus {rev}: this checkout / {rev}, beyond each one's own metadata process, paired "
          f"({ROUNDS} rounds, load {load()})", flush=True)
    for name in list(commands)[1:]:
        a, b = times[f"{name} | this checkout"], times[f"{name} | {rev}"]
        ma, mb = times["metadata | this checkout"], times[f"metadata | {rev}"]
        nbytes = 2 * NBYTES if name.startswith("diff") else NBYTES
        parts = []
        for field in ("wall", "cpu"):
            new_, old_ = beyond(a, ma, field), beyond(b, mb, field)
            if min(new_) > 0 and min(old_) > 0:
                mid, q1, q3 = median_iqr([x / y for x, y in zip(new_, old_)])
                parts.append(f"{field} {_med(new_) * 1e3:5.0f} vs {_med(old_) * 1e3:5.0f} ms, ratio {mid:.3f} "
                             f"(IQR {q1:.3f}-{q3:.3f})")
        faults = f"faults {_med(x.faults for x in a):.0f} vs {_med(x.faults for x in b):.0f}"
        rss = f"peak RSS {_med(x.rss_kib for x in a) / 1024:.0f} vs {_med(x.rss_kib for x in b) / 1024:.0f} MiB"
        speed = ""
        if min(beyond(a, ma)) > 0 and min(beyond(b, mb)) > 0:
            speed = (f"{nbytes / _med(beyond(a, ma)) / 1e9:.2f} vs {nbytes / _med(beyond(b, mb)) / 1e9:.2f} GB/s; ")
        print(f"[diag]   {name:16s} {speed}{'; '.join(parts)}; {faults}; {rss}", flush=True)
    meta_cpu = [x.cpu / y.cpu for x, y in zip(times["metadata | this checkout"], times[f"metadata | {rev}"])]
    print(f"[diag]   metadata process CPU {_med(x.cpu for x in times['metadata | this checkout']) * 1e3:.0f} vs "
          f"{_med(x.cpu for x in times[f'metadata | {rev}']) * 1e3:.0f} ms, ratio {_med(meta_cpu):.3f}", flush=True)


SECTIONS = {"start": start, "fresh": fresh, "threads": threads, "cache": cache, "process": process,
            "writer": writer, "anchor": anchor}


def main(names: list[str]) -> None:
    """Run the sections named (default: all); ``vs REV`` adds section 8 against revision REV."""
    rev = None
    if "vs" in names:
        i = names.index("vs")
        rev, names = names[i + 1], names[:i] + names[i + 2:]
    compileall.compile_dir(str(REPO / "treetools"), quiet=1)  # as an installed package has it
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="treetools-diag-"))
    try:
        run = orbax_run(scratch / "run", ROWS)
        print(f"[diag] Orbax zstd, 2 steps of {LEAVES} float32 leaves of ({ROWS}, {COLS}), {NBYTES / 2**20:.0f} MiB "
              f"a step; {cores()} cores; load {load()}", flush=True)
        for name in names or ([] if rev else list(SECTIONS)):
            fn = SECTIONS[name]
            fn(run, scratch) if name == "writer" else fn(run)
        if rev is not None:
            versus(run, scratch, rev)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
