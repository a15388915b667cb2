"""``treetools inspect RUN`` (Orbax metadata only) as a whole process vs ``python -c "import jax"``.

Metadata inspection of an Orbax checkpoint imports neither jax nor orbax
(TensorStore and the files' own metadata suffice), so a user waits less than
the import of jax alone. Both commands are timed side by side, alternating,
median of the rounds; target: at most 0.5x. The checkpoint is a trainer-like
root: two steps of params, params_ema, opt_state (adam) and data_iter, 24
layers of 4 leaves each (about 1,200 leaves per step).
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import optax
import pytest
from conftest import SCALE, report

import treetools as tt

LAYERS = max(int(24 * min(SCALE, 1.0)), 2)
ROUNDS = 7 if SCALE >= 1 else 2


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_speed") / "run"
    params = {f"layer_{i}": {"q": jnp.ones((64, 64)), "k": jnp.ones((64, 64)), "mlp": jnp.ones((64, 256)),
                             "scale": jnp.ones(64)} for i in range(LAYERS)}
    mngr = tt.get_checkpoint_manager(100, checkpoint_dir=root, async_save=False)
    for step in (100, 200):
        tt.save_checkpoint(mngr, step, {"params": params, "params_ema": params,
                                        "opt_state": optax.adam(1e-3).init(params), "data_iter": {"index": step}})
    mngr.close()
    return root


def _wall(argv):
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - t0


def test_inspect_process_vs_import_jax(benchmark, root):
    _versus_import_jax(benchmark, [sys.executable, "-m", "treetools", "inspect", str(root)],
                       "treetools inspect RUN (whole process, Orbax metadata)", target="<= 0.5")


def _versus_import_jax(benchmark, ours_cmd, label, *, target):
    """Median wall time of ``ours_cmd`` against ``python -c "import jax"``, rounds interleaved."""
    jax_cmd = [sys.executable, "-c", "import jax"]
    _wall(ours_cmd), _wall(jax_cmd)  # warm the page cache and the bytecode caches
    ours, anchor = [], []
    for _ in range(ROUNDS):
        anchor.append(_wall(jax_cmd))
        ours.append(_wall(ours_cmd))
    report(label, statistics.median(ours), statistics.median(anchor), 'python -c "import jax"', target=target)
    benchmark.pedantic(lambda: _wall(ours_cmd), rounds=1, iterations=1)


@pytest.mark.parametrize("argv", [["--help"], ["plot", "--help"]], ids=["help", "plot-help"])
def test_help_process_vs_import_jax(benchmark, argv):
    # Where the time of `treetools --help` is measured (tests/test_cli.py proves, by the modules loaded, that it
    # imports no jax; issue 39.2 took the 0.3 s budget out of the tests). The installed script, as users run it.
    script = Path(sys.executable).parent / "treetools"
    ours_cmd = [str(script) if script.exists() else sys.executable, *([] if script.exists() else ["-m", "treetools"]),
                *argv]
    _versus_import_jax(benchmark, ours_cmd, f"treetools {' '.join(argv)} (whole process)", target="<= 0.3")


def _cpu_and_wall(argv):
    """(CPU seconds, wall seconds) of one whole process: CPU time is what a loaded machine stretches least."""
    import resource

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = _wall(argv)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), wall


# The same command line, ended without Python's teardown (the exit the CLI used until issue 36): the anchor.
_NO_TEARDOWN = ("import os, sys\nfrom treetools.cli import main\ncode = main(sys.argv[1:])\nsys.stdout.flush()\n"
                "os._exit(code)\n")


def test_what_the_ordinary_exit_costs(root):
    """``treetools inspect RUN`` ends through ``sys.exit`` (issue 36); its anchor is the same command ending with
    ``os._exit``. Paired rounds, alternating order; the difference is the teardown (target: at most ~25 ms)."""
    ours_cmd = [sys.executable, "-m", "treetools", "inspect", str(root)]
    anchor_cmd = [sys.executable, "-c", _NO_TEARDOWN, "inspect", str(root)]
    _wall(ours_cmd), _wall(anchor_cmd)
    pairs = []
    for i in range(3 * ROUNDS):
        a, b = (ours_cmd, anchor_cmd) if i % 2 == 0 else (anchor_cmd, ours_cmd)
        first, second = _cpu_and_wall(a), _cpu_and_wall(b)
        ours, anchor = (first, second) if a is ours_cmd else (second, first)
        pairs.append((ours, anchor))
    for k, what in ((0, "CPU"), (1, "wall")):
        d = [o[k] - a[k] for o, a in pairs]
        q = statistics.quantiles(d, n=4) if len(d) > 1 else [d[0], d[0], d[0]]
        print(f"[bench] treetools inspect RUN, the ordinary exit ({what}): ours "
              f"{statistics.median(o[k] for o, _ in pairs) * 1e3:.0f} ms, the same ending in os._exit "
              f"{statistics.median(a[k] for _, a in pairs) * 1e3:.0f} ms, paired difference "
              f"{statistics.median(d) * 1e3:+.1f} ms (IQR {q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f}; target <= 25), "
              f"{len(pairs)} rounds, load {os.getloadavg()[0]:.1f}", flush=True)
