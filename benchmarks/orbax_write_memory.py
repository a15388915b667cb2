"""Peak memory of ``treetools convert SRC DST --to orbax`` as the ``treetools`` program runs it (its process tuned
by ``treetools/cli/_process.py``), at 1 and 8 GiB: one sparse safetensors file of 64 and 512 float32 leaves of
16 MiB (holes: no disk), each conversion a child process; CPU is its user + system (``os.wait4``), peak RSS its
``VmHWM``. ``--treetools PATH`` measures another checkout (the code before a change, from ``git archive``).

    python benchmarks/orbax_write_memory.py [--treetools PATH] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import preset_scale

from tests.test_real_sizes import sparse_safetensors

PROGRAM = preset_scale._CLI.replace("from treetools.cli import main\nsys.exit(main(sys.argv[1:]))",
                                    "sys.argv = ['treetools', *sys.argv[1:]]\nfrom treetools.cli import run\nrun()")
assert "run()" in PROGRAM  # the program's entry point, which tunes its process, not main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--treetools", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="orbax-write-memory-")
    try:
        for leaves in (64, 512):
            src = os.path.join(tmp, f"{leaves}.safetensors")
            sparse_safetensors(src, [(f"layers.{i}.w", "F32", (2**22,), 4) for i in range(leaves)])
            runs = []
            for _ in range(args.rounds):
                out = os.path.join(tmp, "out")
                runs.append(preset_scale.run(args.treetools, src, out, ["--to", "orbax"], program=PROGRAM))
                shutil.rmtree(out)
            cpu, peak = min(r[0] for r in runs), max(r[1] for r in runs)
            print(f"{leaves * 16 / 1024:g} GiB ({leaves} leaves of 16 MiB): CPU {cpu:.2f} s (least), peak RSS "
                  f"{peak >> 20} MiB (largest of {args.rounds})", flush=True)
            os.unlink(src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
