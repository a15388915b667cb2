"""Cost per leaf: the reading commands on Orbax checkpoints of many tiny leaves (issue 48, F1 of the scale report).

The checkpoints: one CheckpointManager root per size, step 1 with two OCDBT
items (``params`` and ``opt_state``, half the leaves each), every leaf a
float32 (4, 8) (128 bytes: the bytes do not matter, the leaves do); a second
root of the same size with other values for ``diff --values``. Sizes 1,000,
10,000 and 50,000 leaves, scaled by TREETOOLS_BENCH_SCALE (one size at the smoke run's scale), and a
root of 8 leaves for each command's start-up. Orbax takes about a minute of CPU
to write a 50,000-leaf root: each root is written once per run (or, with
``TREETOOLS_BENCH_ROOTS=DIR``, once into ``DIR/a<N>``, ``DIR/b<N>`` and reused by later runs).

Each round runs one process of every row, in an order that alternates
(forward, then reversed); CPU = user + system seconds of every thread of the
process (``wait4``: other jobs on a shared machine do not count), the least of
the rounds (``TREETOOLS_BENCH_ROUNDS``: 3 by default, 1 at the smoke run's scale). Rows:

* ``inspect`` (metadata only: the start-up and the headers), ``inspect --stats``,
  ``verify``, ``diff --values A B``, ``convert --to safetensors`` (the params
  item), ``load_parameters`` (a ``python -c`` process);
* anchor: Orbax's own restore of both items to host numpy (``PyTreeRestore``
  with ``restore_type=np.ndarray``, in a ``python -c`` process), on the same root in the same round.

Printed per command: CPU at each size, the ratio to the anchor at the largest
size, and the growth exponent of the CPU beyond the same command on the 8-leaf
root (its start-up), between the smallest and the largest size, with the slope
between the two largest beside it ("top"); target at most 1.1. And the per-leaf
cost of ``--stats`` beyond ``inspect`` of the same root, at the largest size:
target at most 0.3 ms. Peak RSS of each command at the largest size beside it.
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import SCALE, report
from process_runs import interleaved, load, remove, treetools_script, Variant

BASE = 8
"""Leaves of the root every command's start-up is measured on (imports, the step's files, a few arrays)."""
SIZES = tuple(sorted({max(BASE + 1, int(round(n * SCALE))) for n in (1000, 10000, 50000)}))
ROUNDS = int(os.environ.get("TREETOOLS_BENCH_ROUNDS") or (3 if SCALE >= 0.25 else 1))
COMMANDS = ("inspect", "stats", "verify", "diff_values", "convert", "load_parameters")

BUILD = r"""
import sys
import numpy as np
import orbax.checkpoint as ocp
path, leaves, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def tree(n, seed):
    rng = np.random.default_rng(seed)
    return {f"layer_{i}": {"w": rng.standard_normal((4, 8)).astype(np.float32)} for i in range(n)}
half = leaves // 2
with ocp.CheckpointManager(path, item_names=("params", "opt_state")) as mngr:
    mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(tree(half, seed)),
                                          opt_state=ocp.args.StandardSave(tree(leaves - half, seed + 1))))
    mngr.wait_until_finished()
"""

ORBAX_RESTORE = r"""
import os, sys
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
leaves = 0
for name in ("params", "opt_state"):
    item = os.path.join(sys.argv[1], "1", name)
    handler = ocp.PyTreeCheckpointHandler()
    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), handler.metadata(epath.Path(item)).tree)
    with ocp.Checkpointer(handler) as ckptr:
        leaves += len(jax.tree.leaves(ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=args))))
