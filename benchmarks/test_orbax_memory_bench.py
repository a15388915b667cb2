"""Peak memory on Orbax checkpoints as the bytes grow: ``inspect --stats``, ``verify``, ``diff --values`` (issue 48).

The checkpoints: Orbax's save (through ``write_orbax``) of float32 zero leaves of 64 MiB, each one stored chunk
as Orbax stores an unsharded leaf (a few KB of zstd on disk), 4 / 16 / 64 / 128 leaves: 0.25, 1, 4 and 8 GiB;
a second copy of each for ``diff --values``. At the smoke run's scale, 1 and 2 leaves of 256 KiB.

Each command is one process (the ``treetools`` program), one run per size unless ``TREETOOLS_BENCH_ROUNDS``
says more: peak RSS (GNU time's maximum resident set) and CPU (user + system, ``wait4``). Printed per command:
peak RSS at each size and the ratio of the largest to the smallest (target at most 1.3: the chunks in flight
are the same whatever the number of leaves).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import SCALE
from process_runs import interleaved, load, treetools_script, Variant

FULL = SCALE >= 0.25
ROWS = 4096 if FULL else 16
LEAF = (ROWS, 4096)  # float32: 64 MiB at full scale
COUNTS = (4, 16, 64, 128) if FULL else (1, 2)
ROUNDS = int(os.environ.get("TREETOOLS_BENCH_ROUNDS") or 1)
COMMANDS = ("stats", "verify", "diff_values")


def _zeros(path, leaves: int) -> str:
    from treetools.checkpoint_io.readers import InMemoryReader
    from treetools.checkpoint_io.writers.orbax import write_orbax

    zeros = np.broadcast_to(np.float32(0), LEAF)
    write_orbax(str(path), [(("layers", f"{i:03d}", "w"), InMemoryReader(zeros)) for i in range(leaves)],
                block_bytes=4 * LEAF[0] * LEAF[1])
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("orbax_memory")
    return {n: (_zeros(base / f"a{n}", n), _zeros(base / f"b{n}", n)) for n in COUNTS}


def test_peak_memory_stays_flat_as_the_bytes_grow(checkpoints):
    tt = treetools_script()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    rss: dict[int, dict[str, float]] = {}
    cpu: dict[int, dict[str, float]] = {}
    for n, (a, b) in checkpoints.items():
        variants = {"stats": Variant([*tt, "inspect", "--stats", a], env), "verify": Variant([*tt, "verify", a], env),
                    "diff_values": Variant([*tt, "diff", "--values", a, b], env, ok=(0, 1))}
        runs = interleaved(variants, ROUNDS, warmup=False)
        rss[n] = {k: max(r.rss_kib for r in rs) / 1024 for k, rs in runs.items()}
        cpu[n] = {k: min(r.cpu for r in rs) for k, rs in runs.items()}
    gib = [n * LEAF[0] * LEAF[1] * 4 / 2**30 for n in COUNTS]
    print(f"\n[bench] Orbax memory: load {load()}; leaves of {LEAF[0] * LEAF[1] * 4 / 2**20:g} MiB, "
          f"{' / '.join(f'{g:g}' for g in gib)} GiB", flush=True)
    for name in COMMANDS:
        peaks = " / ".join(f"{rss[n][name]:.0f}" for n in COUNTS)
        cpus = " / ".join(f"{cpu[n][name]:.1f}" for n in COUNTS)
        ratio = rss[COUNTS[-1]][name] / rss[COUNTS[0]][name] if rss[COUNTS[0]][name] else float("nan")
        print(f"[bench] {name}: peak RSS MiB {peaks}; ratio {ratio:.2f} (target <= 1.3); CPU s {cpus}", flush=True)
    assert all(v > 0 for row in cpu.values() for v in row.values())
