"""Whole-process metadata ``treetools inspect`` of this checkout against another revision's, interleaved.

Usage: ``.venv/bin/python benchmarks/exit_cost_vs_rev.py REV [ROUNDS]`` (run from the checkout). REV's
``treetools`` package is extracted with ``git archive`` into a temporary folder and put first on
``PYTHONPATH``; both run through this checkout's installed ``treetools`` script, with the same interpreter
and libraries, on a trainer-like Orbax root (two steps of params, params_ema, Adam state and data_iter, 24
layers of 4 leaves). Also timed: this checkout's command ending in ``os._exit`` (no teardown), ``python -c
"import jax"``, and the libraries alone (``import numpy, tensorstore, tabulate``) ending normally and in
``os._exit``. Prints medians and paired differences of wall and CPU time (CPU is what a loaded machine
stretches least).
"""

import compileall
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _root(folder: pathlib.Path) -> pathlib.Path:
    import jax.numpy as jnp
    import optax

    import treetools as tt

    params = {f"layer_{i}": {"q": jnp.ones((64, 64)), "k": jnp.ones((64, 64)), "mlp": jnp.ones((64, 256)),
                             "scale": jnp.ones(64)} for i in range(24)}
    mngr = tt.get_checkpoint_manager(100, checkpoint_dir=folder / "run", async_save=False)
    for step in (100, 200):
        tt.save_checkpoint(mngr, step, {"params": params, "params_ema": params,
                                        "opt_state": optax.adam(1e-3).init(params), "data_iter": {"index": step}})
    mngr.close()
    return folder / "run"


def _run(argv, env):
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main(rev: str, rounds: int) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="exit_cost_"))
    old = work / "old"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "treetools"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    compileall.compile_dir(str(old / "treetools"), quiet=1)
    compileall.compile_dir(str(REPO / "treetools"), quiet=1)
    root = str(_root(work))
    script = str(pathlib.Path(sys.executable).parent / "treetools")
    here = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    then = {**here, "PYTHONPATH": str(old)}
    libs = "import numpy, tensorstore, tabulate"
    variants = {
        "this checkout": ([script, "inspect", root], here),
        rev: ([script, "inspect", root], then),
        "this checkout, os._exit": ([sys.executable, "-c", "import os, sys\nfrom treetools.cli import main\n"
                                     "c = main(['inspect', sys.argv[1]])\nsys.stdout.flush()\nos._exit(c)", root], here),
        "libraries alone": ([sys.executable, "-c", libs], here),
        "libraries alone, os._exit": ([sys.executable, "-c", libs + "\nimport os\nos._exit(0)"], here),
        'python -c "import jax"': ([sys.executable, "-c", "import jax"], here),
    }
    for argv, env in variants.values():
        _run(argv, env)
    times = {k: [] for k in variants}
    for i in range(rounds):
        items = list(variants.items())
        for name, (argv, env) in (items if i % 2 == 0 else items[::-1]):
            times[name].append(_run(argv, env))
    for k, what in ((0, "wall"), (1, "CPU")):
        for name, base in (("this checkout", rev), ("this checkout, os._exit", rev),
                           ("libraries alone", "libraries alone, os._exit")):
            d = [a[k] - b[k] for a, b in zip(times[name], times[base])]
            q = statistics.quantiles(d, n=4)
            print(f"[bench] {what}: {name} {statistics.median(t[k] for t in times[name]) * 1e3:.0f} ms vs {base} "
                  f"{statistics.median(t[k] for t in times[base]) * 1e3:.0f} ms: paired {statistics.median(d) * 1e3:+.1f} "
                  f"ms (IQR {q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f})", flush=True)
        jax_t = statistics.median(t[k] for t in times['python -c "import jax"'])
        print(f'[bench] {what}: python -c "import jax" {jax_t * 1e3:.0f} ms', flush=True)
    print(f"[bench] {rounds} rounds, load {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 21)