assert leaves == int(sys.argv[2]), leaves
"""

LOAD = "import sys, treetools as tt; tt.load_parameters(sys.argv[1])"


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """``{leaves: (root A, root B)}``, written by Orbax in a child process each (its memory goes with it)."""
    kept = os.environ.get("TREETOOLS_BENCH_ROOTS")
    base = pathlib.Path(kept) if kept else tmp_path_factory.mktemp("leaf_count")
    out = {}
    for n in (BASE, *SIZES):
        pair = []
        for side, seed in (("a", 0), ("b", 7)):
            path = base / f"{side}{n}"
            if not (kept and (path / "1" / "params" / "_METADATA").is_file()):
                remove(path)
                subprocess.run([sys.executable, "-c", BUILD, str(path), str(n), str(seed)], check=True)
            pair.append(str(path))
        out[n] = tuple(pair)
    return out


def _variants(a: str, b: str, dst: str, leaves: int) -> dict[str, Variant]:
    tt = treetools_script()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return {
        "inspect": Variant([*tt, "inspect", a], env),
        "stats": Variant([*tt, "inspect", "--stats", a], env),
        "verify": Variant([*tt, "verify", a], env),
        "diff_values": Variant([*tt, "diff", "--values", a, b], env, ok=(0, 1)),
        "convert": Variant([*tt, "convert", a, dst, "--to", "safetensors"], env, before=lambda: remove(dst)),
        "load_parameters": Variant([sys.executable, "-c", LOAD, a], env),
        "orbax_restore": Variant([sys.executable, "-c", ORBAX_RESTORE, a, str(leaves)], env),
    }


def _exponent(small: float, large: float, n_small: int, n_large: int) -> float:
    if small <= 0 or large <= 0 or n_large == n_small:
        return math.nan
    return math.log(large / small) / math.log(n_large / n_small)


def test_cpu_per_leaf_grows_linearly(roots, tmp_path):
    cpu: dict[int, dict[str, float]] = {}
    rss: dict[int, dict[str, float]] = {}
    for n, (a, b) in sorted(roots.items()):
        runs = interleaved(_variants(a, b, str(tmp_path / f"out{n}.safetensors"), n), ROUNDS, warmup=ROUNDS > 2)
        cpu[n] = {name: min(r.cpu for r in rs) for name, rs in runs.items()}
        rss[n] = {name: max(r.rss_kib for r in rs) / 1024 for name, rs in runs.items()}
    small, large = SIZES[0], SIZES[-1]
    print(f"\n[bench] leaf count: load {load()}; CPU s (least of {ROUNDS}) at {' / '.join(f'{n:,}' for n in SIZES)} "
          f"leaves; exponent of CPU beyond the same command at {BASE} leaves, {small:,} -> {large:,} leaves",
          flush=True)
    anchor = cpu[large]["orbax_restore"]
    restores = " / ".join(f"{cpu[n]['orbax_restore']:.2f}" for n in SIZES)
    print(f"[bench] orbax_restore (anchor): CPU s {restores}", flush=True)
    for name in COMMANDS:
        figures = " / ".join(f"{cpu[n][name]:.2f}" for n in SIZES)
        beyond = {n: cpu[n][name] - cpu[BASE][name] for n in SIZES}
        k = _exponent(beyond[small], beyond[large], small, large)
        top = _exponent(beyond[SIZES[-2]], beyond[large], SIZES[-2], large) if len(SIZES) > 1 else math.nan
        print(f"[bench] {name}: CPU s {figures} ({cpu[BASE][name]:.2f} at {BASE} leaves); exponent {k:.2f}, "
              f"top {top:.2f} (target <= 1.1); peak RSS {rss[large][name]:.0f} MiB at {large:,}", flush=True)
        report(f"{name} at {large:,} leaves vs Orbax's restore", cpu[large][name], anchor, "orbax restore")
    per_leaf = (cpu[large]["stats"] - cpu[large]["inspect"]) / large
    print(f"[bench] inspect --stats beyond inspect: {per_leaf * 1e3:.3f} ms a leaf at {large:,} leaves "
          f"(target <= 0.3)", flush=True)
    assert all(math.isfinite(v) and v > 0 for row in cpu.values() for v in row.values())
