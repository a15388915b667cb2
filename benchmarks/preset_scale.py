"""A preset conversion against a plain convert of the same Hugging Face folder, at 1, 4 and 8 GiB: CPU, peak RSS and
bytes read (issues 46 and 48: a preset conversion streams in the bounded memory of a plain convert).

The source is a sparse Llama-shaped HF folder (tests/_sparse_llama.py): TinyLlama-1.1B's shapes in float32
(vocab 32000, hidden 2048, ffn 5632, 32 heads, 4 kv heads), an untied lm_head, as many layers as make the size,
in shards of 2 GB whose data are holes (no disk). Every projection and the lm_head is transposed by both presets;
``llama:hf:maxtext`` also stacks the layers, reshapes the heads and permutes q and k. Each command runs in a
child process of the ``treetools`` CLI; CPU is the child's user + system (``os.wait4``), peak RSS its ``VmHWM``
and bytes read its ``rchar`` (``/proc/self/io``), both read at exit. Safetensors output is written for real (zeros)
and removed after each run; Orbax output is compressed zeros.

The MaxText save is then converted back to safetensors, plain and with ``llama:maxtext:hf``. Then one leaf alone: a Llama-3-sized ``lm_head`` (128256 x 4096 float32, 2 GiB, a hole) transposed by a plain rule
(``--transpose``), the leaf whose C-order blocks each read a piece of all its 128256 rows.

Run it (``--treetools PATH``: measure another checkout, e.g. the main branch before the change)::

    python benchmarks/preset_scale.py --sizes 1,4,8 [--treetools /work/main] [--tmp /tmp/preset-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import _sparse_llama as llama
from tests.test_real_sizes import sparse_safetensors

LM_HEAD = (128256, 4096)
LAYER_BYTES = 4 * (2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 5632 * 2048 + 2 * 2048)
FIXED_BYTES = 4 * (2 * 32000 * 2048 + 2048)

_CLI = """
import atexit, sys
def _report():
    hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]
    rchar = next(l for l in open('/proc/self/io') if l.startswith('rchar')).split()[1]
    sys.stderr.write(f'\\nPEAK {hwm} {rchar}\\n')
atexit.register(_report)
from treetools.cli import main
sys.exit(main(sys.argv[1:]))
"""

COMMANDS = {
    "convert (plain)": [],
    "--preset llama:hf:reference": ["--preset", "llama:hf:reference", "--to", "safetensors"],
    "convert --to orbax (plain)": ["--to", "orbax"],
    "--preset llama:hf:maxtext --to orbax": ["--preset", "llama:hf:maxtext", "--to", "orbax"],
}

BACK = {
    "that MaxText save: convert (plain)": [],
    "that MaxText save: --preset llama:maxtext:hf": ["--preset", "llama:maxtext:hf"],
}
"""Run on the ``llama:hf:maxtext --to orbax`` output (its stacked leaves stored in chunks of whole source rows)."""


def run(code: str, src: str, out: str, args: list[str], program: str = _CLI) -> tuple[float, int, int]:
    """``treetools convert SRC OUT ARGS`` in a child running ``program`` (``main()`` by default): (CPU seconds, peak
    RSS bytes, bytes read)."""
    env = {**os.environ, "PYTHONPATH": code, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", program, "convert", src, out, "--shard-size", "2GB", *args],
                            cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own CPU, every thread
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"convert {args} failed: {err[-2000:]}")
    line = next(x for x in reversed(err.splitlines()) if x.startswith("PEAK "))
    hwm, rchar = (int(v) for v in line.split()[1:])
    return usage.ru_utime + usage.ru_stime, hwm * 1024, rchar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,8", help="GiB of the folders, comma separated")
    parser.add_argument("--treetools", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout to measure (its root is put first on PYTHONPATH)")
    parser.add_argument("--tmp", default=None, help="where the folders and outputs go (default: a temporary dir)")
    args = parser.parse_args()
    work = args.tmp or tempfile.mkdtemp(prefix="preset-bench-")
    os.makedirs(work, exist_ok=True)
    print(f"[bench] preset_scale: {args.treetools}")
    print("| folder | command | CPU s | peak RSS MiB | read GiB |")
    print("|---|---|---|---|---|")
    try:
        for size in (float(s) for s in args.sizes.split(",")):
            layers = max(1, round((size * 2**30 - FIXED_BYTES) / LAYER_BYTES))
            src = os.path.join(work, f"hf-{size:g}")
            llama.sparse_llama(src, layers=layers, tied=False, shard_bytes=2 * 10**9, **llama.TINYLLAMA)
            total = llama.folder_bytes(src)
            for name, extra in COMMANDS.items():
                out = os.path.join(work, "out")
                shutil.rmtree(out, ignore_errors=True)
                cpu, hwm, rchar = run(args.treetools, src, out, extra)
                print(f"| {total / 2**30:.2f} GiB ({layers} layers) | {name} | {cpu:.1f} | {hwm / 2**20:.0f} | "
                      f"{rchar / 2**30:.2f} |", flush=True)
                if "llama:hf:maxtext" in extra:  # and back, from that MaxText save
                    for back, more in BACK.items():
                        again = os.path.join(work, "back")
                        shutil.rmtree(again, ignore_errors=True)
                        cpu, hwm, rchar = run(args.treetools, out, again, more)
                        shutil.rmtree(again, ignore_errors=True)
                        print(f"| {total / 2**30:.2f} GiB ({layers} layers) | {back} | {cpu:.1f} | "
                              f"{hwm / 2**20:.0f} | {rchar / 2**30:.2f} |", flush=True)
                shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(src)
        src = os.path.join(work, "lm_head.safetensors")
        sparse_safetensors(src, [("lm_head.weight", "F32", LM_HEAD, 4)])
        out = os.path.join(work, "out.safetensors")
        cpu, hwm, rchar = run(args.treetools, src, out, ["--transpose", r"lm_head\.weight$=1,0"])
        os.remove(out)
        os.remove(src)
        print(f"| 2.00 GiB (lm_head {LM_HEAD[0]} x {LM_HEAD[1]}) | --transpose 'lm_head\\.weight$=1,0' | {cpu:.1f} | "
              f"{hwm / 2**20:.0f} | {rchar / 2**30:.2f} |", flush=True)
    finally:
        if args.tmp is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
