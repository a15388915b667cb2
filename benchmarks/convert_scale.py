"""``convert`` of multi-GB checkpoints of 64 MiB one-chunk leaves: CPU, peak RSS and bytes read, against Orbax's own
restore of the same checkpoint, in the same run (issue 48: F2, F3 of the 2026-11-28 scale report).

The source is an Orbax checkpoint (``StandardCheckpointer`` layout, zarr + OCDBT, zstd) of float32 leaves of
4096 x 4096 (64 MiB), each stored as one chunk, as Orbax stores an unsharded leaf; the data is zeros, so it takes
almost no disk (``--data random``: incompressible leaves, where the bytes read show how often each chunk is
decoded). It is written by treetools' Orbax writer (``write_orbax``, Orbax's own save underneath) from
zero-stride arrays, with blocks of a whole leaf, so each leaf is one chunk. Then, each in a child process
(``os.wait4``: that child's user + system CPU and peak RSS; bytes read through ``read()`` from ``/proc/self/io``):

* ``treetools convert SRC OUT.safetensors --no-fsync`` (F2: each stored chunk read and decoded once);
* ``treetools convert SRC OUT --to orbax`` (F3: written chunk by chunk, not assembled);
* the anchor: ``ocp.StandardCheckpointer().restore(SRC)`` (CPU of the call, after imports).

Run it (with ``--treetools PATH`` to measure another checkout, e.g. the main branch before the change)::

    python benchmarks/convert_scale.py --sizes 0.25,1,4 [--treetools /work/main] [--tmp /tmp/convert-bench]
    python benchmarks/convert_scale.py --sizes 8 --skip restore
    python benchmarks/convert_scale.py --sizes 1 --data random --skip orbax
    python benchmarks/convert_scale.py --small-leaves 1000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

LEAF = (4096, 4096)
LEAF_BYTES = 4096 * 4096 * 4
PY = sys.executable

_IO = "import atexit, sys\natexit.register(lambda: sys.stderr.write('\\nRCHAR ' + next(l for l in open('/proc/self/io') if l.startswith('rchar')).split()[1] + '\\n'))\n"
_CLI = _IO + "from treetools.cli import main\nsys.exit(main(sys.argv[1:]))\n"
_RESTORE = _IO + """import os, time, orbax.checkpoint as ocp
t = time.process_time(); tree = ocp.StandardCheckpointer().restore(os.path.abspath(sys.argv[1]))
size = lambda t: sum(size(v) for v in t.values()) if isinstance(t, dict) else t.nbytes
print('INCALL', time.process_time() - t, size(tree))
"""


_MAKE = """import sys, numpy as np
from treetools.checkpoint_io.readers import InMemoryReader
from treetools.checkpoint_io.writers.orbax import write_orbax
if sys.argv[3] == "random":  # one incompressible 64 MiB array, the same in every leaf
    data = np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)
else:
    data = np.broadcast_to(np.float32(0), (4096, 4096))
write_orbax(sys.argv[1], [(("layers", f"{i:03d}", "w"), InMemoryReader(data)) for i in range(int(sys.argv[2]))],
            block_bytes=4096 * 4096 * 4)
"""


_MANY = """import os, sys, numpy as np, orbax.checkpoint as ocp
c = ocp.StandardCheckpointer()
c.save(os.path.abspath(sys.argv[1]), {f"l{i}": np.full((32, 32), i, np.float32) for i in range(int(sys.argv[2]))})
c.wait_until_finished()
"""


def run(code: str, args: list[str], env: dict[str, str]) -> dict:
    """Run ``python -c code args`` (in the temporary folder: ``-c`` puts the working folder first on the path);
    its CPU (user + system of that child, ``os.wait4``), peak RSS and bytes read."""
    proc = subprocess.Popen([PY, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, cwd=tempfile.gettempdir())
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()  # the child writes little
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(err[-3000:])
    rchar = int(err.rsplit("RCHAR ", 1)[1].split()[0]) if "RCHAR " in err else 0
    incall = float(out.split("INCALL ")[1].split()[0]) if "INCALL " in out else None
    return {"cpu": round(usage.ru_utime + usage.ru_stime, 2), "sys": round(usage.ru_stime, 2),
            "rss_mib": round(usage.ru_maxrss / 1024),
            "read_gb": round(rchar / 1e9, 2), "incall_cpu": incall and round(incall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,4", help="GiB, comma separated (16 leaves of 64 MiB a GiB)")
    ap.add_argument("--treetools", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="checkout whose convert is measured (the sources are made with this one)")
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    ap.add_argument("--skip", default="", help="comma separated: safetensors, orbax, restore")
    ap.add_argument("--small-leaves", type=int, default=0,
                    help="instead: N leaves of 4 KiB (Orbax's own save) converted --to orbax, 3 runs (per-leaf cost)")
    ap.add_argument("--data", choices=("zeros", "random"), default="zeros",
                    help="random: incompressible leaves (the source takes its size on disk; bytes read show decodes)")
    a = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip = set(filter(None, a.skip.split(",")))
    if a.small_leaves:
        work = tempfile.mkdtemp(prefix="convert-scale-small-", dir=a.tmp)
        try:
            src = os.path.join(work, "src")
            run(_MANY, [src, str(a.small_leaves)], {"PYTHONPATH": here})
            for _ in range(3):
                row = run(_CLI, ["convert", src, os.path.join(work, "o"), "--to", "orbax"], {"PYTHONPATH": a.treetools})
                print(json.dumps({"small_leaves": a.small_leaves, "treetools": a.treetools, "to_orbax": row}), flush=True)
                shutil.rmtree(os.path.join(work, "o"))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    results = []
    for gib in map(float, a.sizes.split(",")):
        leaves = int(gib * 16)
        work = tempfile.mkdtemp(prefix=f"convert-scale-{gib:g}-", dir=a.tmp)
        try:
            src = os.path.join(work, "src")
            run(_MAKE, [src, str(leaves), a.data], {"PYTHONPATH": here})
            row = {"GiB": gib, "leaves": leaves, "data": a.data, "treetools": a.treetools}
            env = {"PYTHONPATH": a.treetools}
            if "safetensors" not in skip:
                row["to_safetensors"] = run(_CLI, ["convert", src, os.path.join(work, "o.safetensors"), "--no-fsync"], env)
                os.remove(os.path.join(work, "o.safetensors"))
            if "orbax" not in skip:
                try:
                    row["to_orbax"] = run(_CLI, ["convert", src, os.path.join(work, "o"), "--to", "orbax"], env)
                except RuntimeError as e:
                    row["to_orbax"] = {"error": next((line for line in str(e).splitlines() if "error" in line), str(e))[-200:]}
                shutil.rmtree(os.path.join(work, "o"), ignore_errors=True)
            if "restore" not in skip:
                row["orbax_restore"] = run(_RESTORE, [src], {"PYTHONPATH": here})
            for k in ("to_safetensors", "to_orbax"):
                if k in row and "cpu" in row[k] and "orbax_restore" in row:
                    row[k]["ratio_to_restore"] = round(row[k]["cpu"] / row["orbax_restore"]["cpu"], 2)
            print(json.dumps(row), flush=True)
            results.append(row)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
